"""write_table: Arrow data into a new table, split for parallel reading."""

from __future__ import annotations

from spiral_lightning.sources import write
from spiral_lightning.sources.chunks import ArrowData
from spiral_lightning.spec import TableSpec

#: Rows per split when ``write_table`` is given no ``split_rows``.
DEFAULT_SPLIT_ROWS = 100_000


def write_table(
    uri: str,
    data: ArrowData,
    *,
    split_rows: int = DEFAULT_SPLIT_ROWS,
) -> TableSpec:
    """Write ``data`` as a new table at ``uri``, one split per ``split_rows`` rows, and return the
    spec of the exact version written. A destination that is not empty is an error, never
    overwritten."""
    if isinstance(split_rows, bool) or not isinstance(split_rows, int) or split_rows < 1:
        raise ValueError(f"split_rows must be a positive int, not {split_rows!r}")
    return write(uri, data, split_rows)
