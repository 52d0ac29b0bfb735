"""The registry of backends: which module reads the tables of each uri scheme.

A backend is a module with four functions: ``resolve(spec)`` (the spec pinned to its version
now), ``version(spec)`` (the version a pinned spec names), ``open(spec)`` (a ``Source`` of that
version in this process) and ``write(uri, data, split_rows, storage_options)``. The registry
names each by its module path and imports it on first use, so ``TableSpec`` never imports a
backend, and a new source is its module plus one line in ``BACKENDS`` (or, from another
package, an entry point in the group ``spiral_lightning.sources``: ``scheme = "module.path"``).
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any, Protocol


class Backend(Protocol):
    """What the registry expects of a backend module (see the module)."""

    def resolve(self, spec: Any) -> Any: ...

    def version(self, spec: Any) -> str: ...

    def open(self, spec: Any) -> Any: ...

    def write(self, uri: str, data: Any, split_rows: int, storage_options: Any = None) -> Any: ...


#: Uri scheme -> the module that reads it.
BACKENDS: dict[str, str] = {
    "spiral": "spiral_lightning.sources.spiral",
    "parquet": "spiral_lightning.sources.parquet",
    "sds": "spiral_lightning.sources.sds",
}

#: The entry-point group through which other packages register a scheme.
ENTRY_POINT_GROUP = "spiral_lightning.sources"


def register(scheme: str, module: str) -> None:
    """Read the tables of ``scheme:`` uris with the backend module ``module`` (a dotted path)."""
    if not scheme.isidentifier():
        raise ValueError(f"a uri scheme is a word such as 'parquet', not {scheme!r}")
    BACKENDS[scheme] = module


def module_name(uri: str) -> str:
    """The dotted path of the backend module that reads ``uri``, not imported; ``ValueError``
    naming the known schemes where none does."""
    scheme = uri.split(":", 1)[0]
    name = BACKENDS.get(scheme)
    if name is None:
        found = [point.value for point in entry_points(group=ENTRY_POINT_GROUP) if point.name == scheme]
        if not found:
            known = ", ".join(f"'{known}:'" for known in sorted(BACKENDS))
            raise ValueError(f"unknown table scheme {scheme!r} in {uri!r}; spiral-lightning reads {known}")
        name = BACKENDS[scheme] = found[0]
    return name


def backend(uri: str) -> Backend:
    """The backend module that reads ``uri``; ``ValueError`` naming the known schemes otherwise."""
    module: Backend = importlib.import_module(module_name(uri))
    return module
