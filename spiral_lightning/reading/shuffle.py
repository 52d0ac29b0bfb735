"""Window shuffles: a consumer's rows shuffled within consecutive windows of a bounded size.

Window ``j`` holds the consumer's rows ``j * size`` to ``(j + 1) * size`` (the last one
shorter); its rows are delivered in the order of a permutation drawn from ``key`` and ``j``. A
position inside the shuffled stream is the cursor of the window's first row with the window's
number and the rows of it already delivered, so a resume re-reads one window, never more.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial

from spiral_lightning.core.plan import WorkItem
from spiral_lightning.core.state import Cursor
from spiral_lightning.planning.policies import window_order
from spiral_lightning.reading.frames import Chunk, read_frames
from spiral_lightning.sources import Reader


def _inside(start: Cursor, after: Cursor, window: int, taken: int, size: int, rows: int) -> Cursor:
    """The position after ``rows`` more rows of window ``window``, of which ``taken`` were
    delivered before; past its ``size`` rows, the start of the next window at ``after``."""
    if taken + rows < size:
        return Cursor(start.item, start.row, start.skip, window, taken + rows)
    return Cursor(after.item, after.row, after.skip, window + 1, 0)


def shuffled_chunks(
    reader: Reader, items: Sequence[WorkItem], cursor: Cursor, size: int, key: Sequence[int]
) -> Iterator[Chunk[Cursor]]:
    """The consumer's undelivered rows from ``cursor`` on, window by window in shuffled order."""
    start = Cursor(cursor.item, cursor.row, cursor.skip)
    window, taken = cursor.window, cursor.taken
    for frame, after in read_frames(reader, items, start, size, "keep_partial"):
        rows = frame.rows()
        order = window_order(key, window, rows.num_rows)
        yield Chunk(rows.take(order[taken:]), partial(_inside, start, after, window, taken, rows.num_rows))
        start, window, taken = after, window + 1, 0
