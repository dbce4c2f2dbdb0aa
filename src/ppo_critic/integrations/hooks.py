"""Run code when a module of another framework finishes loading, without importing it early (an integration may
itself be loaded from inside that framework's `__init__`, as verl loads its plugins)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

_CALLBACKS: dict[str, list[Callable[[ModuleType], None]]] = {}


def after_import(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call `callback(module)` once module `name` has executed: now if it is loaded already, else right after it
    loads (through a finder at the front of `sys.meta_path`)."""
    _CALLBACKS.setdefault(name, []).append(callback)
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
    if name in sys.modules:
        callback(sys.modules[name])


def installed_version(distribution: str) -> str | None:
    """The installed version of `distribution` (None when absent), read from its metadata without importing it."""
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _run_callbacks(module: ModuleType) -> None:
    for callback in _CALLBACKS.get(module.__name__, []):
        callback(module)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds a watched module as the import system would without it, and wraps its loader."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _CALLBACKS:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if finder is self or find is None else find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _LoaderThen(spec.loader, _run_callbacks)
                return spec
        return None


class _LoaderThen(importlib.abc.Loader):
    """The real loader, then `after(module)`; everything else (sources, resources) is the real loader's."""

    def __init__(self, loader: importlib.abc.Loader, after: Callable[[ModuleType], None]):
        self.loader, self.after = loader, after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.after(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)
