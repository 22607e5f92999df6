"""``herd env``: one Python environment, named by a hash, built the same on every node.

``identity`` says what the environment is (a lock, a pinned requirements file, or the
launcher's own environment) and hashes it; ``resolve`` finds the wheels of each node's
platform on the launcher (a wheel folder the user names, or fetched once with pip);
``ship`` asks each node what it has, sends only what it lacks over herd's own transport and has
the node build the environment beside the old one (``agent/envnode.py``, standard library only).
"""
