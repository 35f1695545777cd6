"""The "collectives" torch.distributed backend, registered when torch is imported rather than
by importing it: a NumPy-only job never imports torch (about 1.6 s of CPU in every rank at
its start), and a torch job finds the backend whichever it imports first, torch or
collectives.

Once torch is imported, `watch` registers at once; before, it puts a finder first on
sys.meta_path that hands torch's import to the finders after it and runs the registration
right after torch's own module has executed. The finder takes itself off the path then:
nothing is left to watch."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from types import ModuleType
from typing import Any


def register() -> None:
    """Register the backend with torch.distributed (idempotent). Needs torch."""
    from collectives.integrations import torch_groups

    torch_groups.register()


class _Watch(importlib.abc.MetaPathFinder):
    """torch's import, found by the finders after this one, with `register` run after its
    module executes. A spec found but never executed (a library probing with
    importlib.util.find_spec whether torch is installed) leaves the watch in place."""

    def __init__(self) -> None:
        self._asking = threading.local()  # this thread is asking the finders after this one

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch" or getattr(self._asking, "now", False):
            return None
        self._asking.now = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._asking.now = False
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader

        def execute_then_register(module: ModuleType) -> None:
            del loader.exec_module  # the loader's own again
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            loader.exec_module(module)
            register()

        loader.exec_module = execute_then_register
        return spec


def watch() -> None:
    """Register once torch is imported (now, if it is); nothing where torch is not installed."""
    if "torch" in sys.modules:
        register()
    elif importlib.util.find_spec("torch") is not None:
        sys.meta_path.insert(0, _Watch())
