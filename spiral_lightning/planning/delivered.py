"""The stored rows a consumer delivered between two of its cursors: arithmetic on its work list
and, for a filtered table, the rows its filter kept (``kept_positions``), no reading.

A consumer's stream is its work list's rows laid end to end; under a filter, the kept ones among
them. The rows delivered before a cursor are the stream's rows before the cursor's row, and, for
a cursor inside a shuffle window (``Shuffled(buffer_rows=...)``), the rows of that window its
order put first; a batch's rows are those delivered after its cursor and not before.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from spiral_lightning.core.plan import WorkItem
from spiral_lightning.core.state import Cursor
from spiral_lightning.planning.policies import window_order

#: Ranges of stored rows, one a row of ``[split, start, end]`` (int64, shape ``[n, 3]``).
Ranges = np.ndarray[Any, np.dtype[np.int64]]

Positions = np.ndarray[Any, np.dtype[np.int64]]


def _offsets(items: Sequence[WorkItem]) -> Positions:
    """Where each item's rows begin in the stream, and the stream's length last."""
    sizes = np.array([item.end - item.start for item in items], dtype=np.int64)
    return np.concatenate((np.zeros(1, dtype=np.int64), np.cumsum(sizes)))


#: The orders of the last windows seen: a consumer reads each window over many batches.
_order = functools.lru_cache(maxsize=16)(window_order)


def kept_positions(items: Sequence[WorkItem], kept: Sequence[Positions]) -> Positions:
    """The stream positions of the rows a filter kept of ``items``, from ``kept[i]``, the kept
    stored rows (sorted) of the split of ``items[i]`` (a source's ``kept``)."""
    offsets = _offsets(items)
    parts = [
        offsets[index] + rows[(rows >= item.start) & (rows < item.end)] - item.start
        for index, (item, rows) in enumerate(zip(items, kept, strict=True))
    ]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def _position(items: Sequence[WorkItem], offsets: Positions, cursor: Cursor, kept: Positions | None) -> int:
    """The stream row ``cursor`` points at (for a cursor in a window, the window's first row);
    with ``kept``, its place among the kept rows, whose ``skip`` the cursor counts."""
    if cursor.item >= len(items):
        return int(offsets[-1]) if kept is None else len(kept)
    stored = int(offsets[cursor.item] + cursor.row - items[cursor.item].start)
    return stored + cursor.skip if kept is None else int(np.searchsorted(kept, stored)) + cursor.skip


def stream_place(items: Sequence[WorkItem], cursor: Cursor, kept: Positions | None = None) -> int:
    """The stream row ``cursor`` points at in ``items`` (with ``kept``, among the kept rows)."""
    return _position(items, _offsets(items), cursor, kept)


def rows_between(
    items: Sequence[WorkItem],
    before: Cursor | None,
    after: Cursor,
    window_rows: int = 0,
    key: Sequence[int] = (),
    kept: Positions | None = None,
) -> Ranges:
    """The stored rows of ``items`` delivered after ``before`` (``None``: the list's start) up to
    ``after``, as ranges in stream order (``window_rows`` and ``key``: the consumer's shuffle
    windows, see ``planning.policies.window_order``; ``kept``: under a filter, the stream
    positions of the rows it kept, see ``kept_positions``)."""
    offsets = _offsets(items)
    low = 0 if before is None else _position(items, offsets, before, kept)
    high = _position(items, offsets, after, kept)
    if not window_rows and kept is None:
        return _stored(items, offsets, low, high)
    if not window_rows:
        return stored_ranges(items, np.asarray(kept)[low:high])
    # Window by window: the rest of ``before``'s window in its order, whole windows between, and
    # the first ``after.taken`` rows of ``after``'s window in its order.
    total, key = int(offsets[-1]) if kept is None else len(kept), tuple(key)
    window, taken = (0, 0) if before is None else (before.window, before.taken)
    parts: list[Positions] = []
    while low < high or (low == high and after.taken > taken):
        rows = min(window_rows, total - low)
        last = after.taken if low == high else rows
        parts.append(low + np.asarray(_order(key, window, rows)[taken:last], dtype=np.int64))
        if low == high:
            break
        low, window, taken = low + rows, window + 1, 0
    if not parts:
        return np.zeros((0, 3), dtype=np.int64)
    positions = np.sort(np.concatenate(parts))
    return _ranges_at(items, offsets, positions if kept is None else kept[positions])


def stored_ranges(items: Sequence[WorkItem], positions: Positions) -> Ranges:
    """The stored rows at stream ``positions`` (sorted, each once) of ``items``, as ranges."""
    if not len(positions):
        return np.zeros((0, 3), dtype=np.int64)
    return _ranges_at(items, _offsets(items), np.asarray(positions, dtype=np.int64))


def _ranges_at(items: Sequence[WorkItem], offsets: Positions, positions: Positions) -> Ranges:
    """``stored_ranges`` with the stream's ``offsets`` (see ``_offsets``) at hand."""
    # Runs of consecutive positions, cut again where an item ends.
    item_of = np.searchsorted(offsets, positions, side="right") - 1
    breaks = np.flatnonzero((np.diff(positions) != 1) | (np.diff(item_of) != 0)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [positions.size])))
    owner = item_of[starts]
    splits = np.array([item.split for item in items], dtype=np.int64)[owner]
    firsts = np.array([item.start for item in items], dtype=np.int64)[owner] + positions[starts] - offsets[owner]
    return np.stack([splits, firsts, firsts + lengths], axis=1)


def _stored(items: Sequence[WorkItem], offsets: Positions, low: int, high: int) -> Ranges:
    """The stream's rows ``low`` to ``high`` as stored ranges, cut where an item ends."""
    ranges: list[tuple[int, int, int]] = []
    item = int(np.searchsorted(offsets, low, side="right")) - 1
    while low < high:
        end = min(high, int(offsets[item + 1]))
        start = items[item].start + low - int(offsets[item])
        ranges.append((items[item].split, start, start + end - low))
        low, item = end, item + 1
    return np.array(ranges, dtype=np.int64).reshape(-1, 3)
