"""Old import paths of modules that moved into a subsystem package keep working.

``import smart_batching.data.lengths`` gives the module now at ``smart_batching.data.lengths`` (the same
module object, not a copy), so code written against the README of an earlier release runs unchanged.
Installed by ``smart_batching/__init__.py``; costs one dictionary look-up per import of a
``smart_batching.*`` name.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

MOVED = {
    "smart_batching.formats": "smart_batching.data.formats",
    "smart_batching.tokenizers": "smart_batching.data.tokenizers",
    "smart_batching.lengths": "smart_batching.data.lengths",
    "smart_batching.default_data": "smart_batching.data.default_data",
    "smart_batching.plotting": "smart_batching.analysis.plots",
    "smart_batching.distributed_sampler": "smart_batching.distributed.sampler",
    "smart_batching.even_steps": "smart_batching.distributed.even_steps",
    "smart_batching._step_balance": "smart_batching.distributed._balance",
    "smart_batching._step_reform": "smart_batching.distributed._reform",
    "smart_batching._launch": "smart_batching.distributed.launch",
}
"""Old module path -> where it lives now."""


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        return importlib.import_module(MOVED[spec.name])  # the module itself: one copy, one state

    def exec_module(self, module: Any) -> None:
        pass  # already executed under its new name


def install() -> None:
    """Put the alias finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
