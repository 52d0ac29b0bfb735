"""Splits, work items, shards and the policies that turn a plan into one consumer's work list.

Everything here is a pure value or a pure function: every process that asks a policy for a
consumer's work list gets the same list without talking to any other process.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, is_dataclass
from typing import NamedTuple

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


def stripe(plan: Sequence[Split], shard: Shard, epoch: int = 0) -> list[WorkItem]:
    """Whole splits striped by rank, then by worker, in stored order; the same in every epoch.

    Rank ``r`` of ``w`` owns splits ``r, r + w, r + 2w, ...``; worker ``k`` of ``n`` takes every
    ``n``-th of the rank's splits from its ``k``-th. A rank's share does not depend on its
    worker count.
    """
    owned = plan[shard.rank :: shard.world_size][shard.worker :: shard.workers]
    return [WorkItem(split.id, split.start, split.end) for split in owned]


@dataclass(frozen=True)
class Shuffled:
    """A different order every epoch: blocks of up to ``block_rows`` stored rows (never crossing
    a split) are permuted with ``(seed, epoch)`` and dealt in turn to the ranks, then to each
    rank's workers, so reads stay sequential inside a block and a rank's share does not depend on
    its worker count. The same seed and epoch give the same order in every process.

    With ``buffer_rows`` each consumer also shuffles its rows within consecutive windows of that
    many rows (bounded memory), each window's order drawn from the seed, the epoch, the consumer
    and the window's number; a resume re-reads only the current window.
    """

    seed: int = 0
    block_rows: int = 8192
    buffer_rows: int = 0

    def __post_init__(self) -> None:
        for name, least in (("seed", 0), ("block_rows", 1), ("buffer_rows", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"Shuffled's {name} must be an int of at least {least}, not {value!r}")

    def __call__(self, plan: Sequence[Split], shard: Shard, epoch: int = 0) -> list[WorkItem]:
        blocks = [
            WorkItem(split.id, start, min(start + self.block_rows, split.end))
            for split in plan
            for start in range(split.start, split.end, self.block_rows)
        ]
        order = np.random.default_rng((self.seed, epoch)).permutation(len(blocks))
        mine = order[shard.rank :: shard.world_size][shard.worker :: shard.workers]
        return [blocks[index] for index in mine]


def policy_name(policy: Policy) -> str:
    """A stable name for ``policy``, recorded in states so a cursor is never read by another: a
    function's qualified name, or a dataclass policy's fields too (``Shuffled(seed=1, ...)``)."""
    module = getattr(policy, "__module__", None) or type(policy).__module__
    if is_dataclass(policy):
        return f"{module}.{policy!r}"
    name = getattr(policy, "__qualname__", None) or type(policy).__qualname__
    return f"{module}.{name}"


def fingerprint(items: Sequence[WorkItem]) -> str:
    """A short digest of a work list, so a cursor is never applied to a different list."""
    digest = hashlib.sha256()
    for split, start, end in items:
        digest.update(f"{split}:{start}:{end};".encode())
    return digest.hexdigest()[:16]


def balanced(plan: Sequence[Split], shard: Shard, epoch: int = 0) -> list[WorkItem]:
    """Equal shares of stored rows: every consumer gets the same number of stored rows, give or
    take one, cut from the splits in stored order; the same in every epoch.

    The plan's stored rows, laid end to end, are cut into ``world_size`` ranges, one per rank in
    rank order, and each rank's range into ``workers`` ranges. A work item is the part of one split
    inside a consumer's range, so splits of any size spread evenly, and a rank's share does not
    depend on its worker count.
    """
    rank_start, rank_end = _share(_stored_rows(plan), shard.rank, shard.world_size)
    start, end = _share(rank_end - rank_start, shard.worker, shard.workers)
    return _cut(plan, rank_start + start, rank_start + end)


def _stored_rows(plan: Sequence[Split]) -> int:
    return sum(split.end - split.start for split in plan)


def _share(total: int, index: int, parts: int) -> tuple[int, int]:
    """Rows ``start`` to ``end`` of part ``index`` when ``total`` rows are cut into ``parts``."""
    return index * total // parts, (index + 1) * total // parts


def _cut(plan: Sequence[Split], start: int, end: int) -> list[WorkItem]:
    """The work items covering stored rows ``start`` to ``end`` of the plan laid end to end."""
    items: list[WorkItem] = []
    offset = 0
    for split in plan:
        rows = split.end - split.start
        low, high = max(start, offset), min(end, offset + rows)
        if low < high:
            items.append(WorkItem(split.id, split.start + low - offset, split.start + high - offset))
        offset += rows
    return items


#: The policies a name selects, in YAML and in every ``policy=`` argument.
POLICIES: dict[str, Policy] = {"balanced": balanced, "stripe": stripe}


def as_policy(policy: str | Policy, seed: int = 0) -> Policy:
    """The policy ``policy`` names: ``"balanced"``, ``"stripe"``, ``"shuffled"`` (``Shuffled(seed=
    seed)``), ``"module.function"``, or a policy itself; ``ValueError`` for anything else, raised
    where the dataset is built rather than where it is first read."""
    if not isinstance(policy, str):
        if not callable(policy):
            raise ValueError(f"a policy is a function (plan, shard, epoch) -> work list or its name, not {policy!r}")
        return policy
    if policy == "shuffled":
        return Shuffled(seed=seed)
    if policy in POLICIES:
        return POLICIES[policy]
    module, _, name = policy.rpartition(".")
    found: object = None
    if module:
        try:
            found = getattr(importlib.import_module(module), name, None)
        except ImportError:
            found = None
    if not callable(found):
        raise ValueError(
            f"unknown policy {policy!r}; name one of {[*sorted(POLICIES), 'shuffled']} "
            "or a function as 'module.function'"
        )
    named: Policy = found
    return named
