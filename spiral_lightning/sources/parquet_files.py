"""A Parquet table's files: listing a file, folder or glob (local or in an object store), reading
and caching footers, pinning the files as one version, and refusing files changed since."""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from spiral_lightning.core.spec import FileVersion, TableSpec
from spiral_lightning.core.storage import StorageOptions, masked, scrub
from spiral_lightning.sources.retry import Retry
from spiral_lightning.sources.stores import Location, credentials_of, denied, locate

PREFIX = "parquet:"


#: Footers a process keeps, the least recently used dropped first.
FOOTERS = 4096


#: Threads that read footers concurrently while a version over an object store is pinned.
FOOTER_THREADS = 16


footer_lock = threading.Lock()


footer_cache: OrderedDict[tuple[str, FileVersion], pq.FileMetaData] = OrderedDict()


listed_tables: set[tuple[str, str]] = set()


def target_of(uri: str) -> str:
    target = uri[len(PREFIX) :]
    if not target:
        raise ValueError(f"a Parquet uri looks like 'parquet:<file | folder | glob>', not {uri!r}")
    return target


def locate_table(spec: TableSpec) -> Location:
    options = spec.storage_options
    return locate(target_of(spec.uri), options if isinstance(options, StorageOptions) else None)


def remote_error(spec: TableSpec, what: str, error: OSError) -> OSError:
    """``error`` from the store while doing ``what``, said with the table and the likely fix."""
    text = scrub(str(error), spec.storage_options if isinstance(spec.storage_options, StorageOptions) else None)
    uri = masked(spec.uri)
    if denied(text):
        return PermissionError(
            f"the object store refused {what} for {uri!r}: {text}; check the credentials "
            f"({credentials_of(target_of(spec.uri))}): the key id, its secret and what they may read"
        )
    lowered = text.lower()
    if any(mark in lowered for mark in ("connect", "timeout", "timed out", "resolve host", "network")):
        return ConnectionError(
            f"cannot reach the object store of {uri!r} while {what}: {text}; check the endpoint "
            "(storage option aws_endpoint or AWS_ENDPOINT_URL) and that the store is up"
        )
    return OSError(f"{what} failed for {uri!r}: {text}")


def list_table(spec: TableSpec, location: Location) -> list[pafs.FileInfo]:
    """The files ``spec``'s uri names now, sorted by path."""
    try:
        return list_files(spec.uri, location)
    except (FileNotFoundError, ValueError):
        raise
    except OSError as error:
        if location.remote:
            raise remote_error(spec, "listing the files", error) from error
        raise


def list_files(uri: str, location: Location) -> list[pafs.FileInfo]:
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


def open_file(spec: TableSpec, location: Location, path: str) -> pa.NativeFile:
    try:
        return location.filesystem.open_input_file(path)
    except FileNotFoundError:
        raise
    except OSError as error:
        if location.remote:
            raise remote_error(spec, f"opening {path!r}", error) from error
        raise


def etag_of(opened: pa.NativeFile) -> str:
    """The entity tag an object store gave the object ``opened`` reads ("" when it gives none)."""
    return header_of(opened, "ETag")


def header_of(opened: pa.NativeFile, name: str) -> str:
    """Header ``name`` of the response that opened an object ("" when there is none)."""
    metadata = opened.metadata() or {}
    value = metadata.get(name.encode()) or metadata.get(name) or b""
    return value.decode() if isinstance(value, bytes) else str(value)


def read_footer(spec: TableSpec, location: Location, info: pafs.FileInfo) -> tuple[pq.FileMetaData, str]:
    """The footer of the file ``info`` lists, and its entity tag."""
    opened = open_file(spec, location, info.path)
    try:
        return pq.ParquetFile(opened).metadata, etag_of(opened)
    except OSError as error:
        if location.remote and not isinstance(error, pa.ArrowInvalid):
            raise remote_error(spec, f"reading the footer of {info.path!r}", error) from error
        raise ValueError(f"{info.path!r} is not a readable Parquet file: {error}") from error
    except pa.ArrowException as error:
        raise ValueError(f"{info.path!r} is not a readable Parquet file: {error}") from error


def remember_footer(kind: str, file: FileVersion, footer: pq.FileMetaData) -> None:
    with footer_lock:
        footer_cache[kind, file] = footer
        footer_cache.move_to_end((kind, file))
        while len(footer_cache) > FOOTERS:
            footer_cache.popitem(last=False)


def resolve(spec: TableSpec) -> TableSpec:
    """``spec`` pinned to the files its uri names now. The listing and each footer ride out the
    store's outages as a read does (``retry.Retry``, the storage option ``retry_seconds``): a job
    often pins its tables at the moment a store is restarting or shedding load."""
    location = locate_table(spec)
    if not location.remote and spec.uri != f"{PREFIX}{location.path}":
        # A pinned spec travels to processes that may run elsewhere (Ray workers run in folders
        # of their own), so a local path is pinned as an absolute one.
        spec = replace(spec, uri=f"{PREFIX}{location.path}")
    if spec.files is not None:
        return spec
    options = spec.storage_options
    retry = Retry(spec.uri, options if isinstance(options, StorageOptions) else None)
    infos = retry("the listing", partial(list_table, spec, location))

    def footer_of(info: pafs.FileInfo) -> tuple[pq.FileMetaData, str]:
        return retry(f"the footer of {info.path!r}", partial(read_footer, spec, location, info))

    if location.remote and len(infos) > 1:
        # Behind a store's latency the footers cost round trips, not bytes: read them together.
        with ThreadPoolExecutor(min(FOOTER_THREADS, len(infos))) as pool:
            footers = list(pool.map(footer_of, infos))
    else:
        footers = [footer_of(info) for info in infos]
    files: list[FileVersion] = []
    for info, (footer, etag) in zip(infos, footers, strict=True):
        # Schemas may differ: a source reads the union of them (see ``parquet_lake``).
        row_groups = tuple(footer.row_group(index).num_rows for index in range(footer.num_row_groups))
        file = FileVersion(info.path, info.size, info.mtime_ns, row_groups, etag)
        remember_footer(location.kind, file, footer)
        files.append(file)
    return replace(spec, files=tuple(files))


def version(spec: TableSpec) -> str:
    if spec.files is None:
        raise ValueError(f"{spec.uri!r} names no exact version yet; call TableSpec.resolve() first")
    # A local file has no entity tag, and leaving the empty one out keeps the versions pinned
    # before tags were recorded.
    digest = hashlib.sha256(repr([tuple(file) if file.etag else tuple(file)[:4] for file in spec.files]).encode())
    return f"parquet-{digest.hexdigest()[:16]}"


def check_unchanged(spec: TableSpec, location: Location, planned: tuple[FileVersion, ...]) -> None:
    """``ValueError`` naming every file added, removed or changed since ``spec`` was resolved."""
    now = {info.path: info for info in list_table(spec, location)}
    then = {file.path: file for file in planned}
    changes = [f"added {path!r}" for path in sorted(now.keys() - then.keys())]
    changes += [f"removed {path!r}" for path in sorted(then.keys() - now.keys())]
    changes += [
        f"changed {path!r}" for path in sorted(now.keys() & then.keys()) if not same_file(now[path], then[path])
    ]
    if changes:
        raise changed_error(spec, changes)


def same_file(now: pafs.FileInfo, planned: FileVersion) -> bool:
    """Whether a file is still the one planned: there, with the planned size and modification time."""
    return now.type == pafs.FileType.File and (now.size, now.mtime_ns) == (planned.size, planned.mtime_ns)


def changed_error(spec: TableSpec, changes: list[str]) -> ValueError:
    return ValueError(
        f"the Parquet files of {spec.uri!r} changed since version {version(spec)} was planned ("
        + ", ".join(changes)
        + "); rows of another version are never mixed in: resolve the spec again and restart the epoch"
    )
