"""Arrow input for writers: any table, batch or reader as a stream, cut into fixed row counts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeAlias

import pyarrow as pa

#: What ``write_table`` accepts.
ArrowData: TypeAlias = pa.Table | pa.RecordBatch | pa.RecordBatchReader


def as_reader(data: ArrowData) -> pa.RecordBatchReader:
    """``data`` as a stream of record batches."""
    if isinstance(data, pa.RecordBatchReader):
        return data
    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    if isinstance(data, pa.Table):
        return data.to_reader()
    raise TypeError(f"write_table takes a pyarrow Table, RecordBatch or RecordBatchReader, not {type(data).__name__}")


def chunks(reader: pa.RecordBatchReader, rows: int) -> Iterator[pa.Table]:
    """The reader's rows as tables of ``rows`` rows, the last one shorter, streaming."""
    pending: list[pa.RecordBatch] = []
    held = 0
    for batch in reader:
        used = 0
        while used < batch.num_rows:
            part = batch.slice(used, rows - held)
            pending.append(part)
            held += part.num_rows
            used += part.num_rows
            if held == rows:
                yield pa.Table.from_batches(pending, schema=reader.schema)
                pending, held = [], 0
    if held:
        yield pa.Table.from_batches(pending, schema=reader.schema)
