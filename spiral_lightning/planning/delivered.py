"""The stored rows a consumer delivered between two of its cursors: arithmetic on its work list
alone, no reading (for a table read without a filter, whose output rows are its stored rows).

A consumer's stream is its work list's rows laid end to end. The rows delivered before a cursor
are the stream's rows before the cursor's row, and, for a cursor inside a shuffle window
(``Shuffled(buffer_rows=...)``), the rows of that window its order put first; a batch's rows are
those delivered after its cursor and not before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from spiral_lightning.core.plan import WorkItem
from spiral_lightning.core.state import Cursor
from spiral_lightning.planning.policies import window_order

#: Stored rows ``start`` to ``end`` of split ``split``.
Ranges = list[tuple[int, int, int]]

Positions = np.ndarray[Any, np.dtype[np.int64]]


def _offsets(items: Sequence[WorkItem]) -> Positions:
    """Where each item's rows begin in the stream, and the stream's length last."""
    sizes = np.array([item.end - item.start for item in items], dtype=np.int64)
    return np.concatenate((np.zeros(1, dtype=np.int64), np.cumsum(sizes)))


def _delivered(
    items: Sequence[WorkItem], offsets: Positions, cursor: Cursor | None, window_rows: int, key: Sequence[int]
) -> tuple[int, Positions]:
    """The stream rows delivered before ``cursor``: all before the first returned, and the
    second's (sorted) inside a shuffle window of ``window_rows`` rows drawn from ``key``."""
    none = np.zeros(0, dtype=np.int64)
    if cursor is None:
        return 0, none
    if cursor.item >= len(items):
        return int(offsets[-1]), none
    at = int(offsets[cursor.item] + cursor.row + cursor.skip - items[cursor.item].start)
    if not cursor.taken:
        return at, none
    rows = min(window_rows, int(offsets[-1]) - at)
    return at, at + np.sort(window_order(key, cursor.window, rows)[: cursor.taken]).astype(np.int64)


def rows_between(
    items: Sequence[WorkItem], before: Cursor | None, after: Cursor, window_rows: int = 0, key: Sequence[int] = ()
) -> Ranges:
    """The stored rows of ``items`` delivered after ``before`` (``None``: the list's start) up to
    ``after``, as ranges in stream order (``window_rows`` and ``key``: the consumer's shuffle
    windows, see ``planning.policies.window_order``)."""
    offsets = _offsets(items)
    low, taken_before = _delivered(items, offsets, before, window_rows, key)
    high, taken_after = _delivered(items, offsets, after, window_rows, key)
    if not taken_before.size and not taken_after.size:
        return _stored(items, offsets, low, high)
    positions = np.setdiff1d(np.union1d(np.arange(low, high, dtype=np.int64), taken_after), taken_before)
    if not positions.size:
        return []
    # Runs of consecutive positions, cut again where an item ends.
    item_of = np.searchsorted(offsets, positions, side="right") - 1
    breaks = np.flatnonzero((np.diff(positions) != 1) | (np.diff(item_of) != 0)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [positions.size]))
    ranges: Ranges = []
    for first, last in zip(starts.tolist(), ends.tolist(), strict=True):
        item = items[int(item_of[first])]
        stored = item.start + int(positions[first] - offsets[item_of[first]])
        ranges.append((item.split, stored, stored + last - first))
    return ranges


def _stored(items: Sequence[WorkItem], offsets: Positions, low: int, high: int) -> Ranges:
    """The stream's rows ``low`` to ``high`` as stored ranges, cut where an item ends."""
    ranges: Ranges = []
    item = int(np.searchsorted(offsets, low, side="right")) - 1
    while low < high:
        end = min(high, int(offsets[item + 1]))
        start = items[item].start + low - int(offsets[item])
        ranges.append((items[item].split, start, start + end - low))
        low, item = end, item + 1
    return ranges
