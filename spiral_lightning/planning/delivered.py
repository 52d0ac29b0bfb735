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
from typing import Any, NamedTuple

import numpy as np

from spiral_lightning.core.plan import WorkItem
from spiral_lightning.core.state import Cursor
from spiral_lightning.planning.policies import window_order

#: Ranges of stored rows, one a row of ``[split, start, end]`` (int64, shape ``[n, 3]``).
Ranges = np.ndarray[Any, np.dtype[np.int64]]

Positions = np.ndarray[Any, np.dtype[np.int64]]


class Stream(NamedTuple):
    """A consumer's work list as columns, built once a list so that a step costs the same
    whatever the list's length: each item's ``split`` and first stored row (``starts``), and
    ``offsets``, where each item's rows begin in the stream, the stream's length last."""

    splits: Positions
    starts: Positions
    offsets: Positions

    @classmethod
    def of(cls, items: Sequence[WorkItem]) -> Stream:
        """The stream of ``items``."""
        columns = np.array(items, dtype=np.int64).reshape(-1, 3)
        sizes = columns[:, 2] - columns[:, 1]
        return cls(columns[:, 0], columns[:, 1], np.concatenate((np.zeros(1, dtype=np.int64), np.cumsum(sizes))))

    def place(self, cursor: Cursor, kept: Positions | None = None) -> int:
        """The stream row ``cursor`` points at (for a cursor in a window, the window's first
        row); with ``kept`` (see ``kept_positions``), its place among the kept rows, whose
        ``skip`` the cursor counts."""
        if cursor.item >= len(self.splits):
            return int(self.offsets[-1]) if kept is None else len(kept)
        stored = int(self.offsets[cursor.item] + cursor.row - self.starts[cursor.item])
        return stored + cursor.skip if kept is None else int(np.searchsorted(kept, stored)) + cursor.skip


#: The orders of the last windows seen: a consumer reads each window over many batches.
_order = functools.lru_cache(maxsize=16)(window_order)


def kept_positions(stream: Stream, kept: Sequence[Positions]) -> Positions:
    """The stream positions of the rows a filter kept, from ``kept[i]``, the kept stored rows
    (sorted) of the split of the stream's item ``i`` (a source's ``kept``)."""
    ends = stream.starts + np.diff(stream.offsets)
    parts = [
        stream.offsets[index] + rows[(rows >= start) & (rows < end)] - start
        for index, (start, end, rows) in enumerate(zip(stream.starts.tolist(), ends.tolist(), kept, strict=True))
    ]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)


def rows_between(
    stream: Stream,
    before: Cursor | None,
    after: Cursor,
    window_rows: int = 0,
    key: Sequence[int] = (),
    kept: Positions | None = None,
) -> Ranges:
    """The stored rows of ``stream`` delivered after ``before`` (``None``: the list's start) up
    to ``after``, as ranges in stream order (``window_rows`` and ``key``: the consumer's shuffle
    windows, see ``planning.policies.window_order``; ``kept``: under a filter, the stream
    positions of the rows it kept, see ``kept_positions``)."""
    low = 0 if before is None else stream.place(before, kept)
    high = stream.place(after, kept)
    if not window_rows and kept is None:
        return _stored(stream, low, high)
    if not window_rows:
        return stored_ranges(stream, np.asarray(kept)[low:high])
    # Window by window: the rest of ``before``'s window in its order, whole windows between, and
    # the first ``after.taken`` rows of ``after``'s window in its order.
    total, key = int(stream.offsets[-1]) if kept is None else len(kept), tuple(key)
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
    return stored_ranges(stream, positions if kept is None else kept[positions])


def stored_ranges(stream: Stream, positions: Positions) -> Ranges:
    """The stored rows at ``positions`` of ``stream`` (sorted, each once), as ranges."""
    positions = np.asarray(positions, dtype=np.int64)
    if not len(positions):
        return np.zeros((0, 3), dtype=np.int64)
    # Runs of consecutive positions, cut again where an item ends.
    item_of = np.searchsorted(stream.offsets, positions, side="right") - 1
    breaks = np.flatnonzero((np.diff(positions) != 1) | (np.diff(item_of) != 0)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [positions.size])))
    owner = item_of[starts]
    firsts = stream.starts[owner] + positions[starts] - stream.offsets[owner]
    return np.stack([stream.splits[owner], firsts, firsts + lengths], axis=1)


def _stored(stream: Stream, low: int, high: int) -> Ranges:
    """The stream's rows ``low`` to ``high`` as stored ranges, cut where an item ends."""
    # A loop: a step spans one item or two, where numpy's calls cost more than they save.
    ranges: list[tuple[int, int, int]] = []
    item = int(np.searchsorted(stream.offsets, low, side="right")) - 1
    while low < high:
        end = min(high, int(stream.offsets[item + 1]))
        if end > low:
            start = int(stream.starts[item]) + low - int(stream.offsets[item])
            ranges.append((int(stream.splits[item]), start, start + end - low))
        low, item = end, item + 1
    return np.array(ranges, dtype=np.int64).reshape(-1, 3)
