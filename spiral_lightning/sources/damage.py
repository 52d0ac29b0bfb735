"""Bytes that do not decode: the error that says where they lie.

A decoder's own error (``OSError: Corrupt snappy compressed data.``, ``CRC checksum verification
failed``, ``Couldn't deserialize thrift``, spiral-sdk's ``Table storage failed: ...``) names no
table, file or row group; a job that fails mid-epoch must say which bytes to look at.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from spiral_lightning.core.plan import WorkItem
from spiral_lightning.sources.protocol import ReadBatch


class DamagedData(OSError):
    """Stored bytes of a table that do not decode (damaged, or rewritten since the version was
    pinned), or a local cache's copy of them. The message names the table, the file or split, and
    the row group or rows."""


#: What a ``DamagedData`` says to do, unless its bytes came from elsewhere than the table's files.
RESTORE = "the stored bytes are damaged: restore the file or rewrite the table, then resume from the last state"


def damaged(uri: str, where: str, error: BaseException, fix: str = RESTORE) -> DamagedData:
    """A ``DamagedData`` for ``error``, raised while decoding ``where`` (a file and row group, or a
    split and rows) of the table ``uri``, saying ``fix``. Only the first line of the decoder's text
    is kept: spiral-sdk appends a native backtrace."""
    said = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return DamagedData(f"cannot decode {where} of {uri!r}: {said} ({type(error).__name__}); {fix}")


def located(
    reads: Iterable[ReadBatch],
    items: Sequence[WorkItem],
    uri: str,
    errors: tuple[type[BaseException], ...],
    marks: tuple[str, ...],
) -> Iterator[ReadBatch]:
    """``reads`` of ``items`` as they come; one of ``errors`` whose text holds one of ``marks`` (the
    words of a decoder that met damaged bytes) raised while reading says which split and rows were
    being read (from the cursor of the last batch), as a ``DamagedData``. Other errors (a network's,
    a service's) pass as they are."""
    reader = iter(reads)
    index, row = 0, items[0].start if items else 0
    while True:
        try:
            read = next(reader, None)
        except errors as error:
            if not any(mark in str(error).lower() for mark in marks):
                raise
            while index + 1 < len(items) and row >= items[index].end:
                index, row = index + 1, items[index + 1].start
            item = items[min(index, len(items) - 1)]
            raise damaged(uri, f"split {item.split} (rows {row}..{item.end})", error) from error
        if read is None:
            return
        yield read
        _, index, row = read
