"""How a Parquet pass reaches its bytes: the files it holds open, and row groups fetched from an
object store as coalesced range reads, then read by the Parquet reader as if whole files."""

from __future__ import annotations

import bisect
import io
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from spiral_lightning.sources.retry import ShortRead

#: Files a pass keeps open at once, the least recently used dropped first, so a version of any
#: number of files reads within the process's limit of open files: a process reads on up to 4
#: threads, each in a pass of its own, and 4 * 32 stays well under 256 (macOS's default limit).
OPEN_FILES = 32


#: Column chunks closer than this are fetched in one range read (the bytes between are wasted).
HOLE_BYTES = 1 << 20


#: The largest range read; a longer span is fetched as several, concurrently.
PART_BYTES = 8 << 20


#: Bytes read past each column chunk's recorded end: some writers record chunk sizes a page
#: header short, and readers read that far.
CHUNK_PAD = 128


class Span(NamedTuple):
    """Bytes ``start..end`` of a file: column chunks read together."""

    start: int
    end: int


class Fetched(io.RawIOBase):
    """A file of which only some spans were fetched, read as a whole file by the Parquet reader.
    A read outside the spans is an error, never a request."""

    def __init__(self, path: str, size: int, spans: Sequence[Span], data: bytes | pa.Buffer) -> None:
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


class Pending(NamedTuple):
    """One row group's column chunks on their way: the spans and the range reads fetching them,
    or the bytes a cache kept."""

    file: int
    group: int
    spans: tuple[Span, ...]
    parts: tuple[Future[bytearray], ...]
    cached: pa.Buffer | None
    key: str
    #: Set when the pass no longer needs these bytes: retries stop waiting.
    stop: threading.Event


#: The byte a range read's buffer ends with before the read (and its complement for a second
#: read): a response that stops short leaves it there.
_MARK = 0xA5


def read_span(opened: pa.NativeFile, path: str, size: int, start: int) -> bytearray:
    """Bytes ``start..start + size`` of the file ``opened`` reads, checked to be all there:
    ``ShortRead`` when the store sent fewer.

    pyarrow's S3 reads write a response into a buffer of the size asked for and report that size
    even when the response was shorter, so the rest of the buffer is whatever lay there. This
    reads into a buffer of its own whose last byte is a mark: a short response leaves the mark.
    Bytes that truly end with the mark are read once more with another mark, so a complete
    read costs a second request once in 256 spans or so."""
    data = bytearray(size)
    if size == 0:
        return data
    got = 0
    for mark in (_MARK, _MARK ^ 0xFF):
        data[-1] = mark
        # A segment stream reads at its own offsets, so fetching threads may share one file.
        got = opened.get_stream(start, size).readinto(data)
        if got == size and data[-1] != mark:
            return data
    raise ShortRead(
        f"the store sent fewer bytes than asked for bytes {start}..{start + size} of {path!r}"
        + (f" ({got})" if got < size else "")
    )


class PassFiles:
    """The files one pass (a read, a count or a take) has opened, each opened and checked once by
    ``open_checked``, at most ``OPEN_FILES`` kept. Safe to use from the fetching threads."""

    def __init__(self, open_checked: Callable[[int], pa.NativeFile]) -> None:
        self._open_checked = open_checked
        self._opened: OrderedDict[int, pa.NativeFile] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, file: int) -> pa.NativeFile:
        with self._lock:
            opened = self._opened.pop(file, None)
            if opened is None:
                opened = self._open_checked(file)
                if len(self._opened) >= OPEN_FILES:
                    # Dropped, not closed: a read still using it keeps it open until it ends.
                    self._opened.popitem(last=False)
            self._opened[file] = opened
            return opened
