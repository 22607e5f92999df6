"""A FAKE PBS for the tests: no registry packages OpenPBS, so PBS cannot run here.

It reproduces what herd depends on in a real PBS allocation (see allocation.py), and its
commands (bin/: qsub, qstat, qdel, pbsdsh, pbs_attach) record every call they get in
``$FAKE_PBS_DIR/calls.jsonl``. Everything here is named a fake; nothing in it is PBS.
"""
