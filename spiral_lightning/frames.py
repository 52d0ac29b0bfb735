"""Reading a consumer's work list from a cursor, and cutting its rows into fixed-size frames.

A frame is a batch of exactly ``batch_size`` rows of one consumer's stream; frames cross read
batches and work items freely. Each frame comes with the cursor just after it, so a consumer
stopped after any frame resumes at its next row.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Literal, NamedTuple

import pyarrow as pa

from spiral_lightning.sources import Source
from spiral_lightning.state import Cursor
from spiral_lightning.work import WorkItem

#: What happens to a consumer's rows after its last full frame: delivered as one shorter frame,
#: or a ``ValueError``.
Last = Literal["keep_partial", "require_full"]
LAST_MODES: tuple[Last, ...] = ("keep_partial", "require_full")


class _Run(NamedTuple):
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


def _after(run: _Run, items: Sequence[WorkItem]) -> Cursor:
    """The cursor after the last row of ``run``."""
    if run.next_row < items[run.item].end:
        return Cursor(run.item, run.next_row)
    following = run.item + 1
    return Cursor(following, items[following].start if following < len(items) else 0)


def _runs(source: Source, items: Sequence[WorkItem], cursor: Cursor) -> Iterator[_Run]:
    """The undelivered rows of ``items`` from ``cursor`` on, as the source reads them."""
    if cursor.item >= len(items):
        return
    first = items[cursor.item]
    work = [WorkItem(first.split, cursor.row, first.end), *items[cursor.item + 1 :]]
    rows_at = [item.start for item in work]
    skip = cursor.skip
    for batch, index, next_row in source.read(work):
        row, rows_at[index] = rows_at[index], next_row
        skipped = min(skip, batch.num_rows) if index == 0 else 0
        skip -= skipped
        if skipped < batch.num_rows:
            yield _Run(batch.slice(skipped), cursor.item + index, row, skipped, next_row)


def read_frames(
    source: Source,
    items: Sequence[WorkItem],
    cursor: Cursor,
    batch_size: int | None,
    last: Last,
) -> Iterator[tuple[pa.RecordBatch, Cursor]]:
    """Frames of ``batch_size`` rows from ``cursor`` on, each with the cursor after it.

    Without a ``batch_size`` each read batch is a frame as it arrives (empty ones dropped).
    """
    parts: list[pa.RecordBatch] = []
    held = 0
    for run in _runs(source, items, cursor):
        if batch_size is None:
            yield run.rows, _after(run, items)
            continue
        used = 0
        while used < run.rows.num_rows:
            part = run.rows.slice(used, batch_size - held)
            parts.append(part)
            held += part.num_rows
            used += part.num_rows
            if held == batch_size:
                inside = used < run.rows.num_rows
                after = Cursor(run.item, run.row, run.skip + used) if inside else _after(run, items)
                yield _join(parts), after
                parts, held = [], 0
    if held:
        if last == "require_full":
            raise ValueError(
                f"{held} rows remain after this consumer's last full batch of {batch_size}; "
                "use last='keep_partial' to deliver them as a shorter batch, or pick a batch size that divides the rows"
            )
        yield _join(parts), Cursor(len(items), 0)


def _join(parts: list[pa.RecordBatch]) -> pa.RecordBatch:
    return parts[0] if len(parts) == 1 else pa.concat_batches(parts)
