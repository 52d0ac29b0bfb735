"""A local folder of bytes fetched from an object store, within a byte budget, least recently used
dropped first, so later epochs read local disk instead of the network.

An entry is the bytes of one row group's column chunks, named by a digest of the file version
they belong to (path, size, modification time, entity tag), the row group and the columns. A
file rewritten in the store is a new version with new names, so an entry never serves bytes of
another version. Every process of a job may share one folder: entries are written to a temporary
name and renamed into place, and a reader whose entry was dropped meanwhile fetches again.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path

import pyarrow as pa

from spiral_lightning.core.checks import check_positive

#: The suffix of a complete entry, and of a temporary file an entry is being written into.
_SUFFIX = ".bytes"
_PARTIAL = ".partial"
#: Seconds after its last write that a temporary file is taken for one a killed process left.
_STALE_SECONDS = 3600
#: Entries an instance keeps at most between two looks at the whole folder (see ``keep``).
_LOOK_EVERY = 64


def kept_entries(folder: str | os.PathLike[str]) -> list[Path]:
    """The complete entries a ``ByteCache`` keeps in ``folder`` now, sorted by name (temporary
    files being written are not among them)."""
    return sorted(Path(folder).glob(f"*{_SUFFIX}"))


class ByteCache:
    """Entries in ``folder``, at most ``max_bytes`` of them together (an entry larger than the
    budget is never kept). Reading an entry marks it recently used."""

    def __init__(self, folder: str | os.PathLike[str], max_bytes: int) -> None:
        check_positive("a cache's byte budget", max_bytes)
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        # The folder's bytes when this instance last looked, plus what it kept since; and how many
        # entries it kept since. None: not looked yet.
        self._held: int | None = None
        self._kept_since = 0
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(f"cannot use {str(self.folder)!r} as a cache folder: {error}") from error

    @staticmethod
    def key(*parts: object) -> str:
        """The entry name for ``parts`` (any values with a stable ``repr``)."""
        return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]

    def get(self, key: str) -> pa.Buffer | None:
        """The bytes kept under ``key`` read into this process's memory, or ``None``. Not mapped:
        tensors made over a mapped file's pages would be read-only, and a write into one (an
        in-place transform) would crash the process."""
        file = self.open(key)
        if file is None:
            return None
        with file:
            data: pa.Buffer = file.read_buffer()
        return data

    def open(self, key: str) -> pa.OSFile | None:
        """The entry kept under ``key`` opened for reading in parts, or ``None``: what reads an
        entry a piece at a time, so that no more of it than the piece is in memory at once."""
        path = self._path(key)
        try:
            opened = pa.OSFile(str(path))
        except FileNotFoundError:
            return None
        try:
            os.utime(path)
        except FileNotFoundError:  # dropped since it was opened: as if it had not been there
            opened.close()
            return None
        return opened

    def has(self, key: str) -> bool:
        """Whether an entry is kept under ``key`` now (it may be dropped at any time after)."""
        return self._path(key).exists()

    def put(self, key: str, data: bytes | pa.Buffer) -> None:
        """Keep ``data`` under ``key``, then drop the least recently used entries over the budget."""
        if len(data) > self.max_bytes:
            return
        path = self.temporary()
        try:
            path.write_bytes(memoryview(data))
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        self.keep(key, path)

    def temporary(self) -> Path:
        """A new empty file in the folder to write an entry into, which ``keep`` names; whoever
        abandons it removes it (one left by a killed process is removed an hour after its last write)."""
        handle, temporary = tempfile.mkstemp(dir=self.folder, suffix=_PARTIAL)
        os.close(handle)
        return Path(temporary)

    def keep(self, key: str, path: Path) -> None:
        """Keep the written ``temporary()`` file ``path`` under ``key`` (removed instead when larger
        than the budget), then drop the least recently used entries over the budget.

        The folder is looked at whole (a directory scan) only when what this instance knows of it
        passes the budget, or after ``_LOOK_EVERY`` entries kept without a look: a scan at every
        entry made filling a folder of n entries cost n^2 file stats. What other processes keep
        between two looks is seen at the next, so a shared folder may pass its budget by up to
        that many entries of each process for a while."""
        size = path.stat().st_size
        if size > self.max_bytes:
            path.unlink()
            return
        os.replace(path, self._path(key))
        self._kept_since += 1
        if self._held is not None:
            self._held += size
        if self._held is None or self._held > self.max_bytes or self._kept_since >= _LOOK_EVERY:
            self._trim()

    def drop(self, key: str) -> None:
        """Forget the entry under ``key`` (bytes that did not decode), so the next read fetches again."""
        self._path(key).unlink(missing_ok=True)

    def _path(self, key: str) -> Path:
        """Where the entry under ``key`` is kept."""
        return self.folder / f"{key}{_SUFFIX}"

    def _trim(self) -> None:
        entries = []
        stale = time.time_ns() - _STALE_SECONDS * 10**9
        for entry in os.scandir(self.folder):
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue
            if entry.name.endswith(_SUFFIX):
                entries.append((stat.st_mtime_ns, stat.st_size, entry.path))
            elif entry.name.endswith(_PARTIAL) and stat.st_mtime_ns < stale:
                # Left by a process killed while writing it: every writer touches its file often.
                Path(entry.path).unlink(missing_ok=True)
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            Path(path).unlink(missing_ok=True)
            total -= size
        self._held, self._kept_since = total, 0
