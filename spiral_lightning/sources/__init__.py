"""Where rows come from: each uri scheme's backend, behind one ``Source`` protocol.

Sources are opened in the process that reads them and never pickled. A process forked from one
that has opened a source cannot open another: backends hold threads and handles that a fork does
not copy, so ``open_source`` refuses with the fix instead of failing somewhere deeper.
"""

from __future__ import annotations

import os

from spiral_lightning.core.backends import backend
from spiral_lightning.core.secrets import masking
from spiral_lightning.core.spec import TableSpec
from spiral_lightning.core.storage import StorageOptions
from spiral_lightning.sources.cache import ByteCache
from spiral_lightning.sources.chunks import ArrowData
from spiral_lightning.sources.decoded_cache import DecodedCache
from spiral_lightning.sources.protocol import ReadBatch, Reader, Source, Take

__all__ = ["ReadBatch", "Reader", "Source", "Take", "open_source", "write"]

#: The process that opened this interpreter's first source; another pid here means a fork.
_opened_in: int | None = None


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
    reads = backend(spec.uri)
    _claim_process()
    source: Source = reads.open(spec)
    missing = [item.column for item in spec.media if item.column not in source.schema.names]
    if missing:
        raise ValueError(
            f"media projections name columns {missing} that the scan of {spec.uri!r} does not return; "
            f"it returns {source.schema.names}"
        )
    if spec.decoded_cache_dir is not None and spec.decoded_cache_bytes is not None:
        source = DecodedCache(source, spec, ByteCache(spec.decoded_cache_dir, spec.decoded_cache_bytes))
    return source


def write(uri: str, data: ArrowData, split_rows: int, storage_options: StorageOptions | None = None) -> TableSpec:
    """Write ``data`` as a new table at ``uri`` (reached with ``storage_options``, which only
    Parquet reads); the spec of the version written."""
    # A secret in the uri's query reaches no error a backend raises while writing.
    with masking(uri):
        writes = backend(uri)
        _claim_process()
        spec: TableSpec = writes.write(uri, data, split_rows, storage_options)
    return spec
