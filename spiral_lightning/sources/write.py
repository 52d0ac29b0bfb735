"""write_table: Arrow data into a new table, split for parallel reading."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from spiral_lightning.core.checks import check_positive
from spiral_lightning.core.spec import TableSpec
from spiral_lightning.core.storage import StorageOptions
from spiral_lightning.sources import write
from spiral_lightning.sources.chunks import ArrowData

#: Rows per split when ``write_table`` is given no ``split_rows``.
DEFAULT_SPLIT_ROWS = 100_000


def write_table(
    uri: str,
    data: ArrowData,
    *,
    split_rows: int = DEFAULT_SPLIT_ROWS,
    storage_options: Mapping[str, Any] | None = None,
) -> TableSpec:
    """Write ``data`` as a new table at ``uri``, one split per ``split_rows`` rows, and return the
    spec of the exact version written. A destination that is not empty is an error, never
    overwritten. A Parquet table may go to an object store (``parquet:s3://bucket/prefix``),
    reached with ``storage_options`` (see ``TableSpec``)."""
    check_positive("split_rows", split_rows)
    return write(uri, data, split_rows, StorageOptions(storage_options) if storage_options else None)
