"""write_table: Arrow data into a new table, split for parallel reading."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from spiral_lightning.core.checks import check_positive
from spiral_lightning.core.spec import TableSpec
from spiral_lightning.core.storage import StorageOptions
from spiral_lightning.sources import write
from spiral_lightning.sources.chunks import ArrowData, as_reader

#: Rows per split when ``write_table`` is given no ``split_rows``.
DEFAULT_SPLIT_ROWS = 100_000


def write_table(
    uri: str,
    data: ArrowData,
    *,
    split_rows: int = DEFAULT_SPLIT_ROWS,
    storage_options: Mapping[str, Any] | None = None,
    schema: pa.Schema | None = None,
) -> TableSpec:
    """Write ``data`` as a new table at ``uri``, one split per ``split_rows`` rows, and return the
    spec of the exact version written. ``data`` is a pyarrow ``Table``, ``RecordBatch``,
    ``RecordBatchReader`` or any iterable of ``RecordBatch`` (streamed, under ``schema`` or the
    first batch's). A destination that is not empty is an error, never overwritten. A Parquet
    table may go to an object store (``parquet:s3://bucket/prefix``), reached with
    ``storage_options`` (see ``TableSpec``).

        rows = pq.ParquetFile("events.parquet").iter_batches(batch_size=65_536)
        spec = write_table("spiral:data/events", rows, split_rows=100_000)
        spec.version  # the exact version written, pinned
    """
    check_positive("split_rows", split_rows)
    reader = as_reader(data, schema)
    return write(uri, reader, split_rows, StorageOptions(storage_options) if storage_options else None)
