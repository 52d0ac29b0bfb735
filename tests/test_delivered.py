"""``planning.delivered.rows_between`` against the stream it describes: for any two places in a
consumer's delivery order (stored order, or shuffle windows), the stored rows between them; and a
record's ranges, listed or packed, read back as written."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from spiral_lightning.core.plan import WorkItem
from spiral_lightning.core.state import Cursor
from spiral_lightning.datasets.record import LISTED_RANGES, decoded, encoded
from spiral_lightning.planning.delivered import Stream, kept_positions, rows_between
from spiral_lightning.planning.policies import window_order


def cursor_at(items: list[WorkItem], position: int, window: int = 0, taken: int = 0) -> Cursor:
    """The cursor of stream row ``position`` (a window's first row, for a window cursor)."""
    for index, item in enumerate(items):
        if position < item.end - item.start:
            return Cursor(index, item.start + position, 0, window, taken)
        position -= item.end - item.start
    return Cursor(len(items), 0, 0, window, taken)


@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    window_rows=st.sampled_from([0, 1, 7, 25, 1000]),
    places=st.tuples(st.integers(0, 300), st.integers(0, 300)),
)
def test_the_rows_between_two_places_are_those_the_stream_delivered_between_them(
    sizes: list[int], window_rows: int, places: tuple[int, int]
) -> None:
    items = [WorkItem(split, 10 * split, 10 * split + size) for split, size in enumerate(sizes)]
    stored = [(item.split, row) for item in items for row in range(item.start, item.end)]
    total = len(stored)
    key = (3, 1, 0, 1, 0, 1)
    # The delivery order of stream rows, and each place's cursor (taken inside its window).
    order: list[int] = []
    cursors: list[Cursor] = []
    start, window = 0, 0
    while start < total:
        rows = total if not window_rows else min(window_rows, total - start)
        shuffled = window_order(key, window, rows) if window_rows else np.arange(rows)
        for taken in range(rows):
            at = start + taken if not window_rows else start
            cursors.append(cursor_at(items, at, window, taken if window_rows else 0))
            order.append(start + int(shuffled[taken]))
        start, window = start + rows, window + 1
    cursors.append(cursor_at(items, total, window, 0))
    low, high = sorted(min(place, total) for place in places)
    before = None if low == 0 else cursors[low]
    found = rows_between(Stream.of(items), before, cursors[high], window_rows, key)
    rows = [(split, row) for split, first, end in found.tolist() for row in range(first, end)]
    assert rows == sorted(stored[position] for position in order[low:high])


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 10**12), st.integers(1, 1000)), max_size=40))
def test_a_records_ranges_read_back_as_written(found: list[tuple[int, int, int]]) -> None:
    ranges = [(split, start, start + rows) for split, start, rows in found]
    line = json.loads(json.dumps(encoded(np.array(ranges, dtype=np.int64).reshape(-1, 3))))
    assert decoded(line) == ranges
    assert ("packed" in line) == (len(ranges) > LISTED_RANGES)


@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    window_rows=st.sampled_from([0, 1, 7, 25, 1000]),
    places=st.tuples(st.integers(0, 300), st.integers(0, 300)),
    keep=st.lists(st.booleans(), min_size=240, max_size=240),
    from_item_start=st.booleans(),
)
def test_under_a_filter_the_rows_between_two_places_are_the_kept_rows_delivered_between_them(
    sizes: list[int], window_rows: int, places: tuple[int, int], keep: list[bool], from_item_start: bool
) -> None:
    items = [WorkItem(split, 10 * split, 10 * split + size) for split, size in enumerate(sizes)]
    stored = [(item.split, row) for item in items for row in range(item.start, item.end)]
    kept = [position for position in range(len(stored)) if keep[position]]
    # Each split's kept rows, with a row outside the item that the split holds beside it.
    kept_rows = {stored[position] for position in kept}
    by_split = [
        np.array([item.start - 1, *(row for split, row in stored if split == item.split and (split, row) in kept_rows)])
        for item in items
    ]
    assert kept_positions(Stream.of(items), by_split).tolist() == kept
    key = (3, 1, 0, 1, 0, 1)

    def cursor(place: int, window: int, taken: int) -> Cursor:
        """Output row ``place``'s cursor, counted from its item's first row or from its own."""
        if place == len(kept):
            return Cursor(len(items), 0, 0, window, taken)
        split, row = stored[kept[place]]
        earlier = sum(1 for position in kept[:place] if stored[position][0] == split)
        return (
            Cursor(split, items[split].start, earlier, window, taken)
            if from_item_start
            else Cursor(split, row, 0, window, taken)
        )

    order: list[int] = []
    cursors: list[Cursor] = []
    start, window = 0, 0
    while start < len(kept):
        rows = len(kept) if not window_rows else min(window_rows, len(kept) - start)
        shuffled = window_order(key, window, rows) if window_rows else np.arange(rows)
        for taken in range(rows):
            cursors.append(cursor(start + taken, 0, 0) if not window_rows else cursor(start, window, taken))
            order.append(start + int(shuffled[taken]))
        start, window = start + rows, window + 1
    cursors.append(cursor(len(kept), window, 0))
    low, high = sorted(min(place, len(kept)) for place in places)
    stream = Stream.of(items)
    found = rows_between(stream, None if low == 0 else cursors[low], cursors[high], window_rows, key, np.array(kept))
    rows = [(split, row) for split, first, end in found.tolist() for row in range(first, end)]
    assert rows == sorted(stored[kept[position]] for position in order[low:high])
