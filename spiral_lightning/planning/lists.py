"""Every consumer's work list at once, as columns, for the built-in policies.

A rank needs the rows of every consumer of every rank (even batches), and an elastic re-plan
needs every saved consumer's list. Asking the policy once per consumer costs O(consumers x
plan); the functions here cost O(plan) whatever the number of consumers, and give exactly the
lists the one-consumer policies give (``tests/test_planning.py`` proves it).

*Units* are pieces of the plan that do not change from epoch to epoch (splits for ``stripe``,
blocks for ``Shuffled``, the pieces cut at the consumers' ranges for ``balanced``): their rows
after a filter, counted once, give every consumer's rows in every epoch as sums by owner.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from spiral_lightning.core.plan import Plan, Policy, Shard, Split, WorkItem, as_plan, share
from spiral_lightning.planning.policies import Shuffled, balanced, shuffled_blocks, stripe


class Pieces(NamedTuple):
    """Work items as columns: item ``i`` is ``WorkItem(split[i], start[i], end[i])`` of consumer
    ``owner[i]`` (``rank * workers + worker``)."""

    split: np.ndarray
    start: np.ndarray
    end: np.ndarray
    owner: np.ndarray

    def take(self, index: np.ndarray) -> Pieces:
        """The items numbered ``index``, in that order."""
        return Pieces(self.split[index], self.start[index], self.end[index], self.owner[index])

    def items(self) -> list[WorkItem]:
        """The items as ``WorkItem``s, in order."""
        return list(map(WorkItem, self.split.tolist(), self.start.tolist(), self.end.tolist()))


def owners(positions: np.ndarray, world_size: int, workers: int) -> np.ndarray:
    """The consumer (``rank * workers + worker``) that position ``p`` of a dealt order goes to:
    rank ``p % world_size``, and there worker ``(p // world_size) % workers``."""
    dealt: np.ndarray = positions % world_size * workers + positions // world_size % workers
    return dealt


def _firsts(world_size: int, workers: int) -> np.ndarray:
    """The first position of a dealt order each consumer gets, by consumer; it then gets every
    ``world_size * workers``-th position after it (see ``owners``)."""
    consumer = np.arange(world_size * workers)
    firsts: np.ndarray = consumer // workers + world_size * (consumer % workers)
    return firsts


def dealt(count: int, world_size: int, workers: int) -> tuple[np.ndarray, np.ndarray]:
    """The positions of a dealt order of ``count`` values, consumer after consumer, each
    consumer's in order, and their owners."""
    consumers = world_size * workers
    positions = _firsts(world_size, workers)[:, None] + consumers * np.arange(-(-count // consumers))[None, :]
    kept = positions < count
    return positions[kept], np.broadcast_to(np.arange(consumers)[:, None], positions.shape)[kept]


def _dealt_rows(count: int, world_size: int, workers: int) -> np.ndarray:
    """How many positions of a dealt order of ``count`` values each consumer gets."""
    consumers = world_size * workers
    rows: np.ndarray = np.maximum(count - _firsts(world_size, workers) + consumers - 1, 0) // consumers
    return rows


def _balanced_bounds(total: int, world_size: int, workers: int) -> np.ndarray:
    """Where each consumer's range of ``balanced`` begins, by consumer, then ``total``."""
    # Python ints, as balanced computes them: exact for any total, and O(consumers).
    begins = [
        share(total, Shard(rank, world_size, worker, workers))[0]
        for rank in range(world_size)
        for worker in range(workers)
    ]
    return np.array([*begins, total], dtype=np.int64)


def distinct(*arrays: np.ndarray) -> np.ndarray:
    """The distinct values of ``arrays``, in ascending order. A stable sort runs through arrays
    already sorted, as a plan's offsets and bounds are, in one merge; numpy 2.4's ``np.unique``
    and ``np.union1d`` hash every value instead, 30-100 times slower on a million offsets."""
    values = np.sort(np.concatenate(arrays), kind="stable")
    if values.size == 0:
        return values
    kept: np.ndarray = values[np.concatenate(([True], values[1:] != values[:-1]))]
    return kept


def _balanced_pieces(plan: Plan, world_size: int, workers: int) -> Pieces:
    """``balanced``'s items of every consumer: the plan cut at every split's and every
    consumer's first row, in stored order, which is consumer after consumer."""
    bounds = _balanced_bounds(plan.total, world_size, workers)
    cuts = distinct(plan.offsets, bounds)
    low, high = cuts[:-1], cuts[1:]
    split = np.searchsorted(plan.offsets, low, side="right") - 1
    start = plan.starts[split] + low - plan.offsets[split]
    owner = np.searchsorted(bounds, low, side="right") - 1
    return Pieces(plan.ids[split], start, start + high - low, owner)


def _balanced_firsts(plan: Plan, world_size: int, workers: int) -> np.ndarray:
    """The number of ``balanced``'s first piece of each consumer (see ``_balanced_pieces``), by
    consumer, then the number of pieces, without cutting the plan: the pieces begin at the
    distinct values of the splits' and the consumers' first rows, so the pieces before a row are
    the distinct split offsets below it plus the consumer bounds below it that no split shares."""
    bounds = _balanced_bounds(plan.total, world_size, workers)
    offsets = plan.offsets[np.concatenate(([True], np.diff(plan.offsets) > 0))]
    starts = distinct(bounds)
    found = np.minimum(np.searchsorted(offsets, starts), offsets.size - 1)
    alone = starts[offsets[found] != starts]
    firsts: np.ndarray = np.searchsorted(offsets, bounds) + np.searchsorted(alone, bounds)
    return firsts


def plan_all(policy: Policy, plan: Sequence[Split], world_size: int, workers: int, epoch: int = 0) -> Pieces:
    """Every consumer's work list in ``epoch`` when each of ``world_size`` ranks has ``workers``
    workers, consumer after consumer: the items of owner ``c`` are, in order, ``policy(plan,
    Shard(c // workers, world_size, c % workers, workers), epoch)``. O(plan) for the built-in
    policies; any other is asked once per consumer."""
    Shard(0, world_size, 0, workers).check()
    plan = as_plan(plan)
    if policy is stripe:
        index, owner = dealt(len(plan), world_size, workers)
        return Pieces(plan.ids[index], plan.starts[index], plan.ends[index], owner)
    if type(policy) is Shuffled:
        blocks = plan.blocks(policy.block_rows)
        positions, owner = dealt(blocks, world_size, workers)
        numbers = shuffled_blocks(positions, blocks, policy.seed, epoch)
        return Pieces(*plan.block_columns(policy.block_rows, numbers), owner)
    if policy is balanced:
        return _balanced_pieces(plan, world_size, workers)
    every = [
        (consumer, *item)
        for consumer, shard in enumerate(every_shard(world_size, workers))
        for item in policy(plan, shard, epoch)
    ]
    columns = np.array(every, dtype=np.int64).reshape(-1, 4)
    return Pieces(columns[:, 1], columns[:, 2], columns[:, 3], columns[:, 0])


def every_shard(world_size: int, workers: int, ranks: range | None = None) -> list[Shard]:
    """Every consumer of ``world_size`` ranks of ``workers`` workers, rank after rank, or those of
    ``ranks`` alone."""
    chosen = range(world_size) if ranks is None else ranks
    return [Shard(rank, world_size, worker, workers) for rank in chosen for worker in range(workers)]


class Units(NamedTuple):
    """Pieces of the plan whose rows, summed by owner, give every consumer's rows in any epoch:
    ``key`` names them (two unit sets with one key are equal) and ``split``/``start``/``end``
    are their columns."""

    key: str
    split: np.ndarray
    start: np.ndarray
    end: np.ndarray

    def items(self, index: np.ndarray) -> list[WorkItem]:
        """The units of ``index`` as work items."""
        return list(map(WorkItem, self.split[index].tolist(), self.start[index].tolist(), self.end[index].tolist()))


def unit_key(policy: Policy, world_size: int, workers: int) -> str | None:
    """What names the units of a built-in policy, ``None`` for any other (a subclass of
    ``Shuffled`` may deal otherwise, so it is planned one consumer at a time): the units of
    ``stripe`` and ``Shuffled`` do not depend on the topology, those of ``balanced`` do."""
    if policy is stripe:
        return "splits"
    if type(policy) is Shuffled:
        return f"blocks of {policy.block_rows}"
    if policy is balanced:
        return f"balanced {world_size}x{workers}"
    return None


def units(policy: Policy, plan: Plan, world_size: int, workers: int) -> Units:
    """The units of a built-in policy: the plan's splits for ``stripe``, its blocks in stored
    order for ``Shuffled``, and for ``balanced`` the pieces cut at the consumers' ranges of
    ``world_size`` x ``workers``. ``ValueError`` for any other policy."""
    key = unit_key(policy, world_size, workers)
    if key is None:
        raise ValueError(f"the policy {policy!r} is planned one consumer at a time, so it has no units")
    if policy is stripe:
        return Units(key, plan.ids, plan.starts, plan.ends)
    if isinstance(policy, Shuffled):
        return Units(key, *plan.block_columns(policy.block_rows, np.arange(plan.blocks(policy.block_rows))))
    pieces = _balanced_pieces(plan, world_size, workers)
    return Units(key, pieces.split, pieces.start, pieces.end)


def stored_rows(policy: Policy, plan: Plan, world_size: int, workers: int) -> np.ndarray:
    """The stored rows of each of ``units(policy, plan, world_size, workers)``. ``Shuffled``'s
    are made without its blocks' columns: every block holds ``block_rows`` but a split's last."""
    if not isinstance(policy, Shuffled) or unit_key(policy, world_size, workers) is None:
        found = units(policy, plan, world_size, workers)
        rows: np.ndarray = found.end - found.start
        return rows
    bounds = plan.block_bounds(policy.block_rows)
    blocks = np.diff(bounds)
    held = blocks > 0
    # int32 when a block's rows fit: a plan can hold tens of millions of blocks.
    rows = np.full(int(bounds[-1]), policy.block_rows, dtype=np.int32 if policy.block_rows < 2**31 else np.int64)
    rows[bounds[1:][held] - 1] = np.diff(plan.offsets)[held] - (blocks[held] - 1) * policy.block_rows
    return rows


def consumer_rows(
    policy: Policy, plan: Plan, unit_rows: np.ndarray, world_size: int, workers: int, epoch: int
) -> np.ndarray:
    """Every consumer's rows in ``epoch``, by ``rank * workers + worker``, from the rows of each
    of the units of ``policy`` (a built-in one) over ``plan``. For ``Shuffled`` only the blocks
    whose rows are not ``block_rows`` (a split's last block, or any block under a filter) are
    looked up in the epoch's order; every other block adds ``block_rows`` to the consumer dealt
    its position."""
    consumers = world_size * workers
    base = np.zeros(consumers, dtype=np.int64)
    if policy is stripe:
        owner, rows = owners(np.arange(len(plan)), world_size, workers), unit_rows
    elif isinstance(policy, Shuffled):
        full = policy.block_rows
        odd = np.flatnonzero(unit_rows != full)
        positions = shuffled_blocks(odd, unit_rows.size, policy.seed, epoch, inverse=True)
        owner, rows = owners(positions, world_size, workers), unit_rows[odd] - full
        base = _dealt_rows(unit_rows.size, world_size, workers) * full
    else:
        # A consumer's pieces are consecutive: its rows are a difference of running sums.
        running = np.concatenate(([0], np.cumsum(unit_rows, dtype=np.int64)))
        counted: np.ndarray = np.diff(running[_balanced_firsts(plan, world_size, workers)])
        return counted
    # bincount sums in float64, exact below 2**53 rows.
    summed: np.ndarray = base + np.rint(np.bincount(owner, weights=rows, minlength=consumers)).astype(np.int64)
    return summed
