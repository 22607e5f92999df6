"""herd's workers' sitecustomize: the exit wait of ``torchherd.exit_guard``, the marks of the
worker's start (``torchherd.worker_start``), DDP's step timings (``torchherd.ddp_timing``),
then the
``sitecustomize`` this one hides (a virtual environment's, the distribution's), so nothing the
user's Python loads at start is lost.

Python imports ``sitecustomize`` from the first directory on ``sys.path`` that has one. Only
herd's workers have this directory on their PYTHONPATH (the node's torchrun wrapper puts it
there), so no other program is touched, whatever imports torch. Interpreters started with
``-S``, ``-E`` or ``-I`` skip it (they read no sitecustomize or no PYTHONPATH).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from importlib.machinery import PathFinder

_HERE = os.path.dirname(os.path.abspath(__file__))


def _guard() -> None:
    try:
        from torchherd.exit_guard import install

        install()
    except Exception:  # noqa: BLE001 - a worker must start whatever happens here
        pass


def _mark_start() -> None:
    try:
        from torchherd.worker_start import install

        install()  # the start phases' marks (launcher: startup.py)
    except Exception:  # noqa: BLE001
        pass


def _time_ddp() -> None:
    try:
        from torchherd.ddp_timing import install

        install()  # a plain DDP loop's waits, for the slow-rank watch
    except Exception:  # noqa: BLE001
        pass


def _others() -> list[str]:
    return [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def _load_the_hidden_one() -> None:
    """Run the sitecustomize Python would have loaded without this directory."""
    spec = PathFinder.find_spec("sitecustomize", _others())
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)  # its errors are reported by site, as they would be


sys.path[:] = _others()  # the worker's own imports never see this directory
_guard()
_mark_start()
_time_ddp()
_load_the_hidden_one()
