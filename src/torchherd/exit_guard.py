"""A herd worker's exit: Gloo's threads get the GIL before the interpreter shuts down, and
the shutdown does not sweep torch's heap again.

After a job's last collective, Gloo's worker threads still release the finished work, and
releasing a tensor that Python has let go of takes the GIL. If the interpreter is already
shutting down by then, CPython 3.11 ends the thread inside a C++ destructor and the process
aborts ("terminate called without an active exception", SIGABRT) although the script had
finished: a few runs in a hundred under load, with DDP, FSDP or the Hugging Face Trainer alike
(open upstream as pytorch/pytorch#190489), and herd would report the job failed.

The cure is to wait a moment with the GIL free while the interpreter is still whole: exit
handlers run then. How herd's workers, and only they, get that wait:

- the node's torchrun wrapper (``agent.elastic``) calls ``for_workers`` on the environment
  torchrun passes to the workers: it puts ``torchherd/_worker_site`` first on PYTHONPATH;
- each worker's interpreter then loads that directory's ``sitecustomize`` at start, which calls
  ``install`` and then loads whatever ``sitecustomize`` it hides;
- ``install`` registers the wait in a process herd started as a worker (HERD_JOB_ID and
  torchrun's RANK set), and the wait happens only where torch.distributed was imported.

No other program is touched: nothing is registered with torch or Python for the whole
environment, so a broken or moved torchherd cannot break anyone's ``import torch``. Scripts
need no change; ``train.teardown()`` waits the same way under plain torchrun. A worker started
with ``python -S``, ``-E`` or ``-I`` reads no sitecustomize (or no PYTHONPATH) and gets no wait.
Not a torch import itself: the launcher side may load this module.

The same last exit handler spares a worker that imported torch the interpreter's final
sweeps: Python's shutdown runs its cyclic garbage collector over the whole heap several times
while it tears the modules down, and torch's heap is large (~0.5 s of CPU per process here,
a third of the CPU of `python -c "import torch"`, bench/worker_exit.py). The handler collects
once (the garbage there is at exit is finalised as before: its ``__del__`` and weakref
callbacks run), then freezes what is left alive (``gc.freeze``), which the shutdown's sweeps
then skip. Those objects are still released one by one as the modules go; only reference
cycles that the modules' teardown itself leaves unreachable are not collected, which Python
does not promise at exit anyway. Every other exit handler has run before (this one was
registered first, at start, so it runs last).
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time
from collections.abc import MutableMapping

from .agent.protocol import JOB_ID_VAR

__all__ = ["WORKER_SITE", "for_workers", "install", "let_threads_finish", "spare_the_final_sweeps"]

# Gloo's threads need microseconds on an idle machine; this covers a loaded one.
DRAIN_SECONDS = 0.25

WORKER_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker_site")
"""The directory whose sitecustomize installs the wait in herd's workers."""

_installed = False


def for_workers(env: MutableMapping[str, str]) -> None:
    """Put WORKER_SITE first on PYTHONPATH in ``env``, the environment the workers inherit."""
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != WORKER_SITE]
    env["PYTHONPATH"] = os.pathsep.join([WORKER_SITE, *paths])


def install() -> None:
    """Register the wait at exit, in a process herd started as a worker; otherwise nothing.
    Never raises: it runs while a worker's interpreter starts."""
    global _installed
    try:
        if not _installed and os.environ.get(JOB_ID_VAR) and "RANK" in os.environ:
            atexit.register(_at_exit)
            _installed = True
    except Exception:  # noqa: BLE001 - never stop a worker from starting
        pass


def _at_exit() -> None:
    # Only a process that imported torch.distributed can have Gloo's threads (a worker's own
    # child processes, a data loader's or a plain `python -c`, leave at once).
    if "torch.distributed" in sys.modules:
        let_threads_finish()
    if "torch" in sys.modules:
        spare_the_final_sweeps()


def spare_the_final_sweeps() -> None:
    """Collect the garbage there is now, then freeze the rest: the interpreter's shutdown
    does not sweep torch's heap again (the module docstring says what that changes)."""
    gc.collect()
    gc.freeze()


def let_threads_finish() -> None:
    """Leave the GIL to other threads for a moment (Gloo's, releasing finished collectives)."""
    time.sleep(DRAIN_SECONDS)
