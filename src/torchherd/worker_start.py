"""A herd worker's own start, marked for the launcher's start phases (``startup``).

Loaded by herd's workers' ``sitecustomize`` (see ``exit_guard``), so every script gets it
unchanged, whatever it trains with:

    worker       the interpreter started (the rendezvous is over, torchrun spawned it)
    pg-begin     ``init_process_group`` was called (the script's imports and data are done)
    pg-end       it returned (the process group is up)
    first-step   the first ``progress.beat(step)`` (written by ``progress.beat``)

The process-group marks come from a wrapper put around ``init_process_group`` as
``torch.distributed.distributed_c10d`` is first imported (``import_hooks``): nothing imports
torch here. Marks are written with
``progress.mark`` (a line appended to a file on node-local storage); anything that fails here
leaves the worker as it was: a start without its process-group marks.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Any

from . import progress
from .import_hooks import when_imported

C10D = "torch.distributed.distributed_c10d"


def install() -> None:
    """Mark the worker's start and watch for torch's c10d module. A process herd did not
    start as a worker (no progress directory, no RANK) is left alone. Never raises."""
    try:
        if not os.environ.get(progress.PROGRESS_DIR_VAR) or "RANK" not in os.environ:
            return
        progress.mark("worker")
        # Wrapped once the module has run, before ``torch.distributed`` copies the name
        # into its own namespace.
        when_imported(C10D, _wrap)
    except Exception:  # noqa: BLE001 - a worker must start whatever happens here
        pass


def _wrap(module: ModuleType) -> None:
    original = getattr(module, "init_process_group", None)
    if original is None or getattr(original, "_herd_marked", False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        progress.mark("pg-begin")
        result = original(*args, **kwargs)
        progress.mark("pg-end")
        return result

    init_process_group._herd_marked = True  # type: ignore[attr-defined]
    module.init_process_group = init_process_group  # type: ignore[attr-defined]


__all__ = ["install"]
