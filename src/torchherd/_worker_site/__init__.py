"""A directory put first on herd's workers' PYTHONPATH (by the node's torchrun wrapper, see
``exit_guard.for_workers``) so that their interpreters load its ``sitecustomize``. Nothing here
is imported as ``torchherd._worker_site``; the package marker only ships the file."""
