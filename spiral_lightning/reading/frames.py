"""Reading a consumer's work list from a cursor, and cutting its rows into fixed-size frames.

A frame is a batch of exactly ``batch_size`` rows of one consumer's stream; frames cross read
batches and work items freely. Each frame comes with the cursor just after it, so a consumer
stopped after any frame resumes at its next row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Generic, Literal, NamedTuple, TypeVar

import pyarrow as pa

from spiral_lightning.core.plan import WorkItem
from spiral_lightning.core.state import Cursor
from spiral_lightning.sources import Reader

#: What happens to a consumer's rows after its last full frame: delivered as one shorter frame,
#: or a ``ValueError``.
Last = Literal["keep_partial", "require_full"]
LAST_MODES: tuple[Last, ...] = ("keep_partial", "require_full")


class Run(NamedTuple):
    """Undelivered rows of one read batch.

    The read batch began at stored row ``row`` of item ``item``; its first ``skip`` output rows
    were delivered before ``rows``. The item continues at stored row ``next_row``.
    """

    rows: pa.RecordBatch
    item: int
    row: int
    skip: int
    next_row: int


def start_of(items: Sequence[WorkItem]) -> Cursor:
    """The cursor before every row of ``items``."""
    return Cursor(0, items[0].start if items else 0)


def _after(run: Run, items: Sequence[WorkItem]) -> Cursor:
    """The cursor after the last row of ``run``."""
    if run.next_row < items[run.item].end:
        return Cursor(run.item, run.next_row)
    following = run.item + 1
    return Cursor(following, items[following].start if following < len(items) else 0)


def runs(reader: Reader, items: Sequence[WorkItem], cursor: Cursor) -> Iterator[Run]:
    """The undelivered rows of ``items`` from ``cursor`` on, as ``reader`` reads them."""
    if cursor.item >= len(items):
        return
    first = items[cursor.item]
    work = [WorkItem(first.split, cursor.row, first.end), *items[cursor.item + 1 :]]
    rows_at = [item.start for item in work]
    skip = cursor.skip
    for batch, index, next_row in reader.read(work):
        row, rows_at[index] = rows_at[index], next_row
        skipped = min(skip, batch.num_rows) if index == 0 else 0
        skip -= skipped
        if skipped < batch.num_rows:
            yield Run(batch.slice(skipped), cursor.item + index, row, skipped, next_row)


#: A position in a consumer's stream: a ``Cursor``, for every stream this module cuts.
P = TypeVar("P")


class Chunk(NamedTuple, Generic[P]):
    """Consecutive rows of a consumer's stream, and ``at(n)``: the position just after the
    chunk's first ``n`` rows (``1 <= n <= len``)."""

    rows: pa.RecordBatch
    at: Callable[[int], P]


class Part(NamedTuple):
    """Rows ``offset`` to ``offset + length`` of one chunk's ``rows``."""

    rows: pa.RecordBatch
    offset: int
    length: int


class Frame(NamedTuple):
    """One frame's ``num_rows`` rows as the parts of the chunks it was cut from, in order.

    A frame keeps its chunks rather than a joined batch so that a converter can convert each
    chunk once and slice the result (see ``BatchSlices``); ``rows()`` joins them.
    """

    parts: tuple[Part, ...]
    num_rows: int

    def rows(self) -> pa.RecordBatch:
        """The frame's rows as one record batch."""
        slices = [part.rows.slice(part.offset, part.length) for part in self.parts]
        return slices[0] if len(slices) == 1 else pa.concat_batches(slices)

    def head(self, rows: int) -> Frame:
        """The frame's first ``rows`` rows (``0 < rows <= num_rows``)."""
        kept: list[Part] = []
        left = rows
        for part in self.parts:
            if left <= 0:
                break
            kept.append(part._replace(length=min(part.length, left)))
            left -= part.length
        return Frame(tuple(kept), rows)


def cut(chunks: Iterable[Chunk[P]], batch_size: int | None, last: Last, end: P) -> Iterator[tuple[Frame, P]]:
    """Frames of ``batch_size`` rows cut from ``chunks``, each with the position after it; the
    frame of leftover rows (``keep_partial``) ends at ``end``. Without a ``batch_size`` each
    chunk is a frame as it arrives."""
    parts: list[Part] = []
    held = 0
    for chunk in chunks:
        rows = chunk.rows.num_rows
        if batch_size is None:
            yield Frame((Part(chunk.rows, 0, rows),), rows), chunk.at(rows)
            continue
        used = 0
        while used < rows:
            length = min(batch_size - held, rows - used)
            parts.append(Part(chunk.rows, used, length))
            held += length
            used += length
            if held == batch_size:
                yield Frame(tuple(parts), held), chunk.at(used)
                parts, held = [], 0
    if held:
        if last == "require_full":
            raise ValueError(
                f"{held} rows remain after this consumer's last full batch of {batch_size}; "
                "use last='keep_partial' to deliver them as a shorter batch, or pick a batch size that divides the rows"
            )
        yield Frame(tuple(parts), held), end


def cursor_after(run: Run, items: Sequence[WorkItem], rows: int) -> Cursor:
    """The cursor after the first ``rows`` rows of ``run``."""
    if rows < run.rows.num_rows:
        return Cursor(run.item, run.row, run.skip + rows)
    return _after(run, items)


def read_frames(
    reader: Reader,
    items: Sequence[WorkItem],
    cursor: Cursor,
    batch_size: int | None,
    last: Last,
) -> Iterator[tuple[Frame, Cursor]]:
    """Frames of ``batch_size`` rows from ``cursor`` on, each with the cursor after it.

    Without a ``batch_size`` each read batch is a frame as it arrives (empty ones dropped).
    """
    chunks = (Chunk(run.rows, partial(cursor_after, run, items)) for run in runs(reader, items, cursor))
    return cut(chunks, batch_size, last, Cursor(len(items), 0))
