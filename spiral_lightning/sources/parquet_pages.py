"""Row groups read with their fixed-size list columns decoded straight from plain pages.

Arrow decodes a list column level by level: for an embedding of 16 floats it spends about 100 ns
a row on repetition and definition levels that, in a column of fixed-size lists without nulls,
say the same thing in every page. Such a page, written plain and uncompressed (as ``write_table``
writes floating columns), is its two level sections followed by the values themselves; when the
level sections are byte for byte what Arrow's writer gives a page of that many values, the values
can be taken as they lie, for about a tenth of the cost.

A *plain list page* is a version 1 data page of PLAIN values with RLE levels, no compression and
no dictionary, whose levels are those of full, non-null lists. Anything else (another encoding,
a null, a page that splits a list, a checksum that does not match) is declined, and the whole
column is left to Arrow, which reads it as before and reports damage in its own words.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from zlib_ng import zlib_ng

#: Arrow value types whose Parquet physical type holds them as they are, by that type's name.
_PHYSICAL = {pa.float32(): "FLOAT", pa.float64(): "DOUBLE", pa.int32(): "INT32", pa.int64(): "INT64"}
#: PageHeader fields (parquet.thrift): type, compressed size, CRC, data page header.
_TYPE, _SIZE, _CRC, _DATA = 1, 3, 4, 5
#: DataPageHeader fields: number of values, value encoding, level encodings.
_VALUES, _ENCODING, _DEF_ENCODING, _REP_ENCODING = 1, 2, 3, 4
_DATA_PAGE, _PLAIN, _RLE = 0, 0, 3


class _Compact:
    """A reader of Thrift's compact protocol, enough of it for a page header."""

    def __init__(self, data: memoryview, position: int) -> None:
        self.data, self.position = data, position

    def _byte(self) -> int:
        value = self.data[self.position]
        self.position += 1
        return int(value)

    def _varint(self) -> int:
        value = shift = 0
        while True:
            byte = self._byte()
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    def _zigzag(self) -> int:
        value = self._varint()
        return (value >> 1) ^ -(value & 1)

    def struct(self) -> dict[int, object]:
        """The next struct's fields by id: integers, nested structs; other values skipped (None)."""
        fields: dict[int, object] = {}
        last = 0
        while (header := self._byte()) != 0:
            code, delta = header & 0x0F, header >> 4
            last = last + delta if delta else self._zigzag()
            fields[last] = self._value(code)
        return fields

    def _value(self, code: int) -> object:
        if code in (1, 2):
            return code == 1
        if code == 3:
            return self._byte()
        if code in (4, 5, 6):
            return self._zigzag()
        if code == 7:
            self.position += 8
            return None
        if code == 8:
            length = self._varint()  # read before the position it moves is added to
            self.position += length
            return None
        if code in (9, 10):
            header = self._byte()
            count = header >> 4 if header >> 4 != 15 else self._varint()
            for _ in range(count):
                self._value(header & 0x0F)
            return None
        if code == 12:
            return self.struct()
        raise ValueError(f"Thrift compact type {code} is not in a page header")


@dataclass(frozen=True)
class FixedList:
    """A column of fixed-size lists whose pages may be plain list pages: its Arrow field (a
    ``pa.FixedSizeListType``), and the index of its one leaf among the file's Parquet columns."""

    field: pa.Field
    leaf: int


def fixed_lists(parquet: pq.ParquetFile, columns: Sequence[str]) -> dict[str, FixedList]:
    """The columns of ``columns`` in ``parquet`` whose pages may be plain list pages."""
    found = {}
    arrow = parquet.schema_arrow
    leaves = parquet.schema
    for leaf in range(len(leaves)):
        column = leaves.column(leaf)
        name = column.path.split(".", 1)[0]
        if name not in columns or column.max_repetition_level != 1 or column.path.count(".") != 2:
            continue
        field = arrow.field(name)
        if (
            isinstance(field.type, pa.FixedSizeListType)
            and _PHYSICAL.get(field.type.value_type) == column.physical_type
        ):
            found[name] = FixedList(field, leaf)
    return found


@functools.lru_cache(maxsize=32)
def _levels(list_type: pa.FixedSizeListType, nullable: bool, values: int) -> bytes | None:
    """Both level sections of a plain list page of ``values`` values of ``list_type``, as Arrow's
    writer writes them (lengths and RLE runs, which depend on the count and nullability alone);
    None where that writer would not put them in one page (pyarrow caps a page's rows, at 20,000 in
    version 26), so that a file's page past the cap is left to Arrow."""
    zeros = pa.array(np.zeros(values, dtype=list_type.value_type.to_pandas_dtype()))
    table = pa.table(
        [pa.FixedSizeListArray.from_arrays(zeros, type=list_type)],
        schema=pa.schema([pa.field("v", list_type, nullable)]),
    )
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="none", use_dictionary=False, data_page_size=1 << 30)
    data = memoryview(sink.getvalue())
    reader = _Compact(data, pq.ParquetFile(pa.BufferReader(data)).metadata.row_group(0).column(0).data_page_offset)
    page = reader.struct().get(_DATA)
    if not isinstance(page, dict) or page.get(_VALUES) != values:
        return None
    body = data[reader.position :]
    rep = int.from_bytes(body[:4], "little")
    definition = int.from_bytes(body[4 + rep : 8 + rep], "little")
    return bytes(body[: 8 + rep + definition])


def plain_values(chunk: pa.Buffer, column: FixedList, rows: int) -> pa.Array | None:
    """The lists of a column chunk (its bytes ``chunk``) of ``rows`` rows, or None unless every
    page is a plain list page whose checksum, where it has one, matches."""
    list_type = column.field.type
    dtype = np.dtype(list_type.value_type.to_pandas_dtype())
    total = rows * list_type.list_size
    # Arrow's memory pool keeps freed blocks for the next row group, where a fresh numpy array of
    # a megabyte or more is new pages of memory every time; apart from the pages' bytes and aligned.
    out = pa.allocate_buffer(total * dtype.itemsize)
    flat = np.frombuffer(out, dtype)
    data = memoryview(chunk)
    position = values = 0
    try:
        while position < len(data):
            reader = _Compact(data, position)
            header = reader.struct()
            size, page = header.get(_SIZE), header.get(_DATA)
            if header.get(_TYPE) != _DATA_PAGE or not isinstance(size, int) or not isinstance(page, dict):
                return None
            count = page.get(_VALUES)
            plain = (page.get(_ENCODING), page.get(_DEF_ENCODING), page.get(_REP_ENCODING)) == (_PLAIN, _RLE, _RLE)
            if (
                not plain
                or not isinstance(count, int)
                or count % list_type.list_size
                or not 0 < count <= total - values
            ):
                return None
            levels = _levels(list_type, column.field.nullable, count)
            body = data[reader.position : reader.position + size]
            if levels is None or size != len(levels) + count * dtype.itemsize or bytes(body[: len(levels)]) != levels:
                return None
            crc = header.get(_CRC)
            if isinstance(crc, int) and zlib_ng.crc32(body) != crc & 0xFFFFFFFF:
                return None
            flat[values : values + count] = np.frombuffer(body, dtype, count, len(levels))
            position, values = reader.position + size, values + count
    except (IndexError, ValueError):
        return None
    if values != total:
        return None
    return pa.FixedSizeListArray.from_arrays(
        pa.Array.from_buffers(list_type.value_type, total, [None, out]), type=list_type
    )


@dataclass(frozen=True)
class RowGroups:
    """A Parquet file's row groups, read from ``source`` (the file, or the bytes fetched of it)."""

    parquet: pq.ParquetFile
    source: pa.NativeFile

    def batches(self, group: int, columns: list[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
        """``columns`` of row group ``group`` in batches of ``batch_rows`` rows, as Arrow's
        ``iter_batches`` gives them; columns whose every page is a plain list page decoded here."""
        metadata = self.parquet.metadata.row_group(group)
        lists: dict[str, tuple[pa.Field, pa.Array]] = {}
        for name, fixed in fixed_lists(self.parquet, columns).items():
            chunk = metadata.column(fixed.leaf)
            if chunk.compression != "UNCOMPRESSED" or chunk.has_dictionary_page:
                continue
            data = self.source.read_at(chunk.total_compressed_size, chunk.data_page_offset)
            if (decoded := plain_values(data, fixed, metadata.num_rows)) is not None:
                lists[name] = fixed.field, decoded
        rest = [name for name in columns if name not in lists]
        batches = self.parquet.iter_batches(batch_size=batch_rows, row_groups=[group], columns=rest)
        if not lists:
            yield from batches
            return
        row = 0
        for batch in batches:
            arrays = [
                lists[name][1].slice(row, batch.num_rows) if name in lists else batch.column(name) for name in columns
            ]
            fields = [lists[name][0] if name in lists else batch.schema.field(name) for name in columns]
            yield pa.RecordBatch.from_arrays(arrays, schema=pa.schema(fields))
            row += batch.num_rows

    def read(self, group: int, columns: list[str]) -> pa.Table:
        """``columns`` of row group ``group`` whole, as Arrow's ``read_row_group`` gives them."""
        rows = self.parquet.metadata.row_group(group).num_rows
        if rows == 0:
            return self.parquet.read_row_group(group, columns=columns)
        return pa.Table.from_batches(list(self.batches(group, columns, rows)))
