"""Old import paths of megarefit 0.1, kept for one release (removed in 0.3).

megarefit 0.2 regrouped the package into layer folders (CHANGELOG.md). A module that
moved stays importable under its old name: ``import megarefit.publisher`` (or ``from
megarefit.publisher import Publisher``) warns with a :class:`DeprecationWarning` naming the
new path and gives the module at that path -- the same module object, so classes compare
equal and ``isinstance`` holds. :data:`MOVED` is the whole list; nothing else is aliased.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED: dict[str, str] = {
    "megarefit.dims": "megarefit.layout.dims",
    "megarefit.classify": "megarefit.layout.classify",
    "megarefit.plan_columns": "megarefit.plan.columns",
    "megarefit.plan_table": "megarefit.plan.table",
    "megarefit.plan_export": "megarefit.planner.megatron_to_hf",
    "megarefit.namemap": "megarefit.planner.namemap",
    "megarefit.receiver": "megarefit.transport.execute",
    "megarefit.manifest": "megarefit.transport.manifest",
    "megarefit.rendezvous": "megarefit.online.rendezvous",
    "megarefit.publisher": "megarefit.online.publisher",
    "megarefit.replica": "megarefit.online.replica",
    "megarefit.param_sync": "megarefit.online.param_sync",
    "megarefit.bench": "megarefit.demo.bench",
    "megarefit.live_demo": "megarefit.demo.live",
    "megarefit.cli_namemap": "megarefit.cli.namemap",
}


class _MovedLoader(importlib.abc.Loader):
    """Loads an old name as the module at its new path."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self.new}; the old path is removed in megarefit 0.3",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new module is already imported."""


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """A meta-path finder for the names in :data:`MOVED` (installed by ``import megarefit``)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(new))


def install() -> None:
    """Put :class:`MovedModuleFinder` on ``sys.meta_path`` once."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())


__all__ = ["MOVED", "MovedModuleFinder", "install"]
