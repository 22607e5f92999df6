"""Cluster operations as library calls: init, ssh-setup, exec, sync, top, and job control.

The CLI modules (``cli/ops.py``, ``cli/jobs.py``, ``cli/top.py``) parse and render; these
modules do the work over a Transport. Import the submodule you need: this package imports
nothing itself, so ``launch`` can use ``ops.detach`` without an import cycle.
"""
