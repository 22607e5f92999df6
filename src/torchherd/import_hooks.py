"""Run a function on a module right after its first import, without importing it here.

herd's workers load ``sitecustomize`` before the script (``_worker_site``), long before the
script imports torch, and nothing there may import torch itself (a worker that never uses it
must not pay for it). ``when_imported(name, then)`` puts a finder first on ``sys.meta_path``
that finds nothing itself: when ``name`` is imported, it lets the other finders find it and
calls ``then(module)`` once the module has run, before anything else can use it. A worker
that never imports ``name`` pays one finder lookup per import.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

Then = Callable[[ModuleType], None]


def when_imported(name: str, then: Then) -> None:
    """Call ``then(module)`` once ``name`` has been imported: now, if it already is."""
    if name in sys.modules:
        then(sys.modules[name])
    elif not any(isinstance(f, _After) and (f.name, f.then) == (name, then) for f in sys.meta_path):
        sys.meta_path.insert(0, _After(name, then))


class _After(MetaPathFinder):
    def __init__(self, name: str, then: Then) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; and the lookup below must not find this finder
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None and spec.loader is not None:
                spec.loader = _ThenLoader(spec.loader, self.then)
                return spec
        return None


class _ThenLoader(Loader):
    def __init__(self, loader: Loader, then: Then) -> None:
        self.loader = loader
        self.then = then

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.then(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)  # get_source, get_filename...: the real loader's


__all__ = ["when_imported"]
