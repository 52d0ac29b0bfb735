"""The SDS backend: published snapshots of ``signal-dataset`` (SDS) datasets as exact versions.

An SDS root holds immutable snapshots; its root document names the one published now. The
version is that snapshot, pinned as the dataset id, the snapshot id and a digest of the root
document's bytes, all carried in the uri (``sds:<root>?dataset=..&snapshot=..&digest=..``). A
root republished after planning (a different document) fails every later open instead of
mixing two snapshots.

Splits are shards, in ordinal order; a work item is a range of one shard's records (its stored
rows), read through SDS's batched ``__getitems__``. A record's ordinal is its shard's first
ordinal plus its stored row.

Rows are ``id`` (the record id, a string), one column per field and one per metadata key, both
as the dataset's first record has them. A field column holds each record's array as a
*shaped tensor*: a struct of ``data`` (the values in C order, a large list) and ``shape`` (one
int32 per dimension), the storage layout of Arrow's variable-shape tensor, with the field
metadata key ``spiral_lightning.tensor`` marking it, so ``to_torch`` stacks a batch whose arrays
share one shape into one ``[B, ...]`` tensor and gives a list of tensors otherwise. Arrow has no
complex numbers, so a complex field stores its real view (a trailing dimension of 2: real,
imaginary) and the marker says ``"complex": true``; ``to_torch`` views it as complex again
without a copy. Metadata numbers become int64 or float64 columns, booleans bool, strings
string, and any other JSON value (lists, objects) its JSON text.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import NamedTuple
from urllib.parse import parse_qs, urlencode

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import signal_dataset as sds

from spiral_lightning.core import filters
from spiral_lightning.core.plan import Plan, WorkItem
from spiral_lightning.core.spec import TableSpec
from spiral_lightning.sources.chunks import ArrowData, as_reader, chunks
from spiral_lightning.sources.damage import damaged
from spiral_lightning.sources.protocol import ReadBatch, Take, refuse_storage_options
from spiral_lightning.sources.sds_records import (
    Layout,
)

_PREFIX = "sds:"
#: The document at an SDS root that names its published snapshot.
ROOT_DOCUMENT = "root.json"
#: Records per read batch, and the bytes a read batch aims to stay under (estimated from the
#: first record), so that large captures do not make one batch hold gigabytes.
_READ_ROWS = 4096
_READ_BYTES = 64 << 20
#: Records per metadata read when a filter is evaluated: metadata is small, so larger batches.
_METADATA_ROWS = 16_384
_PIN_KEYS = ("dataset", "snapshot", "digest")


class SdsPin(NamedTuple):
    """What a ``sds:`` uri names: the ``root`` and, once resolved, the dataset id, snapshot id
    and root document digest of the pinned snapshot (``None`` before)."""

    root: str
    dataset: str | None
    snapshot: str | None
    digest: str | None


def parse(uri: str) -> SdsPin:
    """The root and pin a ``sds:`` uri names; ``ValueError`` naming the fault otherwise."""
    if not uri.startswith(_PREFIX):
        raise ValueError(f"{uri!r} is not an SDS uri")
    root, _, query = uri[len(_PREFIX) :].partition("?")
    if not root:
        raise ValueError(f"an SDS uri looks like 'sds:<root>' (a folder, gs:// or s3:// root), not {uri!r}")
    if "://" not in root:
        # Workers may start in another directory; an absolute root names the same dataset there.
        root = os.path.abspath(root)
    if not query:
        return SdsPin(root, None, None, None)
    try:
        fields = parse_qs(query, strict_parsing=True)
    except ValueError as error:
        raise ValueError(f"cannot read the query of {uri!r}: {error}") from error
    if set(fields) != set(_PIN_KEYS) or any(len(values) != 1 for values in fields.values()):
        raise ValueError(f"{uri!r} must give exactly {', '.join(_PIN_KEYS)}, once each")
    return SdsPin(root, fields["dataset"][0], fields["snapshot"][0], fields["digest"][0])


def _format(pin: SdsPin) -> str:
    query = urlencode({"dataset": pin.dataset, "snapshot": pin.snapshot, "digest": pin.digest})
    return f"{_PREFIX}{pin.root}?{query}"


def _open(root: str) -> tuple[sds.Dataset, SdsPin]:
    """The dataset published at ``root`` now, and the pin of its snapshot."""
    try:
        dataset = sds.open(root)
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"no SDS dataset at {root!r}: {error}; publish one with sds.publish or write_table('sds:{root}', data)"
        ) from error
    # Read after opening: a root republished in between then fails the digest check of every
    # later open, rather than pinning a digest of a document the dataset did not come from.
    document = dataset.object_store.read(f"{root.rstrip('/')}/{ROOT_DOCUMENT}")
    digest = hashlib.sha256(document).hexdigest()[:16]
    return dataset, SdsPin(root, dataset.id, dataset.snapshot_id, digest)


def resolve(spec: TableSpec) -> TableSpec:
    """``spec`` pinned to the snapshot its root publishes now."""
    if parse(spec.uri).snapshot is not None:
        return spec
    root = parse(spec.uri).root
    # A pinned spec travels to processes that may run elsewhere (Ray workers run in folders of
    # their own), so a local root is pinned as an absolute path.
    _, pin = _open(root if "://" in root else os.path.abspath(root))
    return replace(spec, uri=_format(pin))


def version(spec: TableSpec) -> str:
    pin = parse(spec.uri)
    if pin.snapshot is None:
        raise ValueError(f"{spec.uri!r} names no exact version yet; call TableSpec.resolve() first")
    return f"sds-{pin.dataset}@{pin.snapshot}-{pin.digest}"


def _open_pinned(spec: TableSpec) -> sds.Dataset:
    """The dataset of ``spec``'s pinned snapshot; ``ValueError`` when the root was republished."""
    pinned = parse(spec.uri)
    if pinned.snapshot is None:
        raise ValueError(f"{spec.uri!r} names no exact version yet; call TableSpec.resolve() first")
    dataset, now = _open(pinned.root)
    if now != pinned:
        raise ValueError(
            f"the SDS root {pinned.root!r} was republished since version {version(spec)} was planned: its "
            f"{ROOT_DOCUMENT} now names dataset {now.dataset!r} snapshot {now.snapshot!r} (digest {now.digest}), "
            f"not dataset {pinned.dataset!r} snapshot {pinned.snapshot!r} (digest {pinned.digest}); rows of two "
            "snapshots are never mixed: resolve the spec again and restart the epoch"
        )
    return dataset


class SdsSource:
    """One pinned SDS snapshot opened for reading with the spec's columns and filter."""

    def __init__(self, spec: TableSpec) -> None:
        self._uri = spec.uri
        self._version = version(spec)
        self._dataset = _open_pinned(spec)
        # Reads ahead run on another thread than planning, and the shard readers are not known to
        # serve two threads at once.
        self._reading = threading.Lock()
        first = self._dataset.record_metadata[0] if len(self._dataset) else None
        self._layout = Layout.of(first, spec.uri)
        names = self._layout.schema.names
        if spec.columns is not None:
            unknown = [name for name in spec.columns if name not in names]
            if unknown:
                raise ValueError(f"unknown columns {unknown} in {spec.uri!r}; the dataset has {names}")
        self._columns = list(spec.columns) if spec.columns is not None else names
        self._schema = pa.schema([self._layout.schema.field(name) for name in self._columns])
        self._filter, self._filter_columns = self._native_filter(spec.filter)
        try:
            instructions = self._dataset.read_instructions()
        except ValueError as error:
            raise ValueError(f"cannot plan {spec.uri!r}: {error}") from error
        self._first_ordinals = [instruction.first_ordinal for instruction in instructions]
        examples = np.fromiter((instruction.examples_in_shard for instruction in instructions), dtype=np.int64)
        self._splits = Plan.of(np.arange(examples.size), np.zeros_like(examples), examples, examples)
        declared = first.fields.values() if first is not None else ()
        row_bytes = sum(int(np.prod(field.shape)) * np.dtype(field.dtype).itemsize for field in declared)
        self._read_rows = max(1, min(_READ_ROWS, _READ_BYTES // max(1, row_bytes)))
        self._kept_rows: dict[int, np.ndarray] = {}

    def _native_filter(self, condition: object) -> tuple[pc.Expression | None, list[str]]:
        """The pyarrow expression of a filter-language filter over ``id`` and metadata keys, and
        the columns it reads."""
        if condition is None:
            return None, []
        if not isinstance(condition, str):
            raise TypeError(
                f"an SDS dataset's filter is filter-language text over its id and metadata keys, "
                f"not {type(condition).__name__}"
            )
        tree = filters.parse(condition)
        columns = sorted(filters.columns(tree))
        on_fields = [name for name in columns if name in self._layout.tensors]
        if on_fields:
            raise ValueError(
                f"the filter {condition!r} reads the fields {on_fields} of {self._uri!r}; filters read only the id "
                f"and metadata keys ({['id', *self._layout.keys]}), so that they never load samples"
            )
        return filters.to_arrow(tree, self._layout.schema, condition), columns

    @property
    def version(self) -> str:
        return self._version

    @property
    def schema(self) -> pa.Schema:
        return self._schema

    @property
    def decoded(self) -> frozenset[str]:
        return frozenset()

    @property
    def splits(self) -> Plan:
        return self._splits

    def _rows(self, records: Sequence[sds.Record]) -> pa.RecordBatch:
        columns = [self._layout.column(name, records) for name in self._columns]
        return pa.RecordBatch.from_arrays(columns, schema=self._schema)

    def kept(self, split: int) -> np.ndarray:
        # From the records' metadata alone.
        if self._filter is None:
            return self._splits.row_numbers(split)
        if split not in self._kept_rows:
            first, rows = self._first_ordinals[split], self._splits[split].end
            schema = pa.schema([self._layout.schema.field(name) for name in self._filter_columns])
            kept = []
            for start in range(0, rows, _METADATA_ROWS):
                stored = np.arange(start, min(start + _METADATA_ROWS, rows), dtype=np.int64)
                with self._reading:
                    metadata = self._dataset.record_metadata.__getitems__((stored + first).tolist())
                keys = pa.RecordBatch.from_arrays(
                    [self._layout.column(name, metadata) for name in self._filter_columns], schema=schema
                )
                numbered = pa.Table.from_batches([keys]).append_column("__stored_row", pa.array(stored))
                kept.append(numbered.filter(self._filter).column("__stored_row").to_numpy())
            self._kept_rows[split] = np.concatenate(kept) if kept else np.empty(0, np.int64)
        return self._kept_rows[split]

    def _stored(self, item: WorkItem) -> np.ndarray:
        """The stored rows of ``item`` the reads return, in stored order."""
        if self._filter is None:
            return np.arange(item.start, item.end, dtype=np.int64)
        kept = self.kept(item.split)
        return kept[np.searchsorted(kept, item.start) : np.searchsorted(kept, item.end)]

    def read(self, items: Sequence[WorkItem]) -> Iterator[ReadBatch]:
        for index, item in enumerate(items):
            rows = self._stored(item)
            first = self._first_ordinals[item.split]
            for start in range(0, rows.size, self._read_rows):
                part = rows[start : start + self._read_rows]
                with self._reading:
                    try:
                        records = self._dataset.__getitems__((part + first).tolist())
                    except Exception as error:
                        # signal-dataset checks each record's chunk hash and names neither table nor shard.
                        if "corrupt" not in str(error).lower():
                            raise
                        where = f"split {item.split} (stored rows {int(part[0])}..{int(part[-1]) + 1})"
                        raise damaged(self._uri, where, error) from error
                last = start + self._read_rows >= rows.size
                yield self._rows(records), index, item.end if last else int(part[-1]) + 1

    def count(self, items: Sequence[WorkItem]) -> list[int]:
        return [int(self._stored(item).size) for item in items]

    def take(self, takes: Sequence[Take]) -> pa.Table:
        ordinals = []
        for split, positions in takes:
            rows = np.asarray(positions, dtype=np.int64)
            if self._filter is not None:
                rows = self.kept(split)[rows]
            ordinals.extend((rows + self._first_ordinals[split]).tolist())
        with self._reading:
            records = self._dataset.__getitems__(ordinals)
        return pa.Table.from_batches([self._rows(records)], schema=self._schema)


def _row_arrays(column: pa.ChunkedArray) -> list[np.ndarray]:
    """Each row of an Arrow column of numbers as a numpy array: fixed-size lists (nested) and
    fixed-shape tensors by their shape, other lists by their values, and scalars as arrays of one
    element (SDS stores no rank-0 fields: its fields are contiguous arrays of rank 1 or more)."""
    array = column.combine_chunks()
    if isinstance(array.type, pa.FixedShapeTensorType):
        return list(array.to_numpy_ndarray())
    sizes: list[int] = []
    values = array
    while pa.types.is_fixed_size_list(values.type):
        sizes.append(values.type.list_size)
        values = values.flatten()
    if pa.types.is_integer(values.type) or pa.types.is_floating(values.type):
        return list(values.to_numpy().reshape(len(array), *(sizes or [1])))
    return [np.asarray(row) for row in array.to_pylist()]


def _is_array(kind: pa.DataType) -> bool:
    """Whether a column of ``kind`` holds an array per row."""
    if isinstance(kind, pa.FixedShapeTensorType):
        return True
    return bool(pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind))


def _field(name: str, data: np.ndarray) -> sds.Field:
    """``data`` as an SDS field, its axes named ``<name>_0``, ``<name>_1``, ..."""
    return sds.Field(data, axes=tuple(sds.Axis(f"{name}_{dim}", size) for dim, size in enumerate(data.shape)))


def publish_table(
    root: str,
    data: ArrowData,
    *,
    fields: Sequence[str] | None = None,
    split_rows: int = 100_000,
    dataset_id: str | None = None,
    snapshot_id: str = "0",
) -> TableSpec:
    """Publish Arrow ``data`` as a new SDS dataset at ``root`` through SDS's own ``write_shard``
    and ``publish``, one shard per ``split_rows`` rows, and return the spec of its snapshot.

    ``fields`` names the columns that become SDS fields (numbers, or fixed-size lists and
    fixed-shape tensors of numbers: each row one array); by default every list or tensor column.
    An ``id`` column becomes the record ids (as text), else the row numbers do; every other
    column becomes a metadata key.
    """
    root = parse(f"{_PREFIX}{root}").root
    reader = as_reader(data)
    names = reader.schema.names
    if fields is None:
        fields = [field.name for field in reader.schema if field.name != "id" and _is_array(field.type)]
    unknown = [name for name in fields if name not in names or name == "id"]
    if unknown:
        raise ValueError(f"fields {unknown} are not columns of the data ({names}) other than 'id'")
    keys = [name for name in names if name not in fields and name != "id"]
    shards = []
    row = 0
    for number, chunk in enumerate(chunks(reader, split_rows)):
        ids = chunk.column("id").to_pylist() if "id" in names else range(row, row + chunk.num_rows)
        arrays = {name: _row_arrays(chunk.column(name)) for name in fields}
        metadata = {name: chunk.column(name).to_pylist() for name in keys}
        records = [
            sds.Record(
                str(ids[index]),
                {name: _field(name, arrays[name][index]) for name in fields},
                metadata={name: metadata[name][index] for name in keys if metadata[name][index] is not None},
            )
            for index in range(chunk.num_rows)
        ]
        # SDS orders shards by work id as text, so zero-padded numbers keep the rows in order.
        shards.append(sds.write_shard(records, root, work_id=f"{number:08d}"))
        row += chunk.num_rows
    sds.publish(root, shards, dataset_id=dataset_id or os.path.basename(root.rstrip("/")), snapshot_id=snapshot_id)
    return resolve(TableSpec(f"{_PREFIX}{root}"))


def write(uri: str, data: ArrowData, split_rows: int, storage_options: object = None) -> TableSpec:
    """Publish ``data`` as a new SDS dataset at the root ``uri`` names (see ``publish_table``)."""
    refuse_storage_options(uri, storage_options)
    pin = parse(uri)
    if pin.snapshot is not None:
        raise ValueError(f"write_table publishes a new dataset; {uri!r} names a snapshot, give the bare 'sds:<root>'")
    if "://" not in pin.root and os.path.exists(pin.root) and os.listdir(pin.root):
        raise FileExistsError(f"{pin.root!r} is not an empty folder; write_table never overwrites, pick a new folder")
    return publish_table(pin.root, data, split_rows=split_rows)


def open(spec: TableSpec) -> SdsSource:  # the backend registry's name for it
    """A source of the version ``spec`` pins, in this process."""
    return SdsSource(spec)
