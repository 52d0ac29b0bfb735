"""Windows cut from a consumer's rows: samples of ``size`` consecutive rows of one run, read
from a position and resumable at any batch, and counted ahead from a run's rows.

A run is a maximal stretch of consecutive rows of a consumer's stream that belong to one work
item and hold one value of the group column. Windows never leave a run: a group boundary ends
an episode, and a work-item boundary ends what this consumer reads contiguously, because the
rows after it may belong to another consumer, and a window across it would depend on how the
table was split among consumers.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from spiral_lightning.core.checks import check_positive
from spiral_lightning.core.plan import WorkItem
from spiral_lightning.core.state import Cursor
from spiral_lightning.reading.frames import Last, runs
from spiral_lightning.sources import Reader, Source


@dataclass(frozen=True)
class Windows:
    """Samples of ``size`` consecutive rows of one run, a new one starting every ``stride`` rows.

    Within each run windows start at the run's rows ``0, stride, 2 * stride, ...`` and a window
    is kept only when all its ``size`` rows lie in the run; rows a window never reaches are
    dropped. ``group_by`` names the column whose change of value ends a run (only work items
    end runs when ``None``). Runs consist of the rows the filter keeps, so a filter that drops
    rows inside an episode joins the rows around the gap.
    """

    size: int
    stride: int = 1
    group_by: str | None = None

    def __post_init__(self) -> None:
        for name in ("size", "stride"):
            value = getattr(self, name)
            check_positive(f"the window {name}", value)
        if self.group_by is not None and (not isinstance(self.group_by, str) or not self.group_by):
            raise ValueError(f"group_by must be a column name or None, not {self.group_by!r}")

    def settings(self) -> list[Any]:
        """``[size, stride, group_by]``, as a state records them."""
        return [self.size, self.stride, self.group_by]


class WindowPosition(NamedTuple):
    """Where a consumer's windows continue: the cursor of an anchor row and ``lead``, the number
    of rows after the anchor, in the anchor's run, at which the next window starts.

    The anchor is the next window's first row when it has been read (``lead`` 0), else the last
    row read, so a resumed reader sees which run that row belongs to before counting ``lead``.
    """

    cursor: Cursor
    lead: int = 0


class _Rows(NamedTuple):
    """Rows of one work item, the first at output row ``skip`` after stored row ``row`` of item
    ``item``, so row ``j`` is at ``Cursor(item, row, skip + j)``."""

    rows: pa.RecordBatch
    item: int
    row: int
    skip: int

    def cursor(self, index: int) -> Cursor:
        return Cursor(self.item, self.row, self.skip + index)

    def drop(self, rows: int) -> _Rows:
        return _Rows(self.rows.slice(rows), self.item, self.row, self.skip + rows)


def _groups(rows: _Rows, group_by: str | None) -> Iterator[tuple[_Rows, Any]]:
    """``rows`` cut where the group column changes value, each part with its group value."""
    if group_by is None:
        yield rows, None
        return
    column = rows.rows.column(group_by)
    if column.null_count:
        raise ValueError(f"the group column {group_by!r} holds nulls, so its runs are undefined; filter them out")
    count = len(column)
    changes = pc.not_equal(column.slice(1), column.slice(0, count - 1)).to_numpy(zero_copy_only=False)
    bounds = [0, *(np.flatnonzero(changes) + 1).tolist(), count]
    for start, end in itertools.pairwise(bounds):
        yield _Rows(rows.rows.slice(start, end - start), rows.item, rows.row, rows.skip + start), column[start].as_py()


def read_windows(
    reader: Reader,
    items: Sequence[WorkItem],
    position: WindowPosition,
    windows: Windows,
    batch_size: int,
    last: Last,
    leads: Sequence[int] = (),
) -> Iterator[tuple[pa.RecordBatch, WindowPosition]]:
    """Batches of ``batch_size`` windows from ``position`` on, each with the position after it.

    A batch holds its windows' rows one window after another (``batch_size * size`` rows). Only
    the rows from the anchor of the next window on are held, at most ``size`` rows plus one read
    batch. The windows after the last full batch are one shorter batch with
    ``last="keep_partial"``, a ``ValueError`` with ``"require_full"``. ``leads[i]`` (0 past its
    end) is the lead of item ``i``'s first run: a re-planned piece that begins inside a run.
    """
    size, stride = windows.size, windows.stride
    held: list[_Rows] = []
    held_rows = 0
    lead = position.lead
    run: tuple[int, Any] | None = None
    pending: list[pa.Table] = []
    count = 0
    for batch in runs(reader, items, position.cursor):
        rows = _Rows(batch.rows, batch.item, batch.row, batch.skip)
        for part, key in _groups(rows, windows.group_by):
            # The first part read begins the saved run at its saved lead; a new run starts at 0,
            # or at its item's lead when it is the item's first.
            if run != (part.item, key) and (run is not None or part.item != position.cursor.item):
                held, held_rows = [], 0
                new_item = run is None or run[0] != part.item
                lead = leads[part.item] if new_item and part.item < len(leads) else 0
            run = (part.item, key)
            held.append(part)
            held_rows += part.rows.num_rows
            starts = np.arange(lead, held_rows - size + 1, stride)
            if len(starts):
                rows_held = pa.Table.from_batches([piece.rows for piece in held])
                taken = rows_held.take(pa.array((starts[:, None] + np.arange(size)).ravel()))
                done = 0
                while done < len(starts):
                    step = min(batch_size - count, len(starts) - done)
                    pending.append(taken.slice(done * size, step * size))
                    count += step
                    done += step
                    if count == batch_size:
                        next_start = int(starts[done - 1]) + stride
                        yield _join(pending), _position(held, held_rows, next_start)
                        pending, count = [], 0
                lead = int(starts[-1]) + stride
            anchor = min(lead, held_rows - 1)
            held = _drop(held, anchor)
            held_rows -= anchor
            lead -= anchor
    if count:
        if last == "require_full":
            raise ValueError(
                f"{count} windows remain after this consumer's last full batch of {batch_size}; "
                "use last='keep_partial' to deliver them as a shorter batch"
            )
        yield _join(pending), WindowPosition(Cursor(len(items), 0))


def _position(held: list[_Rows], held_rows: int, next_start: int) -> WindowPosition:
    """The position whose next window starts ``next_start`` rows into the held rows."""
    anchor = min(next_start, held_rows - 1)
    offset = anchor
    for piece in held:
        if offset < piece.rows.num_rows:
            return WindowPosition(piece.cursor(offset), next_start - anchor)
        offset -= piece.rows.num_rows
    raise AssertionError("the anchor lies inside the held rows")


def _drop(held: list[_Rows], rows: int) -> list[_Rows]:
    """``held`` without its first ``rows`` rows."""
    kept: list[_Rows] = []
    for piece in held:
        if rows >= piece.rows.num_rows:
            rows -= piece.rows.num_rows
            continue
        kept.append(piece.drop(rows) if rows else piece)
        rows = 0
    return kept


def _join(parts: list[pa.Table]) -> pa.RecordBatch:
    return pa.concat_batches([batch for part in parts for batch in part.to_batches()])


def stack(batch: Any, size: int) -> Any:
    """A collated batch of whole windows with each column grouped by window: tensors reshaped
    from ``[B * size, ...]`` to ``[B, size, ...]``, lists cut into ``B`` lists of ``size``; a
    batch that is not a mapping of columns is returned as it is."""
    if not isinstance(batch, Mapping):
        return batch
    stacked: dict[str, Any] = {}
    for name, values in batch.items():
        if isinstance(values, torch.Tensor):
            stacked[name] = values.reshape(-1, size, *values.shape[1:])
        else:
            stacked[name] = [values[start : start + size] for start in range(0, len(values), size)]
    return stacked


def window_count(rows: int, lead: int, windows: Windows) -> int:
    """The windows of a run of ``rows`` rows whose first window starts ``lead`` rows in."""
    free = rows - lead - windows.size
    return 0 if free < 0 else free // windows.stride + 1


def count_windows(source: Source, items: Sequence[WorkItem], leads: Sequence[int], windows: Windows) -> int:
    """The windows ``read_windows`` cuts from ``items`` (with their ``leads``) read through
    ``source``, without cutting one: each item's kept rows counted, or, with a group column, the
    runs of its values read from ``source`` (a source of that column alone is enough)."""
    return sum(window_count(rows, lead, windows) for rows, lead in _runs(source, items, leads, windows))


class WindowPlaces(NamedTuple):
    """Where a consumer's windows lie in its stream (the rows it reads, laid end to end):
    ``starts``, each window's first row, and ``ends``, where each run ends, both in order."""

    starts: np.ndarray
    ends: np.ndarray

    def before(self, place: int, lead: int) -> int:
        """The number of windows before the next one of a ``WindowPosition`` whose anchor is
        stream row ``place``: the first window ``lead`` rows on in the anchor's run, or the
        first of a later run when that run ends before such a window fits."""
        run_end = self.ends[np.searchsorted(self.ends, place, side="right")] if place < self.ends[-1] else place
        return int(np.searchsorted(self.starts, min(place + lead, int(run_end))))


def window_places(source: Source, items: Sequence[WorkItem], leads: Sequence[int], windows: Windows) -> WindowPlaces:
    """The places of the windows ``read_windows`` cuts from ``items`` (see ``count_windows``)."""
    starts: list[np.ndarray] = []
    ends = [0]
    for rows, lead in _runs(source, items, leads, windows):
        count = window_count(rows, lead, windows)
        starts.append(ends[-1] + lead + windows.stride * np.arange(count, dtype=np.int64))
        ends.append(ends[-1] + rows)
    found = np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64)
    return WindowPlaces(found, np.array(ends[1:] or [0], dtype=np.int64))


def _runs(
    source: Source, items: Sequence[WorkItem], leads: Sequence[int], windows: Windows
) -> Iterator[tuple[int, int]]:
    """Each run of ``items`` in order: its rows and the lead of its first window."""
    if windows.group_by is None:
        for index, rows in enumerate(source.count(items)):
            yield rows, leads[index] if index < len(leads) else 0
        return
    run, length, lead = None, 0, 0
    for batch, index, _ in source.read(items):
        part = _Rows(batch, index, 0, 0)
        for piece, key in _groups(part, windows.group_by):
            if run != (index, key):
                if run is not None:
                    yield length, lead
                lead = leads[index] if (run is None or run[0] != index) and index < len(leads) else 0
                run, length = (index, key), 0
            length += piece.rows.num_rows
    if run is not None:
        yield length, lead
