"""The Parquet backend: a file, a folder or a glob of Parquet files as one exact version.

The version is the sorted list of files with their sizes, modification times, entity tags and
row-group layout. Splits are row groups, in file order then row-group order; a work item is a row
range of one row group, so a resume reads from its own row group and never replays earlier ones.

Files live on local disk or in an object store (see ``storage``). A process lists a version's
files and reads each file's footer once, whichever of its sources asks first. A pass over an
object store fetches the column chunks it needs as coalesced range reads, several row groups
ahead on a small pool of threads, and decodes them from memory; it checks each file against the
plan once, when it first opens the file in that pass. Local files are read in place and checked
after every read, which costs a ``stat``.

Files may differ in schema and sit in hive partition folders: the source reads the union of
their columns plus the folders' keys, and plans no row group of a file its filter excludes by
those alone (see ``parquet_lake``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from email.utils import parsedate_to_datetime
from functools import partial
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from spiral_lightning.core import filters
from spiral_lightning.core.plan import Plan, WorkItem
from spiral_lightning.core.spec import TableSpec
from spiral_lightning.core.storage import StorageOptions
from spiral_lightning.sources.cache import ByteCache
from spiral_lightning.sources.damage import RESTORE, damaged
from spiral_lightning.sources.parquet_fetch import (
    CHUNK_PAD,
    HOLE_BYTES,
    PART_BYTES,
    Fetched,
    PassFiles,
    Pending,
    Span,
    read_span,
)
from spiral_lightning.sources.parquet_files import (
    FOOTER_THREADS,
    changed_error,
    check_unchanged,
    etag_of,
    footer_cache,
    footer_lock,
    header_of,
    listed_tables,
    locate_table,
    open_file,
    read_footer,
    remember_footer,
    remote_error,
    resolve,
    same_file,
    version,
)
from spiral_lightning.sources.parquet_lake import Lake, arrow_filter, partition_root
from spiral_lightning.sources.parquet_pages import RowGroups
from spiral_lightning.sources.parquet_write import write
from spiral_lightning.sources.protocol import ReadBatch, Take
from spiral_lightning.sources.retry import Retry, ShortRead, passing

#: What the backend registry reads of this module (resolve and version pin the files).
__all__ = ["ParquetSource", "open", "resolve", "version", "write"]

T = TypeVar("T")
#: Rows per read batch: large enough to amortize decoding, small enough to start quickly.
_READ_ROWS = 65_536


class ParquetSource:
    """One pinned Parquet version opened for reading with the spec's columns and filter."""

    def __init__(self, spec: TableSpec) -> None:
        if spec.files is None:
            raise ValueError(f"{spec.uri!r} names no exact version yet; call TableSpec.resolve() first")
        self._spec = spec
        self._planned = spec.files
        self._version = version(spec)
        self._location = locate_table(spec)
        options = spec.storage_options
        self._retry = Retry(spec.uri, options if isinstance(options, StorageOptions) else None)
        self._cached_whole = False
        with footer_lock:
            listed = (spec.uri, self._version) in listed_tables
        if not listed:
            self._retry("the listing", lambda: check_unchanged(spec, self._location, self._planned))
            with footer_lock:
                listed_tables.add((spec.uri, self._version))
        self._pool: ThreadPoolExecutor | None = None
        self._cache = (
            ByteCache(spec.cache_dir, spec.cache_bytes)
            if spec.cache_dir is not None and spec.cache_bytes is not None and self._location.remote
            else None
        )
        paths = [planned.path for planned in self._planned]
        footers = [footer.schema.to_arrow_schema() for footer in self._footers()]
        self._lake = Lake.of(paths, footers, partition_root(self._location.path))
        schema = self._lake.schema
        if spec.columns is not None:
            unknown = [name for name in spec.columns if name not in schema.names]
            if unknown:
                raise ValueError(f"unknown columns {unknown} in {spec.uri!r}; the table has {schema.names}")
        self._columns = list(spec.columns) if spec.columns is not None else schema.names
        self._filter, self._filter_columns = arrow_filter(spec.filter, schema)
        self._read_columns = self._columns + [name for name in self._filter_columns if name not in self._columns]
        self._lake.check(self._read_columns, spec.uri)
        self._schema, self._read_schema, self._filter_schema = (
            pa.schema([schema.field(name) for name in names], metadata=schema.metadata)
            for names in (self._columns, self._read_columns, self._filter_columns)
        )
        if self._filter is not None:
            try:
                schema.empty_table().filter(self._filter)
            except (pa.ArrowException, TypeError) as error:
                raise ValueError(f"the filter {spec.filter} cannot scan {spec.uri!r}: {error}") from error
        # Files a filter excludes by their partition values or missing columns are no splits.
        kept = self._lake.kept_files(filters.parse(spec.filter), spec.filter) if isinstance(spec.filter, str) else None
        self._kept_rows: dict[int, np.ndarray] = {}
        self._groups = [
            (file, group)
            for file, planned in enumerate(self._planned)
            if kept is None or kept[file]
            for group in range(len(planned.row_groups))
        ]
        group_rows = np.fromiter(
            (self._planned[file].row_groups[group] for file, group in self._groups),
            dtype=np.int64,
            count=len(self._groups),
        )
        self._splits = Plan.of(np.arange(group_rows.size), np.zeros_like(group_rows), group_rows)

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

    def _footers(self) -> list[pq.FileMetaData]:
        """Every file's footer, which the table's schema unites: an object store's read together."""
        files = range(len(self._planned))
        if not self._location.remote or len(files) < 2:
            return [self._footer(file) for file in files]
        with ThreadPoolExecutor(min(FOOTER_THREADS, len(files))) as pool:
            return list(pool.map(self._footer, files))

    def _footer(self, file: int) -> pq.FileMetaData:
        """The footer of file ``file``, read once per process and checked against the plan."""
        planned = self._planned[file]
        key = (self._location.kind, planned)
        with footer_lock:
            footer = footer_cache.get(key)
        if footer is not None:
            return footer
        info = pafs.FileInfo(planned.path, pafs.FileType.File, size=planned.size)
        read = partial(read_footer, self._spec, self._location, info)
        footer, _ = self._retry(f"the footer of {planned.path!r}", read)
        layout = tuple(footer.row_group(i).num_rows for i in range(footer.num_row_groups))
        if layout != planned.row_groups:
            raise changed_error(self._spec, [f"changed the row groups of {planned.path!r}"])
        remember_footer(self._location.kind, planned, footer)
        return footer

    def _checked(self, file: int, read: Callable[[], T]) -> T:
        """What ``read`` reads from local file ``file``, kept only when the file is still the
        planned one after the read: an open file reads whatever lies at its path now, even a file
        rewritten in place. A read that fails on a changed file raises the change."""
        if self._location.remote:
            return read()
        try:
            value = read()
        except (OSError, ValueError, pa.ArrowException):
            self._check_file(file)
            raise
        self._check_file(file)
        return value

    def _check_file(self, file: int) -> None:
        planned = self._planned[file]
        if not same_file(self._location.filesystem.get_file_info(planned.path), planned):
            raise changed_error(self._spec, [f"changed {planned.path!r} while it was read"])

    def _decoded(self, file: int, group: int, decode: Callable[[], T], pending: Pending | None = None) -> T:
        """What ``decode`` decodes of row group ``group`` of file ``file`` (its bytes ``pending``, from
        an object store); a decoder's error says where, once the file is found unchanged (a change is
        its own error), and drops the bytes from the cache, so that a later pass fetches them again."""
        try:
            return self._checked(file, decode)
        except (OSError, pa.ArrowInvalid) as error:
            # Exactly OSError: what pyarrow's decoders raise (its subclasses say other things).
            if not (isinstance(error, pa.ArrowInvalid) or type(error) is OSError):
                raise
            if self._location.remote:
                self._open_checked(file)
            where, fix = f"row group {group} of {self._planned[file].path!r}", RESTORE
            if pending is not None and self._cache is not None:
                # Fetched damaged and kept, or damaged on the cache's disk: kept, it would fail every pass.
                self._cache.drop(pending.key)
                if pending.cached is not None:
                    fix = (
                        f"the bytes came from the cache {self._spec.cache_dir!r}, whose copy is now dropped: "
                        "resume from the last state to fetch them from the store again"
                    )
            raise damaged(self._spec.uri, where, error, fix) from error

    def _open_checked(self, file: int) -> pa.NativeFile:
        """File ``file`` opened for one pass and checked against the plan: its size and, where the
        store gives them, its entity tag or modification time."""
        planned = self._planned[file]
        try:
            opened = self._retry(f"{planned.path!r}", lambda: open_file(self._spec, self._location, planned.path))
        except FileNotFoundError as error:
            raise changed_error(self._spec, [f"removed {planned.path!r}"]) from error
        if not self._location.remote:
            self._check_file(file)
            return opened
        etag = etag_of(opened)
        same = opened.size() == planned.size and (etag == planned.etag if etag and planned.etag else True)
        if same and not (etag and planned.etag):
            modified = header_of(opened, "Last-Modified")
            # The header counts whole seconds where a listing may count milliseconds.
            same = not modified or int(parsedate_to_datetime(modified).timestamp()) == planned.mtime_ns // 10**9
        if not same:
            raise changed_error(self._spec, [f"changed {planned.path!r}"])
        return opened

    def _io(self) -> ThreadPoolExecutor:
        with footer_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._spec.prefetch, thread_name_prefix="spiral-lightning-fetch")
            return self._pool

    def _spans(self, file: int, group: int, columns: list[str]) -> tuple[Span, ...]:
        """The byte spans holding ``columns`` of row group ``group``, column chunks closer than
        ``HOLE_BYTES`` joined into one, and none longer than ``PART_BYTES``."""
        metadata = self._footer(file).row_group(group)
        wanted = set(columns)
        chunks = [metadata.column(index) for index in range(metadata.num_columns)]
        picked = [chunk for chunk in chunks if chunk.path_in_schema.split(".", 1)[0] in wanted]
        if len({chunk.path_in_schema.split(".", 1)[0] for chunk in picked}) < len(wanted):
            # A column whose name holds a dot: fetch every chunk rather than guess which it owns.
            picked = chunks
        ranges = []
        for chunk in picked:
            start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
            start = chunk.data_page_offset if start is None else min(start, chunk.data_page_offset)
            ranges.append((start, min(self._planned[file].size, start + chunk.total_compressed_size + CHUNK_PAD)))
        spans: list[Span] = []
        for start, end in sorted(ranges):
            if spans and start - spans[-1].end <= HOLE_BYTES:
                spans[-1] = Span(spans[-1].start, max(spans[-1].end, end))
            else:
                spans.append(Span(start, end))
        return tuple(spans)

    def _fetch(self, opened: Callable[[], pa.NativeFile], file: int, group: int, columns: list[str]) -> Pending:
        """Start fetching ``columns`` of row group ``group``: from the cache, else as range reads
        of at most ``PART_BYTES`` on the pool."""
        spans = self._spans(file, group, columns)
        key = ByteCache.key(self._planned[file], group, tuple(columns))
        cached = self._cache.get(key) if self._cache is not None else None
        stop = threading.Event()
        if cached is not None:
            return Pending(file, group, spans, (), cached, key, stop)
        parts = []
        for span in spans:
            for start in range(span.start, span.end, PART_BYTES):
                size = min(PART_BYTES, span.end - start)
                parts.append(self._io().submit(self._read_part, opened, file, size, start, stop))
        return Pending(file, group, spans, tuple(parts), None, key, stop)

    def _read_part(
        self, opened: Callable[[], pa.NativeFile], file: int, size: int, start: int, stop: threading.Event
    ) -> bytearray:
        """Bytes ``start..start + size`` of file ``file``, all of them, through the store's outages.
        A short response is read again once the file is found unchanged."""
        path = self._planned[file].path

        def attempt() -> bytearray:
            handle = opened()
            try:
                return read_span(handle, path, size, start)
            except OSError as error:
                if isinstance(error, ShortRead) or not (passing(error) or isinstance(error, PermissionError)):
                    self._open_checked(file)  # a file rewritten shorter is a change, not an outage
                raise

        return self._retry(f"bytes {start}..{start + size} of {path!r}", attempt, stop)

    def _bytes(self, pending: Pending) -> bytes | bytearray | pa.Buffer:
        """The bytes of a row group ``_fetch`` started, kept in the cache when there is one."""
        if pending.cached is not None:
            return pending.cached
        try:
            parts = [part.result() for part in pending.parts]
        except OSError as error:
            # Opening the file, or the retries, already said what failed and what to check.
            if isinstance(error, ConnectionError | PermissionError):
                raise
            path = self._planned[pending.file].path
            raise remote_error(self._spec, f"reading row group {pending.group} of {path!r}", error) from error
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        if self._cache is not None:
            self._cache.put(pending.key, bytes(data))
        return data

    def _row_group(self, files: PassFiles, pending: Pending | None, file: int, columns: list[str]) -> RowGroups:
        """File ``file``'s row groups, read from ``pending``'s bytes without a request (an object
        store), or from the local file itself."""
        if pending is None:
            source = self._checked(file, lambda: files.open(file))
        else:
            planned = self._planned[file]
            source = pa.PythonFile(Fetched(planned.path, planned.size, pending.spans, self._bytes(pending)), mode="r")
        # Pages written with a CRC (write_table writes one) are checked; others are read as they are.
        return RowGroups(pq.ParquetFile(source, metadata=self._footer(file), page_checksum_verification=True), source)

    @property
    def fetches_ahead(self) -> bool:
        """Whether one read keeps ``prefetch`` row groups in flight itself: in an object store, until
        the local cache holds every row group read (then reads are local, faster on threads)."""
        if not self._location.remote or self._cached_whole:
            return False
        cache, read = self._cache, self._read_columns
        keys = (ByteCache.key(self._planned[f], g, tuple(self._lake.columns_in(f, read))) for f, g in self._groups)
        self._cached_whole = cache is not None and all(cache.has(key) for key in keys)
        return not self._cached_whole

    def _groups_ahead(
        self, items: Sequence[WorkItem], columns: list[str], files: PassFiles
    ) -> Iterator[tuple[int, WorkItem, RowGroups, Pending | None]]:
        """Each item with a reader of its row group, and an object store's bytes of it, kept
        ``prefetch`` row groups ahead of the item being read."""
        if not self._location.remote:
            for index, item in enumerate(items):
                file, _ = self._groups[item.split]
                yield index, item, self._row_group(files, None, file, columns), None
            return
        ahead: deque[tuple[int, Pending]] = deque()
        upcoming = iter(enumerate(items))
        try:
            while True:
                while len(ahead) < self._spec.prefetch and (following := next(upcoming, None)) is not None:
                    index, item = following
                    file, group = self._groups[item.split]
                    stored = self._lake.columns_in(file, columns)
                    ahead.append((index, self._fetch(partial(files.open, file), file, group, stored)))
                if not ahead:
                    return
                index, pending = ahead.popleft()
                yield index, items[index], self._row_group(files, pending, pending.file, columns), pending
        finally:
            for _, pending in ahead:
                pending.stop.set()
                for part in pending.parts:
                    part.cancel()

    def _batches(
        self, item: WorkItem, reader: RowGroups, pending: Pending | None, schema: pa.Schema
    ) -> Iterator[tuple[pa.RecordBatch, int]]:
        """Stored rows ``start..end`` of ``item`` read as ``schema``'s columns, each batch with the
        stored row after it. Rows before ``start`` in the row group are decoded but never returned."""
        file, group = self._groups[item.split]
        row = 0
        stored = self._lake.columns_in(file, schema.names)
        batches = reader.batches(group, stored, _READ_ROWS)
        while (batch := self._decoded(file, group, lambda: next(batches, None), pending)) is not None:
            first, row = row, row + batch.num_rows
            if row <= item.start:
                continue
            begin, end = max(item.start, first), min(item.end, row)
            yield self._lake.conform(file, batch.slice(begin - first, end - begin), schema), end
            if row >= item.end:
                return

    def read(self, items: Sequence[WorkItem]) -> Iterator[ReadBatch]:
        files = PassFiles(self._open_checked)
        for index, item, reader, pending in self._groups_ahead(items, self._read_columns, files):
            for batch, next_row in self._batches(item, reader, pending, self._read_schema):
                if self._filter is not None:
                    batch = batch.filter(self._filter)
                yield batch.select(self._columns), index, next_row

    def count(self, items: Sequence[WorkItem]) -> list[int]:
        if self._filter is None:
            return [item.end - item.start for item in items]
        files = PassFiles(self._open_checked)
        counts = [0] * len(items)
        for index, item, reader, pending in self._groups_ahead(items, self._filter_columns, files):
            batches = self._batches(item, reader, pending, self._filter_schema)
            counts[index] = sum(batch.filter(self._filter).num_rows for batch, _ in batches)
        return counts

    def _read_group(self, split: int, schema: pa.Schema) -> pa.Table:
        file, group = self._groups[split]
        files = PassFiles(self._open_checked)
        stored = self._lake.columns_in(file, schema.names)
        pending = self._fetch(lambda: files.open(file), file, group, stored) if self._location.remote else None
        reader = self._row_group(files, pending, file, stored)
        read = self._decoded(file, group, lambda: reader.read(group, stored), pending)
        return self._lake.conform(file, read, schema)

    def kept(self, split: int) -> np.ndarray:
        if self._filter is None:
            return self._splits.row_numbers(split)
        if split not in self._kept_rows:
            keys = self._read_group(split, self._filter_schema)
            numbered = keys.append_column("__stored_row", pa.array(np.arange(keys.num_rows, dtype=np.int64)))
            self._kept_rows[split] = numbered.filter(self._filter).column("__stored_row").to_numpy()
        return self._kept_rows[split]

    def take(self, takes: Sequence[Take]) -> pa.Table:
        groups: dict[int, pa.Table] = {}
        parts = []
        for split, positions in takes:
            rows = np.asarray(positions, dtype=np.int64)
            if self._filter is not None:
                rows = self.kept(split)[rows]
            if split not in groups:
                groups[split] = self._read_group(split, self._schema)
            parts.append(groups[split].take(pa.array(rows)))
        return pa.concat_tables(parts) if parts else self.schema.empty_table()


def open(spec: TableSpec) -> ParquetSource:  # the backend registry's name for it
    """A source of the version ``spec`` pins, in this process."""
    return ParquetSource(spec)
