"""The module paths of release 0.1, before the package was cut into subpackages, kept importable
for one release: ``spiral_lightning.loader.consumer_states`` still names the function that now
lives in ``spiral_lightning.lightning.loader``, with a ``DeprecationWarning`` that says where.

An old path is an alias module made on import: each name read from it is looked up in the new
modules it was split into, so the objects are the very same (pickles, ``isinstance`` and
jsonargparse class paths keep working)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

#: Old module -> the modules its names now live in, searched in order.
MOVED: dict[str, tuple[str, ...]] = {
    f"spiral_lightning.{old}": tuple(f"spiral_lightning.{new}" for new in news)
    for old, news in {
        "ahead": ("reading.ahead",),
        "cache": ("sources.cache",),
        "cli": ("lightning.cli",),
        "datamodule": ("lightning.datamodule",),
        "dataset": ("datasets.table",),
        "demo": ("demos.tabular",),
        "demo_images": ("demos.images",),
        "demo_lm": ("demos.lm",),
        "elastic": ("planning.elastic",),
        "elastic_map": ("planning.elastic_map",),
        "elastic_mixture": ("planning.elastic_mixture",),
        "filters": ("core.filters",),
        "frames": ("reading.frames",),
        "ingest": ("media.ingest",),
        "lists": ("planning.lists",),
        "loader": ("lightning.loader", "datasets.loader"),
        "mapstyle": ("datasets.mapstyle",),
        "mixture": ("datasets.mixture",),
        "mixture_state": ("core.mixture_state",),
        "packing": ("datasets.packing",),
        "padding": ("lightning.padding",),
        "sequences": ("core.sequences",),
        "shuffle": ("reading.shuffle",),
        "spec": ("core.spec",),
        "state": ("core.state",),
        "storage": ("core.storage", "sources.stores"),
        "tensors": ("reading.tensors",),
        "transfer": ("reading.transfer",),
        "watchdog": ("reading.watchdog",),
        "windows": ("datasets.windows",),
        "work": ("planning.policies", "core.plan"),
        "write": ("sources.write",),
    }.items()
}


def _alias(name: str, targets: Sequence[str]) -> ModuleType:
    module = ModuleType(name, f"Moved to {', '.join(targets)}; this path is an alias kept for one release.")

    def lookup(attribute: str) -> Any:
        for target in targets:
            found = importlib.import_module(target)
            if hasattr(found, attribute):
                return getattr(found, attribute)
        raise AttributeError(f"module {name!r} (moved to {', '.join(targets)}) has no attribute {attribute!r}")

    module.__dict__["__getattr__"] = lookup
    return module


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        targets = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {' and '.join(targets)}; the old path goes in the next release",
            DeprecationWarning,
            stacklevel=3,
        )
        return _alias(spec.name, targets)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the alias looks its names up when they are read."""

    def get_code(self, fullname: str) -> Any:
        """What ``python -m <old path>`` runs: the first new module, as ``python -m`` would run it
        (``python -m spiral_lightning.cli fit ...`` still trains)."""
        target = MOVED[fullname][0]
        source = f"import runpy\nrunpy.run_module({target!r}, run_name='__main__', alter_sys=True)"
        return compile(source, fullname, "exec")


def install() -> None:
    """Make the old paths importable (once per process)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.append(_Finder())
