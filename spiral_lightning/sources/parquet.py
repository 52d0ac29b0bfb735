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
"""

from __future__ import annotations

import bisect
import fnmatch
import glob
import hashlib
import io
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from email.utils import parsedate_to_datetime
from functools import partial
from typing import NamedTuple, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from spiral_lightning import filters
from spiral_lightning.cache import ByteCache
from spiral_lightning.sources.chunks import ArrowData, as_reader, chunks
from spiral_lightning.sources.protocol import ReadBatch, Take
from spiral_lightning.spec import FileVersion, TableSpec
from spiral_lightning.storage import Location, StorageOptions, locate, scrub
from spiral_lightning.work import Plan, WorkItem

_PREFIX = "parquet:"
T = TypeVar("T")
#: Files a pass keeps open at once, the least recently used dropped first, so a version of any
#: number of files reads within the process's limit of open files.
_OPEN_FILES = 64
#: Rows per read batch: large enough to amortize decoding, small enough to start quickly.
_READ_ROWS = 65_536
#: Footers a process keeps, the least recently used dropped first.
_FOOTERS = 4096
#: Column chunks closer than this are fetched in one range read (the bytes between are wasted).
_HOLE_BYTES = 1 << 20
#: The largest range read; a longer span is fetched as several, concurrently.
_PART_BYTES = 8 << 20
#: Bytes read past each column chunk's recorded end: some writers record chunk sizes a page
#: header short, and readers read that far.
_CHUNK_PAD = 128
#: Threads that read footers concurrently while a version over an object store is pinned.
_FOOTER_THREADS = 16

_lock = threading.Lock()
_footers: OrderedDict[tuple[str, FileVersion], pq.FileMetaData] = OrderedDict()
_listed: set[tuple[str, str]] = set()


def _target(uri: str) -> str:
    target = uri[len(_PREFIX) :]
    if not target:
        raise ValueError(f"a Parquet uri looks like 'parquet:<file | folder | glob>', not {uri!r}")
    return target


def _locate(spec: TableSpec) -> Location:
    options = spec.storage_options
    return locate(_target(spec.uri), options if isinstance(options, StorageOptions) else None)


def _remote_error(spec: TableSpec, what: str, error: OSError) -> OSError:
    """``error`` from the store while doing ``what``, said with the table and the likely fix."""
    text = scrub(str(error), spec.storage_options if isinstance(spec.storage_options, StorageOptions) else None)
    lowered = text.lower()
    if any(mark in lowered for mark in ("access_denied", "accessdenied", "forbidden", "signature", "invalidaccesskey")):
        return PermissionError(
            f"the object store refused {what} for {spec.uri!r}: {text}; check the credentials "
            "(storage options aws_access_key_id / aws_secret_access_key, or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
        )
    if any(mark in lowered for mark in ("connect", "timeout", "timed out", "resolve host", "network")):
        return ConnectionError(
            f"cannot reach the object store of {spec.uri!r} while {what}: {text}; check the endpoint "
            "(storage option aws_endpoint or AWS_ENDPOINT_URL) and that the store is up"
        )
    return OSError(f"{what} failed for {spec.uri!r}: {text}")


def _list(spec: TableSpec, location: Location) -> list[pafs.FileInfo]:
    """The files ``spec``'s uri names now, sorted by path."""
    try:
        return _list_files(spec.uri, location)
    except (FileNotFoundError, ValueError):
        raise
    except OSError as error:
        if location.remote:
            raise _remote_error(spec, "listing the files", error) from error
        raise


def _list_files(uri: str, location: Location) -> list[pafs.FileInfo]:
    filesystem, path = location.filesystem, location.path
    if any(mark in path for mark in "*?["):
        if not location.remote:
            paths = glob.glob(path, recursive=True)
            infos = [info for info in filesystem.get_file_info(paths) if info.type == pafs.FileType.File]
        else:
            base = path[: min(path.index(mark) for mark in "*?[" if mark in path)].rsplit("/", 1)[0]
            found = filesystem.get_file_info(pafs.FileSelector(base, recursive=True))
            infos = [info for info in found if info.type == pafs.FileType.File and fnmatch.fnmatch(info.path, path)]
    else:
        # A store answers "is it a folder?" with a HEAD and a listing: listing the prefix first
        # costs one request for a folder, and a HEAD more only for a single file.
        found = (
            filesystem.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
            if location.remote
            else []
        )
        info = pafs.FileInfo(path, pafs.FileType.Directory) if found else filesystem.get_file_info(path)
        if info.type == pafs.FileType.NotFound:
            raise FileNotFoundError(f"no Parquet file or folder at {path!r} (from {uri!r})")
        if info.type == pafs.FileType.Directory:
            found = found or filesystem.get_file_info(pafs.FileSelector(path, recursive=True))
            infos = [
                entry
                for entry in found
                if entry.type == pafs.FileType.File
                and entry.path.endswith(".parquet")
                and not entry.base_name.startswith(("_", "."))
            ]
        else:
            infos = [info]
    if not infos:
        raise FileNotFoundError(f"{uri!r} names no Parquet files")
    return sorted(infos, key=lambda info: info.path)


def _open(spec: TableSpec, location: Location, path: str) -> pa.NativeFile:
    try:
        return location.filesystem.open_input_file(path)
    except FileNotFoundError:
        raise
    except OSError as error:
        if location.remote:
            raise _remote_error(spec, f"opening {path!r}", error) from error
        raise


def _etag(opened: pa.NativeFile) -> str:
    """The entity tag an object store gave the object ``opened`` reads ("" when it gives none)."""
    return _header(opened, "ETag")


def _header(opened: pa.NativeFile, name: str) -> str:
    """Header ``name`` of the response that opened an object ("" when there is none)."""
    metadata = opened.metadata() or {}
    value = metadata.get(name.encode()) or metadata.get(name) or b""
    return value.decode() if isinstance(value, bytes) else str(value)


def _read_footer(spec: TableSpec, location: Location, info: pafs.FileInfo) -> tuple[pq.FileMetaData, str]:
    """The footer of the file ``info`` lists, and its entity tag."""
    opened = _open(spec, location, info.path)
    try:
        return pq.ParquetFile(opened).metadata, _etag(opened)
    except OSError as error:
        if location.remote and not isinstance(error, pa.ArrowInvalid):
            raise _remote_error(spec, f"reading the footer of {info.path!r}", error) from error
        raise ValueError(f"{info.path!r} is not a readable Parquet file: {error}") from error
    except pa.ArrowException as error:
        raise ValueError(f"{info.path!r} is not a readable Parquet file: {error}") from error


def _remember(kind: str, file: FileVersion, footer: pq.FileMetaData) -> None:
    with _lock:
        _footers[kind, file] = footer
        _footers.move_to_end((kind, file))
        while len(_footers) > _FOOTERS:
            _footers.popitem(last=False)


def resolve(spec: TableSpec) -> TableSpec:
    """``spec`` pinned to the files its uri names now."""
    location = _locate(spec)
    if not location.remote and spec.uri != f"{_PREFIX}{location.path}":
        # A pinned spec travels to processes that may run elsewhere (Ray workers run in folders
        # of their own), so a local path is pinned as an absolute one.
        spec = replace(spec, uri=f"{_PREFIX}{location.path}")
    if spec.files is not None:
        return spec
    infos = _list(spec, location)
    if location.remote and len(infos) > 1:
        # Behind a store's latency the footers cost round trips, not bytes: read them together.
        with ThreadPoolExecutor(min(_FOOTER_THREADS, len(infos))) as pool:
            footers = list(pool.map(lambda info: _read_footer(spec, location, info), infos))
    else:
        footers = [_read_footer(spec, location, info) for info in infos]
    files: list[FileVersion] = []
    first: pa.Schema | None = None
    for info, (footer, etag) in zip(infos, footers, strict=True):
        schema = footer.schema.to_arrow_schema()
        if first is None:
            first = schema
        else:
            _check_schema(info.path, schema, files[0].path, first)
        row_groups = tuple(footer.row_group(index).num_rows for index in range(footer.num_row_groups))
        file = FileVersion(info.path, info.size, info.mtime_ns, row_groups, etag)
        _remember(location.kind, file, footer)
        files.append(file)
    return replace(spec, files=tuple(files))


def _check_schema(path: str, schema: pa.Schema, first_path: str, first: pa.Schema) -> None:
    if not schema.equals(first):
        raise ValueError(f"{path!r} has the schema {schema}, unlike {first_path!r} ({first})")


def version(spec: TableSpec) -> str:
    if spec.files is None:
        raise ValueError(f"{spec.uri!r} names no exact version yet; call TableSpec.resolve() first")
    # A local file has no entity tag, and leaving the empty one out keeps the versions pinned
    # before tags were recorded.
    digest = hashlib.sha256(repr([tuple(file) if file.etag else tuple(file)[:4] for file in spec.files]).encode())
    return f"parquet-{digest.hexdigest()[:16]}"


def _check_unchanged(spec: TableSpec, location: Location, planned: tuple[FileVersion, ...]) -> None:
    """``ValueError`` naming every file added, removed or changed since ``spec`` was resolved."""
    now = {info.path: info for info in _list(spec, location)}
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


class _Span(NamedTuple):
    """Bytes ``start..end`` of a file: column chunks read together."""

    start: int
    end: int


class _Fetched(io.RawIOBase):
    """A file of which only some spans were fetched, read as a whole file by the Parquet reader.
    A read outside the spans is an error, never a request."""

    def __init__(self, path: str, size: int, spans: Sequence[_Span], data: bytes | pa.Buffer) -> None:
        super().__init__()
        self._path = path
        self._size = size
        self._starts = [span.start for span in spans]
        self._spans = list(spans)
        offsets = np.cumsum([0] + [span.end - span.start for span in spans])
        self._views = [memoryview(data)[offsets[i] : offsets[i + 1]] for i in range(len(spans))]
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = base + offset
        return self._position

    def tell(self) -> int:
        return self._position

    def read(self, size: int = -1) -> memoryview:
        index = bisect.bisect_right(self._starts, self._position) - 1
        end = self._size if size < 0 else self._position + size
        if index < 0 or end > self._spans[index].end:
            raise OSError(
                f"the Parquet reader asked for bytes {self._position}..{end} of {self._path!r}, outside the "
                "column chunks fetched for it"
            )
        start, length = self._position - self._spans[index].start, end - self._position
        self._position = end
        return self._views[index][start : start + length]


class _Pending(NamedTuple):
    """One row group's column chunks on their way: the spans and the range reads fetching them,
    or the bytes a cache kept."""

    file: int
    group: int
    spans: tuple[_Span, ...]
    parts: tuple[Future[bytes], ...]
    cached: pa.Buffer | None
    key: str


class ParquetSource:
    """One pinned Parquet version opened for reading with the spec's columns and filter."""

    def __init__(self, spec: TableSpec) -> None:
        if spec.files is None:
            raise ValueError(f"{spec.uri!r} names no exact version yet; call TableSpec.resolve() first")
        self._spec = spec
        self._planned = spec.files
        self._version = version(spec)
        self._location = _locate(spec)
        with _lock:
            listed = (spec.uri, self._version) in _listed
        if not listed:
            _check_unchanged(spec, self._location, spec.files)
            with _lock:
                _listed.add((spec.uri, self._version))
        self._pool: ThreadPoolExecutor | None = None
        self._cache = (
            ByteCache(spec.cache_dir, spec.cache_bytes)
            if spec.cache_dir is not None and spec.cache_bytes is not None and self._location.remote
            else None
        )
        schema = self._first_schema = self._footer(0).schema.to_arrow_schema()
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
        group_rows = np.fromiter(
            (rows for planned in self._planned for rows in planned.row_groups), dtype=np.int64, count=len(self._groups)
        )
        self._splits = Plan.of(np.arange(group_rows.size), np.zeros_like(group_rows), group_rows)
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
    def splits(self) -> Plan:
        return self._splits

    def _footer(self, file: int) -> pq.FileMetaData:
        """The footer of file ``file``, read once per process and checked against the plan."""
        planned = self._planned[file]
        key = (self._location.kind, planned)
        with _lock:
            footer = _footers.get(key)
        if footer is not None:
            return footer
        info = pafs.FileInfo(planned.path, pafs.FileType.File, size=planned.size)
        footer, _ = _read_footer(self._spec, self._location, info)
        layout = tuple(footer.row_group(i).num_rows for i in range(footer.num_row_groups))
        if layout != planned.row_groups:
            raise _changed(self._spec, [f"changed the row groups of {planned.path!r}"])
        if file:
            _check_schema(planned.path, footer.schema.to_arrow_schema(), self._planned[0].path, self._first_schema)
        _remember(self._location.kind, planned, footer)
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
        if not _same(self._location.filesystem.get_file_info(planned.path), planned):
            raise _changed(self._spec, [f"changed {planned.path!r} while it was read"])

    def _open_checked(self, file: int) -> pa.NativeFile:
        """File ``file`` opened for one pass and checked against the plan: its size and, where the
        store gives them, its entity tag or modification time."""
        planned = self._planned[file]
        try:
            opened = _open(self._spec, self._location, planned.path)
        except FileNotFoundError as error:
            raise _changed(self._spec, [f"removed {planned.path!r}"]) from error
        if not self._location.remote:
            self._check_file(file)
            return opened
        etag = _etag(opened)
        same = opened.size() == planned.size and (etag == planned.etag if etag and planned.etag else True)
        if same and not (etag and planned.etag):
            modified = _header(opened, "Last-Modified")
            # The header counts whole seconds where a listing may count milliseconds.
            same = not modified or int(parsedate_to_datetime(modified).timestamp()) == planned.mtime_ns // 10**9
        if not same:
            raise _changed(self._spec, [f"changed {planned.path!r}"])
        return opened

    def _io(self) -> ThreadPoolExecutor:
        with _lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._spec.prefetch, thread_name_prefix="spiral-lightning-fetch")
            return self._pool

    def _spans(self, file: int, group: int, columns: list[str]) -> tuple[_Span, ...]:
        """The byte spans holding ``columns`` of row group ``group``, column chunks closer than
        ``_HOLE_BYTES`` joined into one, and none longer than ``_PART_BYTES``."""
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
            ranges.append((start, min(self._planned[file].size, start + chunk.total_compressed_size + _CHUNK_PAD)))
        spans: list[_Span] = []
        for start, end in sorted(ranges):
            if spans and start - spans[-1].end <= _HOLE_BYTES:
                spans[-1] = _Span(spans[-1].start, max(spans[-1].end, end))
            else:
                spans.append(_Span(start, end))
        return tuple(spans)

    def _fetch(self, opened: Callable[[], pa.NativeFile], file: int, group: int, columns: list[str]) -> _Pending:
        """Start fetching ``columns`` of row group ``group``: from the cache, else as range reads
        of at most ``_PART_BYTES`` on the pool."""
        spans = self._spans(file, group, columns)
        key = ByteCache.key(self._planned[file], group, tuple(columns))
        cached = self._cache.get(key) if self._cache is not None else None
        if cached is not None:
            return _Pending(file, group, spans, (), cached, key)
        parts = []
        for span in spans:
            for start in range(span.start, span.end, _PART_BYTES):
                size = min(_PART_BYTES, span.end - start)
                parts.append(self._io().submit(_read_at, opened, size, start))
        return _Pending(file, group, spans, tuple(parts), None, key)

    def _bytes(self, pending: _Pending) -> bytes | pa.Buffer:
        """The bytes of a row group ``_fetch`` started, kept in the cache when there is one."""
        if pending.cached is not None:
            return pending.cached
        try:
            parts = [part.result() for part in pending.parts]
        except OSError as error:
            # Opening the file already said what failed and what to check.
            if isinstance(error, ConnectionError | PermissionError):
                raise
            path = self._planned[pending.file].path
            raise _remote_error(self._spec, f"reading row group {pending.group} of {path!r}", error) from error
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        if self._cache is not None:
            self._cache.put(pending.key, data)
        return data

    def _row_group(self, files: _PassFiles, pending: _Pending | None, file: int, columns: list[str]) -> pq.ParquetFile:
        """File ``file`` as a Parquet reader that reads ``pending``'s row group without a request
        (an object store), or the local file itself."""
        footer = self._footer(file)
        if pending is None:
            return pq.ParquetFile(self._checked(file, lambda: files.open(file)), metadata=footer)
        planned = self._planned[file]
        fetched = _Fetched(planned.path, planned.size, pending.spans, self._bytes(pending))
        return pq.ParquetFile(pa.PythonFile(fetched, mode="r"), metadata=footer)

    def _groups_ahead(
        self, items: Sequence[WorkItem], columns: list[str], files: _PassFiles
    ) -> Iterator[tuple[int, WorkItem, pq.ParquetFile]]:
        """Each item with a reader of its row group, an object store's kept ``prefetch`` row
        groups ahead of the item being read."""
        if not self._location.remote:
            for index, item in enumerate(items):
                file, _ = self._groups[item.split]
                yield index, item, self._row_group(files, None, file, columns)
            return
        ahead: deque[tuple[int, _Pending]] = deque()
        upcoming = iter(enumerate(items))
        try:
            while True:
                while len(ahead) < self._spec.prefetch and (following := next(upcoming, None)) is not None:
                    index, item = following
                    file, group = self._groups[item.split]
                    ahead.append((index, self._fetch(partial(files.open, file), file, group, columns)))
                if not ahead:
                    return
                index, pending = ahead.popleft()
                yield index, items[index], self._row_group(files, pending, pending.file, columns)
        finally:
            for _, pending in ahead:
                for part in pending.parts:
                    part.cancel()

    def _batches(
        self, item: WorkItem, reader: pq.ParquetFile, columns: list[str]
    ) -> Iterator[tuple[pa.RecordBatch, int]]:
        """Stored rows ``start..end`` of ``item`` read as ``columns``, each batch with the stored
        row after it. Rows before ``start`` in the row group are decoded but never returned."""
        file, group = self._groups[item.split]
        row = 0
        batches = reader.iter_batches(batch_size=_READ_ROWS, row_groups=[group], columns=columns)
        while (batch := self._checked(file, lambda: next(batches, None))) is not None:
            first, row = row, row + batch.num_rows
            if row <= item.start:
                continue
            begin, end = max(item.start, first), min(item.end, row)
            yield batch.slice(begin - first, end - begin), end
            if row >= item.end:
                return

    def read(self, items: Sequence[WorkItem]) -> Iterator[ReadBatch]:
        files = _PassFiles(self._open_checked)
        for index, item, reader in self._groups_ahead(items, self._read_columns, files):
            for batch, next_row in self._batches(item, reader, self._read_columns):
                if self._filter is not None:
                    batch = batch.filter(self._filter)
                yield batch.select(self._columns), index, next_row

    def count(self, items: Sequence[WorkItem]) -> list[int]:
        if self._filter is None:
            return [item.end - item.start for item in items]
        files = _PassFiles(self._open_checked)
        counts = [0] * len(items)
        for index, item, reader in self._groups_ahead(items, self._filter_columns, files):
            counts[index] = sum(
                batch.filter(self._filter).num_rows for batch, _ in self._batches(item, reader, self._filter_columns)
            )
        return counts

    def _read_group(self, split: int, columns: list[str]) -> pa.Table:
        file, group = self._groups[split]
        files = _PassFiles(self._open_checked)
        pending = self._fetch(lambda: files.open(file), file, group, columns) if self._location.remote else None
        reader = self._row_group(files, pending, file, columns)
        return self._checked(file, lambda: reader.read_row_group(group, columns=columns))

    def _kept(self, split: int) -> np.ndarray:
        """The stored rows of ``split`` the filter keeps, read once per source."""
        if split not in self._kept_rows:
            keys = self._read_group(split, self._filter_columns)
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
                groups[split] = self._read_group(split, self._columns)
            parts.append(groups[split].take(pa.array(rows)))
        return pa.concat_tables(parts) if parts else self.schema.empty_table()


def _read_at(opened: Callable[[], pa.NativeFile], size: int, start: int) -> bytes:
    data: bytes = opened().read_at(size, start)
    return data


class _PassFiles:
    """The files one pass (a read, a count or a take) has opened, each opened and checked once by
    ``open_checked``, at most ``_OPEN_FILES`` kept. Safe to use from the fetching threads."""

    def __init__(self, open_checked: Callable[[int], pa.NativeFile]) -> None:
        self._open_checked = open_checked
        self._opened: OrderedDict[int, pa.NativeFile] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, file: int) -> pa.NativeFile:
        with self._lock:
            opened = self._opened.pop(file, None)
            if opened is None:
                opened = self._open_checked(file)
                if len(self._opened) >= _OPEN_FILES:
                    # Dropped, not closed: a read still using it keeps it open until it ends.
                    self._opened.popitem(last=False)
            self._opened[file] = opened
            return opened


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


def write(uri: str, data: ArrowData, split_rows: int, storage_options: StorageOptions | None = None) -> TableSpec:
    """Write ``data`` into a new folder (a new prefix of an object store) as one Parquet file with
    row groups of ``split_rows``."""
    spec = TableSpec(uri, storage_options=storage_options)
    location = _locate(spec)
    filesystem, path = location.filesystem, location.path
    try:
        info = filesystem.get_file_info(path)
        occupied = info.type == pafs.FileType.File or (
            info.type == pafs.FileType.Directory and bool(filesystem.get_file_info(pafs.FileSelector(path)))
        )
    except OSError as error:
        if location.remote:
            raise _remote_error(spec, "looking at the destination", error) from error
        raise
    if occupied:
        raise FileExistsError(f"{path!r} is not an empty folder; write_table never overwrites, pick a new folder")
    if not location.remote:
        # An object store has no folders: the file's key makes its prefix.
        filesystem.create_dir(path, recursive=True)
    reader = as_reader(data)
    try:
        with (
            filesystem.open_output_stream(f"{path}/part-00000.parquet") as sink,
            pq.ParquetWriter(sink, reader.schema) as writer,
        ):
            for chunk in chunks(reader, split_rows):
                writer.write_table(chunk, row_group_size=split_rows)
    except OSError as error:
        if location.remote:
            raise _remote_error(spec, "writing the table", error) from error
        raise
    return resolve(spec)
