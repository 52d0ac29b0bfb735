"""Arrow input for writers: any table, batch or reader as a stream, cut into fixed row counts."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import TypeAlias

import pyarrow as pa

#: What ``write_table`` accepts: a table, a batch, a reader, or any iterable of batches (a
#: generator, ``ParquetFile.iter_batches()``, a list).
ArrowData: TypeAlias = pa.Table | pa.RecordBatch | pa.RecordBatchReader | Iterable[pa.RecordBatch]


def as_reader(data: ArrowData, schema: pa.Schema | None = None) -> pa.RecordBatchReader:
    """``data`` as a stream of record batches; an iterable of batches streams under ``schema``,
    or the first batch's when ``None``. ``ValueError`` for a batch of another schema, naming it."""
    if isinstance(data, pa.RecordBatchReader):
        return data
    if isinstance(data, pa.RecordBatch):
        data = pa.Table.from_batches([data])
    if isinstance(data, pa.Table):
        return data.to_reader()
    if not isinstance(data, Iterable) or isinstance(data, str | bytes):
        raise TypeError(
            "write_table takes a pyarrow Table, RecordBatch, RecordBatchReader or an iterable of RecordBatches, "
            f"not {type(data).__name__}"
        )
    batches = iter(data)
    if schema is None:
        first = next(batches, None)
        if first is None:
            raise ValueError("write_table was given no record batches and no schema; pass schema= to write no rows")
        schema = _batch(first, 0).schema
        batches = itertools.chain([first], batches)
    return pa.RecordBatchReader.from_batches(schema, _checked(batches, schema))


def _batch(value: object, index: int) -> pa.RecordBatch:
    if not isinstance(value, pa.RecordBatch):
        raise TypeError(f"item {index} of the data given to write_table is a {type(value).__name__}, not a RecordBatch")
    return value


def _checked(batches: Iterator[object], schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    for index, value in enumerate(batches):
        batch = _batch(value, index)
        if not batch.schema.equals(schema):
            found, wanted = (kept.to_string(show_schema_metadata=False) for kept in (batch.schema, schema))
            raise ValueError(
                f"record batch {index} given to write_table has the schema {found!r}, unlike {wanted!r}; cast it "
                "(RecordBatch.cast) or pass schema="
            )
        yield batch


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
