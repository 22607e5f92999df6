"""Gives Gloo's threads the GIL before a herd worker's interpreter shuts down.

After a job's last collective, Gloo's worker threads still release the finished work, and
releasing a tensor that Python has let go of takes the GIL. If the interpreter is already
shutting down by then, CPython 3.11 ends the thread inside a C++ destructor and the process
aborts ("terminate called without an active exception", SIGABRT) although the script had
finished: a few runs in a hundred under load, with DDP, FSDP or the Hugging Face Trainer alike
(open upstream as pytorch/pytorch#190489), and herd would report the job failed.

The cure is to wait a moment with the GIL free while the interpreter is still whole: exit
handlers run then. torch calls ``install`` at ``import torch`` (its "torch.backends" plugin
entry point, run in every process that imports torch); in herd's workers (HERD_JOB_ID and
torchrun's RANK set) it registers that wait, and elsewhere it does nothing. So scripts need
no change. It must never raise, or ``import torch`` would fail. Not a torch import itself:
the launcher side may load this module.
"""

from __future__ import annotations

import atexit
import os
import time

from .agent.protocol import JOB_ID_VAR

__all__ = ["install", "let_threads_finish"]

# Gloo's threads need microseconds on an idle machine; this covers a loaded one.
DRAIN_SECONDS = 0.25

_installed = False


def install() -> None:
    """Register the wait at exit, in a process herd started as a worker; otherwise nothing."""
    global _installed
    try:
        if not _installed and os.environ.get(JOB_ID_VAR) and "RANK" in os.environ:
            atexit.register(_at_exit)
            _installed = True
    except Exception:  # noqa: BLE001 - never break `import torch`
        pass


def _at_exit() -> None:
    let_threads_finish()  # a worker of a distributed job: collectives are all but certain


def let_threads_finish() -> None:
    """Leave the GIL to other threads for a moment (Gloo's, releasing finished collectives)."""
    time.sleep(DRAIN_SECONDS)
