"""A herd worker's own start, marked for the launcher's start phases (``startup``).

Loaded by herd's workers' ``sitecustomize`` (see ``exit_guard``), so every script gets it
unchanged, whatever it trains with:

    worker       the interpreter started (the rendezvous is over, torchrun spawned it)
    pg-begin     ``init_process_group`` was called (the script's imports and data are done)
    pg-end       it returned (the process group is up)
    first-step   the first ``progress.beat(step)`` (written by ``progress.beat``)

The process-group marks come from a wrapper put around ``init_process_group`` as
``torch.distributed.distributed_c10d`` is first imported: nothing imports torch here, and a
worker that never imports it pays one finder lookup per import. Marks are written with
``progress.mark`` (a line appended to a file on node-local storage); anything that fails here
leaves the worker as it was: a start without its process-group marks.
"""

from __future__ import annotations

import functools
import os
import sys
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

from . import progress

C10D = "torch.distributed.distributed_c10d"


def install() -> None:
    """Mark the worker's start and watch for torch's c10d module. A process herd did not
    start as a worker (no progress directory, no RANK) is left alone. Never raises."""
    try:
        if not os.environ.get(progress.PROGRESS_DIR_VAR) or "RANK" not in os.environ:
            return
        progress.mark("worker")
        if C10D in sys.modules:
            _wrap(sys.modules[C10D])
        elif not any(isinstance(f, _C10dFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _C10dFinder())
    except Exception:  # noqa: BLE001 - a worker must start whatever happens here
        pass


class _C10dFinder(MetaPathFinder):
    """Finds nothing itself: when c10d is imported, it lets the other finders find it and
    wraps ``init_process_group`` once the module has run (before ``torch.distributed``
    copies the name into its own namespace)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if fullname != C10D:
            return None
        sys.meta_path.remove(self)  # once; and the lookup below must not find this finder
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None and spec.loader is not None:
                spec.loader = _Wrapping(spec.loader)
                return spec
        return None


class _Wrapping(Loader):
    def __init__(self, loader: Loader) -> None:
        self.loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        _wrap(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)  # get_source, get_filename...: the real loader's


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
