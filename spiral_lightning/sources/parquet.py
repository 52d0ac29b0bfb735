"""The Parquet backend: a file, a folder or a glob of Parquet files as one exact version.

The version is the sorted list of files with their sizes, modification times and row-group
layout. Splits are row groups, in file order then row-group order; a work item is a row range
of one row group, so a resume reads from its own row group and never replays earlier ones.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from functools import partial
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from spiral_lightning import filters
from spiral_lightning.sources.chunks import ArrowData, as_reader, chunks
from spiral_lightning.sources.protocol import ReadBatch, Take
from spiral_lightning.spec import FileVersion, TableSpec
from spiral_lightning.work import Split, WorkItem

_PREFIX = "parquet:"
T = TypeVar("T")
#: Files a source keeps open at once (see ``ParquetSource._file``).
_OPEN_FILES = 64
#: Rows per read batch: large enough to amortize decoding, small enough to start quickly.
_READ_ROWS = 65_536


def _location(uri: str) -> tuple[pafs.FileSystem, str]:
    """The filesystem and path a ``parquet:`` uri names."""
    target = uri[len(_PREFIX) :]
    if not target:
        raise ValueError(f"a Parquet uri looks like 'parquet:<file | folder | glob>', not {uri!r}")
    if "://" in target:
        filesystem, path = pafs.FileSystem.from_uri(target)
        return filesystem, path
    return pafs.LocalFileSystem(), os.path.abspath(target)


def _list(uri: str) -> list[pafs.FileInfo]:
    """The files ``uri`` names now, sorted by path."""
    filesystem, path = _location(uri)
    if any(mark in path for mark in "*?["):
        if isinstance(filesystem, pafs.LocalFileSystem):
            paths = glob.glob(path, recursive=True)
            infos = [info for info in filesystem.get_file_info(paths) if info.type == pafs.FileType.File]
        else:
            base = path[: min(path.index(mark) for mark in "*?[" if mark in path)].rsplit("/", 1)[0]
            found = filesystem.get_file_info(pafs.FileSelector(base, recursive=True))
            infos = [info for info in found if info.type == pafs.FileType.File and fnmatch.fnmatch(info.path, path)]
    else:
        info = filesystem.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"no Parquet file or folder at {path!r} (from {uri!r})")
        if info.type == pafs.FileType.Directory:
            found = filesystem.get_file_info(pafs.FileSelector(path, recursive=True))
            infos = [
                entry
                for entry in found
                if entry.type == pafs.FileType.File
                and entry.path.endswith(".parquet")
                and not os.path.basename(entry.path).startswith(("_", "."))
            ]
        else:
            infos = [info]
    if not infos:
        raise FileNotFoundError(f"{uri!r} names no Parquet files")
    return sorted(infos, key=lambda info: info.path)


def _open(filesystem: pafs.FileSystem, path: str) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(filesystem.open_input_file(path))
    except (OSError, pa.ArrowException) as error:
        raise ValueError(f"{path!r} is not a readable Parquet file: {error}") from error


def resolve(spec: TableSpec) -> TableSpec:
    """``spec`` pinned to the files its uri names now."""
    if spec.files is not None:
        return spec
    filesystem, _ = _location(spec.uri)
    files: list[FileVersion] = []
    first: pa.Schema | None = None
    for info in _list(spec.uri):
        metadata = _open(filesystem, info.path).metadata
        schema = metadata.schema.to_arrow_schema()
        if first is None:
            first = schema
        else:
            _check_schema(info.path, schema, files[0].path, first)
        row_groups = tuple(metadata.row_group(index).num_rows for index in range(metadata.num_row_groups))
        files.append(FileVersion(info.path, info.size, info.mtime_ns, row_groups))
    return replace(spec, files=tuple(files))


def _check_schema(path: str, schema: pa.Schema, first_path: str, first: pa.Schema) -> None:
    if not schema.equals(first):
        raise ValueError(f"{path!r} has the schema {schema}, unlike {first_path!r} ({first})")


def version(spec: TableSpec) -> str:
    if spec.files is None:
        raise ValueError(f"{spec.uri!r} names no exact version yet; call TableSpec.resolve() first")
    digest = hashlib.sha256(repr([tuple(file) for file in spec.files]).encode())
    return f"parquet-{digest.hexdigest()[:16]}"


def _check_unchanged(spec: TableSpec, planned: tuple[FileVersion, ...]) -> None:
    """``ValueError`` naming every file added, removed or changed since ``spec`` was resolved."""
    now = {info.path: info for info in _list(spec.uri)}
    then = {file.path: file for file in planned}
    changes = [f"added {path!r}" for path in sorted(now.keys() - then.keys())]
    changes += [f"removed {path!r}" for path in sorted(then.keys() - now.keys())]
    changes += [f"changed {path!r}" for path in sorted(now.keys() & then.keys()) if not _same(now[path], then[path])]
    if changes:
        raise _changed(spec, changes)


def _same(now: pafs.FileInfo, planned: FileVersion) -> bool:
    """Whether a file is still the one planned: there, with the planned size and modification time."""
    return now.type == pafs.FileType.File and (now.size, now.mtime_ns) == (planned.size, planned.mtime_ns)


def _changed(spec: TableSpec, changes: list[str]) -> ValueError:
    return ValueError(
        f"the Parquet files of {spec.uri!r} changed since version {version(spec)} was planned ("
        + ", ".join(changes)
        + "); rows of another version are never mixed in: resolve the spec again and restart the epoch"
    )


class ParquetSource:
    """One pinned Parquet version opened for reading with the spec's columns and filter."""

    def __init__(self, spec: TableSpec) -> None:
        if spec.files is None:
            raise ValueError(f"{spec.uri!r} names no exact version yet; call TableSpec.resolve() first")
        _check_unchanged(spec, spec.files)
        self._spec = spec
        self._planned = spec.files
        self._uri = spec.uri
        self._version = version(spec)
        self._filesystem, _ = _location(spec.uri)
        self._opened: OrderedDict[int, pq.ParquetFile] = OrderedDict()
        schema = self._first_schema = self._file(0).schema_arrow
        if spec.columns is not None:
            unknown = [name for name in spec.columns if name not in schema.names]
            if unknown:
                raise ValueError(f"unknown columns {unknown} in {spec.uri!r}; the table has {schema.names}")
        self._columns = list(spec.columns) if spec.columns is not None else schema.names
        self._filter, self._filter_columns = _native_filter(spec.filter, schema)
        self._read_columns = self._columns + [name for name in self._filter_columns if name not in self._columns]
        self._schema = pa.schema([schema.field(name) for name in self._columns], metadata=schema.metadata)
        self._kept_rows: dict[int, np.ndarray] = {}
        self._groups = [
            (file, group) for file, planned in enumerate(self._planned) for group in range(len(planned.row_groups))
        ]
        self._splits = [
            Split(index, 0, self._planned[file].row_groups[group], None)
            for index, (file, group) in enumerate(self._groups)
        ]
        if self._filter is not None:
            try:
                schema.empty_table().filter(self._filter)
            except (pa.ArrowException, TypeError) as error:
                raise ValueError(f"the filter {spec.filter} cannot scan {spec.uri!r}: {error}") from error

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
    def splits(self) -> Sequence[Split]:
        return self._splits

    def _file(self, file: int) -> pq.ParquetFile:
        """File ``file`` of the version, opened on first use and checked against the plan. At most
        ``_OPEN_FILES`` are kept, the least recently used dropped first, so a version of any number
        of files reads within the process's limit of open files."""
        opened = self._opened.pop(file, None)
        if opened is None:
            planned = self._planned[file]
            opened = _open(self._filesystem, planned.path)
            layout = tuple(opened.metadata.row_group(i).num_rows for i in range(opened.metadata.num_row_groups))
            if layout != planned.row_groups:
                raise ValueError(
                    f"the row groups of {planned.path!r} changed since version {self._version} was planned"
                )
            if file:
                _check_schema(planned.path, opened.schema_arrow, self._planned[0].path, self._first_schema)
            if len(self._opened) >= _OPEN_FILES:
                # Dropped, not closed: a read still iterating it keeps it open until it ends.
                self._opened.popitem(last=False)
        self._opened[file] = opened
        return opened

    def _read_group(self, file: int, group: int, columns: list[str]) -> pa.Table:
        return self._file(file).read_row_group(group, columns=columns)

    def _checked(self, file: int, read: Callable[[], T]) -> T:
        """What ``read`` reads from file ``file``, kept only when the file is still the planned
        one after the read: an open file reads whatever lies at its path now, even a file
        rewritten in place. A read that fails on a changed file raises the change."""
        try:
            value = read()
        except (OSError, ValueError, pa.ArrowException):
            self._check_file(file)
            raise
        self._check_file(file)
        return value

    def _check_file(self, file: int) -> None:
        planned = self._planned[file]
        if not _same(self._filesystem.get_file_info(planned.path), planned):
            raise _changed(self._spec, [f"changed {planned.path!r} while it was read"])

    def _batches(self, item: WorkItem, columns: list[str]) -> Iterator[tuple[pa.RecordBatch, int]]:
        """Stored rows ``start..end`` of ``item`` read as ``columns``, each batch with the stored
        row after it. Rows before ``start`` in the row group are decoded but never returned."""
        file, group = self._groups[item.split]
        row = 0
        opened = self._checked(file, partial(self._file, file))
        batches = opened.iter_batches(batch_size=_READ_ROWS, row_groups=[group], columns=columns)
        while (batch := self._checked(file, lambda: next(batches, None))) is not None:
            first, row = row, row + batch.num_rows
            if row <= item.start:
                continue
            begin, end = max(item.start, first), min(item.end, row)
            yield batch.slice(begin - first, end - begin), end
            if row >= item.end:
                return

    def read(self, items: Sequence[WorkItem]) -> Iterator[ReadBatch]:
        # Each read checks its own file; files added or removed since the plan show only in a
        # listing, taken again at every pass (each epoch of a dataset that stays open).
        _check_unchanged(self._spec, self._planned)
        for index, item in enumerate(items):
            for batch, next_row in self._batches(item, self._read_columns):
                if self._filter is not None:
                    batch = batch.filter(self._filter)
                yield batch.select(self._columns), index, next_row

    def count(self, items: Sequence[WorkItem]) -> list[int]:
        if self._filter is None:
            return [item.end - item.start for item in items]
        return [
            sum(batch.filter(self._filter).num_rows for batch, _ in self._batches(item, self._filter_columns))
            for item in items
        ]

    def _kept(self, split: int) -> np.ndarray:
        """The stored rows of ``split`` the filter keeps, read once per source."""
        if split not in self._kept_rows:
            file, group = self._groups[split]
            keys = self._checked(file, partial(self._read_group, file, group, self._filter_columns))
            numbered = keys.append_column("__stored_row", pa.array(np.arange(keys.num_rows, dtype=np.int64)))
            self._kept_rows[split] = numbered.filter(self._filter).column("__stored_row").to_numpy()
        return self._kept_rows[split]

    def take(self, takes: Sequence[Take]) -> pa.Table:
        groups: dict[int, pa.Table] = {}
        parts = []
        for split, positions in takes:
            rows = np.asarray(positions, dtype=np.int64)
            if self._filter is not None:
                rows = self._kept(split)[rows]
            if split not in groups:
                file, group = self._groups[split]
                groups[split] = self._checked(file, partial(self._read_group, file, group, self._columns))
            parts.append(groups[split].take(pa.array(rows)))
        return pa.concat_tables(parts) if parts else self.schema.empty_table()


def _native_filter(condition: object, schema: pa.Schema) -> tuple[pc.Expression | None, list[str]]:
    """The pyarrow expression for a spec's filter and the columns it reads."""
    if condition is None:
        return None, []
    if isinstance(condition, str):
        tree = filters.parse(condition)
        return filters.to_arrow(tree, schema, condition), sorted(filters.columns(tree))
    if isinstance(condition, pc.Expression):
        # A native expression does not list its columns, so counting reads every column.
        return condition, list(schema.names)
    raise TypeError(
        "a Parquet table's filter is filter-language text or a pyarrow.compute.Expression, "
        f"not {type(condition).__name__}"
    )


def write(uri: str, data: ArrowData, split_rows: int) -> TableSpec:
    """Write ``data`` into a new folder as one Parquet file with row groups of ``split_rows``."""
    filesystem, path = _location(uri)
    info = filesystem.get_file_info(path)
    if info.type == pafs.FileType.File or (
        info.type == pafs.FileType.Directory and filesystem.get_file_info(pafs.FileSelector(path))
    ):
        raise FileExistsError(f"{path!r} is not an empty folder; write_table never overwrites, pick a new folder")
    filesystem.create_dir(path, recursive=True)
    reader = as_reader(data)
    with pq.ParquetWriter(filesystem.open_output_stream(f"{path}/part-00000.parquet"), reader.schema) as writer:
        for chunk in chunks(reader, split_rows):
            writer.write_table(chunk, row_group_size=split_rows)
    return resolve(TableSpec(uri))
