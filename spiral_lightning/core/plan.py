"""Splits, work items, shards and plans: the values a policy plans with, each pure and picklable."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from operator import itemgetter
from typing import NamedTuple, overload

import numpy as np


class Split(NamedTuple):
    """One unit of planning: stored rows ``start`` to ``end`` of the source's split number ``id``.

    ``rows`` is the source's estimate of the rows the split holds before the filter, or ``None``
    when the source gives none.
    """

    id: int
    start: int
    end: int
    rows: int | None = None


class WorkItem(NamedTuple):
    """Stored rows ``start`` to ``end`` of split ``split``, read in stored order."""

    split: int
    start: int
    end: int


class Shard(NamedTuple):
    """One consumer: DataLoader worker ``worker`` of ``workers`` on rank ``rank`` of ``world_size``."""

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    workers: int = 1

    def check(self) -> Shard:
        """This shard, or ``ValueError`` when its numbers name no consumer."""
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not a rank of a world of size {self.world_size}")
        if self.workers < 1 or not 0 <= self.worker < self.workers:
            raise ValueError(f"worker {self.worker} is not a worker of {self.workers}")
        return self


#: A pure function from a plan, a consumer and an epoch to the consumer's ordered work items.
#: It must give every row of the plan to exactly one consumer, depend only on its arguments, and
#: be picklable, so that every process computes the same lists.
Policy = Callable[[Sequence[Split], Shard, int], list[WorkItem]]


def fingerprint(items: Sequence[WorkItem]) -> str:
    """A short digest of a work list, so a cursor is never applied to a different list."""
    # One string hashed at once: the same digest as hashing each item's text in turn, in a third of the time.
    text = "".join([f"{split}:{start}:{end};" for split, start, end in items])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def share(total: int, shard: Shard) -> tuple[int, int]:
    """The range of the ``total`` rows laid end to end that ``balanced`` gives ``shard``."""
    rank_start, rank_end = _part(total, shard.rank, shard.world_size)
    start, end = _part(rank_end - rank_start, shard.worker, shard.workers)
    return rank_start + start, rank_start + end


def _part(total: int, index: int, parts: int) -> tuple[int, int]:
    """Rows ``start`` to ``end`` of part ``index`` when ``total`` rows are cut into ``parts``."""
    return index * total // parts, (index + 1) * total // parts


class Plan(Sequence[Split]):
    """A table version's splits in stored order, kept as int64 columns: ``ids``, ``starts``,
    ``ends``, ``rows`` (each split's row estimate, ``-1`` where the source gives none) and
    ``offsets`` (where each split begins in the plan laid end to end, then the total). Policies
    plan from the columns, so a plan of a million splits is walked once per process, not once per
    consumer, and holds 40 bytes a split; a ``Split`` is made when one is asked for. A slice is a
    plan over the same columns. A split that ends before it starts counts as empty."""

    def __init__(self, splits: Iterable[Split] = ()) -> None:
        kept = tuple(splits)
        count = len(kept)
        # itemgetter over the tuples is the quickest way from a million Splits to arrays.
        ids, starts, ends = (np.fromiter(map(itemgetter(i), kept), dtype=np.int64, count=count) for i in range(3))
        estimates = map(itemgetter(3), kept)
        rows = np.fromiter((_NO_ESTIMATE if row is None else row for row in estimates), dtype=np.int64, count=count)
        self._columns(ids, starts, ends, rows)

    @classmethod
    def of(cls, ids: np.ndarray, starts: np.ndarray, ends: np.ndarray, rows: np.ndarray | None = None) -> Plan:
        """The plan of the splits ``ids``, ``starts``, ``ends`` and row estimates ``rows``
        (equal-length int arrays; ``-1`` or no array: no estimate)."""
        plan = cls.__new__(cls)
        if rows is None:
            rows = np.full(np.shape(ids), _NO_ESTIMATE, dtype=np.int64)
        plan._columns(*(np.asarray(column, dtype=np.int64) for column in (ids, starts, ends, rows)))
        return plan

    def _columns(self, ids: np.ndarray, starts: np.ndarray, ends: np.ndarray, rows: np.ndarray) -> None:
        self.ids, self.starts, self.ends, self.rows = ids, starts, ends, rows
        stored = np.maximum(ends - starts, 0)
        self.offsets: np.ndarray = np.concatenate((np.zeros(1, dtype=np.int64), np.cumsum(stored)))
        self._bounds: dict[int, np.ndarray] = {}
        self._splits_of: dict[int, np.ndarray] = {}
        self._bases: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.ids.size)

    def row_numbers(self, index: int) -> np.ndarray:
        """The numbers of split ``index``'s stored rows, in order (int64)."""
        return np.arange(self.starts[index], self.ends[index], dtype=np.int64)

    @overload
    def __getitem__(self, index: int) -> Split: ...

    @overload
    def __getitem__(self, index: slice) -> Plan: ...

    def __getitem__(self, index: int | slice) -> Split | Plan:
        if isinstance(index, slice):
            return Plan.of(self.ids[index], self.starts[index], self.ends[index], self.rows[index])
        rows = int(self.rows[index])
        return Split(int(self.ids[index]), int(self.starts[index]), int(self.ends[index]), None if rows < 0 else rows)

    def __iter__(self) -> Iterator[Split]:
        estimates = (None if rows < 0 else rows for rows in self.rows.tolist())
        return map(Split, self.ids.tolist(), self.starts.tolist(), self.ends.tolist(), estimates)

    def __repr__(self) -> str:
        return f"Plan({len(self)} splits, {self.total} stored rows)"

    def __eq__(self, other: object) -> bool:
        # Equal to any sequence of the same splits, as the list a plan once was.
        if not isinstance(other, Sequence) or isinstance(other, str | bytes) or len(self) != len(other):
            return False
        return list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    @property
    def total(self) -> int:
        """The stored rows of every split."""
        return int(self.offsets[-1])

    def block_bounds(self, block_rows: int) -> np.ndarray:
        """The number of each split's first block of ``block_rows`` stored rows, then the number
        of blocks: split ``i`` holds blocks ``bounds[i]`` to ``bounds[i + 1]``, numbered in
        stored order."""
        if block_rows not in self._bounds:
            blocks = -(-np.diff(self.offsets) // block_rows)
            self._bounds[block_rows] = np.concatenate((np.zeros(1, dtype=np.int64), np.cumsum(blocks)))
        return self._bounds[block_rows]

    def block_splits(self, block_rows: int) -> np.ndarray:
        """The index in the plan of each block's split, by block number (kept, like the bounds)."""
        if block_rows not in self._splits_of:
            bounds = self.block_bounds(block_rows)
            index = np.arange(len(self), dtype=np.int32 if len(self) < 2**31 else np.int64)
            self._splits_of[block_rows] = np.repeat(index, np.diff(bounds))
        return self._splits_of[block_rows]

    def _block_bases(self, block_rows: int) -> np.ndarray:
        """Each split's first stored row less its first block's number times ``block_rows``:
        block ``b`` of split ``i`` starts at ``bases[i] + b * block_rows`` (kept, like the
        bounds, since one consumer's list asks for a few blocks at a time)."""
        if block_rows not in self._bases:
            self._bases[block_rows] = self.starts - self.block_bounds(block_rows)[:-1] * block_rows
        return self._bases[block_rows]

    def blocks(self, block_rows: int) -> int:
        """How many blocks of ``block_rows`` stored rows the plan holds."""
        return int(self.block_bounds(block_rows)[-1])

    def block_columns(self, block_rows: int, numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The split id, first and end stored row of each block of ``numbers``."""
        bounds = self.block_bounds(block_rows)
        if numbers.size * _SEARCHED < bounds[-1]:
            # side="right": an empty split shares its first number with the next split, which holds it.
            index = np.searchsorted(bounds, numbers, side="right") - 1
        else:
            # Many blocks: a lookup table of each block's split beats a search per block.
            index = self.block_splits(block_rows)[numbers]
        # One gather of a kept per-split base instead of two, and the sums made in place: at
        # millions of blocks every gather and fresh array costs more than the arithmetic.
        start = numbers.astype(np.int64)
        start *= block_rows
        start += self._block_bases(block_rows)[index]
        end = start + block_rows
        np.minimum(end, self.ends[index], out=end)
        return self.ids[index], start, end

    def block_items(self, block_rows: int, numbers: np.ndarray) -> list[WorkItem]:
        """The blocks of ``numbers`` as work items, in that order."""
        split, start, end = self.block_columns(block_rows, numbers)
        return list(map(WorkItem, split.tolist(), start.tolist(), end.tolist()))


#: A ``Plan``'s row estimate of a split whose source gives none.
_NO_ESTIMATE = -1


#: Below one block asked per this many blocks of a plan, ``Plan.block_columns`` searches the
#: bounds for each block's split instead of building the lookup table of every block's split.
_SEARCHED = 16


def as_plan(plan: Sequence[Split]) -> Plan:
    """``plan`` as a ``Plan``: itself when it is one (a source's splits are), else made here."""
    return plan if isinstance(plan, Plan) else Plan(plan)
