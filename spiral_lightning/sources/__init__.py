"""Where rows come from: each uri scheme's backend, behind one ``Source`` protocol.

Sources are opened in the process that reads them and never pickled. A process forked from one
that has opened a source cannot open another: backends hold threads and handles that a fork does
not copy, so ``open_source`` refuses with the fix instead of failing somewhere deeper.
"""

from __future__ import annotations

import os

import pyarrow as pa

from spiral_lightning.sources import spiral as spiral_backend
from spiral_lightning.sources.protocol import ReadBatch, Source
from spiral_lightning.spec import TableSpec

__all__ = ["ReadBatch", "Source", "open_source", "resolve_uri", "version_of", "write_uri"]

#: The process that opened this interpreter's first source; another pid here means a fork.
_opened_in: int | None = None


def _backend(uri: str) -> str:
    scheme = uri.split(":", 1)[0]
    if scheme != "spiral":
        raise ValueError(f"unknown table scheme {scheme!r} in {uri!r}; spiral-lightning reads 'spiral:' tables")
    return scheme


def resolve_uri(uri: str) -> str:
    """``uri`` pinned to the exact version it names now."""
    _backend(uri)
    return spiral_backend.resolve(uri)


def version_of(uri: str) -> str:
    """The exact version a resolved ``uri`` names."""
    _backend(uri)
    return spiral_backend.version(uri)


def _claim_process() -> None:
    """Refuse to touch storage in a process forked after its parent did; else remember this one."""
    global _opened_in
    pid = os.getpid()
    if _opened_in is not None and _opened_in != pid:
        raise RuntimeError(
            f"process {pid} was forked from process {_opened_in} after that process opened a table, "
            "and table readers cannot continue across a fork; create the DataLoader with "
            "multiprocessing_context='forkserver' or 'spawn'"
        )
    _opened_in = pid


def open_source(spec: TableSpec) -> Source:
    """Open the exact version ``spec`` names (``spec`` must be resolved) in this process."""
    _backend(spec.uri)
    _claim_process()
    return spiral_backend.SpiralSource(spec)


def write_uri(uri: str, data: pa.Table | pa.RecordBatch | pa.RecordBatchReader, split_rows: int) -> str:
    """Write ``data`` as a new table at ``uri``; the uri of the version written."""
    _backend(uri)
    _claim_process()
    return spiral_backend.write(uri, data, split_rows)
