"""Splits, work items, shards and the policies that turn a plan into one consumer's work list.

Everything here is a pure value or a pure function: every process that asks a policy for a
consumer's work list gets the same list without talking to any other process.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, is_dataclass

import numpy as np

from spiral_lightning.core.checks import check_count, check_positive
from spiral_lightning.core.plan import Policy, Shard, Split, WorkItem, as_plan, share


def stripe(plan: Sequence[Split], shard: Shard, epoch: int = 0) -> list[WorkItem]:
    """Whole splits striped by rank, then by worker, in stored order; the same in every epoch.

    Rank ``r`` of ``w`` owns splits ``r, r + w, r + 2w, ...``; worker ``k`` of ``n`` takes every
    ``n``-th of the rank's splits from its ``k``-th. A rank's share does not depend on its
    worker count.
    """
    owned = as_plan(plan)[shard.rank :: shard.world_size][shard.worker :: shard.workers]
    return list(map(WorkItem, owned.ids.tolist(), owned.starts.tolist(), owned.ends.tolist()))


@dataclass(frozen=True)
class Shuffled:
    """A different order every epoch: blocks of up to ``block_rows`` stored rows (never crossing
    a split) are permuted with ``(seed, epoch)`` and dealt in turn to the ranks, then to each
    rank's workers, so reads stay sequential inside a block and a rank's share does not depend on
    its worker count. The same seed and epoch give the same order in every process.

    The permutation is a keyed bijection on block numbers (``shuffled_blocks``), so a consumer
    computes only its own blocks: its list costs O(its blocks), not O(the table's blocks).

    With ``buffer_rows`` each consumer also shuffles its rows within consecutive windows of that
    many rows (bounded memory), each window's order drawn from the seed, the epoch, the consumer
    and the window's number; a resume re-reads only the current window.
    """

    seed: int = 0
    block_rows: int = 8192
    buffer_rows: int = 0

    def __post_init__(self) -> None:
        check_count("Shuffled's seed", self.seed)
        check_positive("Shuffled's block_rows", self.block_rows)
        check_count("Shuffled's buffer_rows", self.buffer_rows)

    def __call__(self, plan: Sequence[Split], shard: Shard, epoch: int = 0) -> list[WorkItem]:
        plan = as_plan(plan)
        blocks = plan.blocks(self.block_rows)
        consumers = shard.world_size * shard.workers
        # Position p is dealt to rank p % world_size, and there to worker (p // world_size) % workers.
        positions = np.arange(shard.rank + shard.world_size * shard.worker, blocks, consumers, dtype=np.int64)
        return plan.block_items(self.block_rows, shuffled_blocks(positions, blocks, self.seed, epoch))


#: The most rows ``shuffle_for`` buffers in a consumer's window: of plain columns, and of a
#: table with media to decode, whose stored rows (encoded images, clips) are large.
SHUFFLE_WINDOW_ROWS = 65_536
SHUFFLE_MEDIA_WINDOW_ROWS = 4_096

#: The fewest blocks ``shuffle_for`` cuts a table into, and the most rows a block holds (8,192
#: rows read about as fast as whole splits; blocks of 1,024 cost 4x, see benchmarks/shuffled.py).
SHUFFLE_BLOCKS = 64
SHUFFLE_BLOCK_ROWS = 8_192

#: Blocks ``shuffle_for`` puts in one window at least, so a batch draws from that many places.
SHUFFLE_WINDOW_BLOCKS = 8


def shuffle_for(rows: int, seed: int = 0, *, media: bool = False, windows: bool = True) -> Shuffled:
    """The shuffle ``shuffle=True`` reads a table of ``rows`` stored rows with: blocks of
    ``rows // 64`` rows (at most 8,192, at most an eighth of a window), and windows of up to
    65,536 rows (4,096 with ``media``; the whole table when smaller), so a consumer's window holds
    at least eight blocks from random places of the table and a small table is shuffled whole.
    Without ``windows`` (a kind that keeps rows in stored order inside a block, such as packing)
    only the blocks are permuted. It depends on the stored rows alone, so every topology of a job
    reads with the same policy and an elastic resume continues it."""
    check_count("rows", rows)
    window = min(rows, SHUFFLE_MEDIA_WINDOW_ROWS if media else SHUFFLE_WINDOW_ROWS)
    block = max(1, min(SHUFFLE_BLOCK_ROWS, rows // SHUFFLE_BLOCKS, window // SHUFFLE_WINDOW_BLOCKS))
    return Shuffled(seed, block_rows=block, buffer_rows=window if windows else 0)


#: Rounds of the Feistel network behind ``shuffled_blocks``.
_ROUNDS = 6


def shuffled_blocks(positions: np.ndarray, blocks: int, seed: int, epoch: int, *, inverse: bool = False) -> np.ndarray:
    """The block numbers dealt at ``positions`` of epoch ``epoch``'s order of ``blocks`` blocks
    (with ``inverse``, the positions the block numbers ``positions`` are dealt at): a bijection
    of ``range(blocks)`` keyed by ``(seed, epoch)``, computed for the values asked only.

    A Feistel network permutes the smallest even power of two that holds every block; a result
    past the last block is permuted again until it lands on one (cycle walking), which keeps
    the bijection. Each round mixes with the top bits of a 64-bit product by an odd key."""
    if blocks <= 1:
        return positions.astype(np.int64)
    half = (max(int(blocks - 1).bit_length(), 2) + 1) // 2
    mask, shift, width = np.uint64((1 << half) - 1), np.uint64(64 - half), np.uint64(half)
    keys = np.random.default_rng((seed, epoch)).integers(0, 2**63, size=(_ROUNDS, 2), dtype=np.uint64)
    keys[:, 1] |= np.uint64(1)
    rounds = keys[::-1] if inverse else keys

    def permute(values: np.ndarray) -> np.ndarray:
        left, right = values >> width, values & mask
        if inverse:
            left, right = right, left
        for xor, multiplier in rounds:
            mixed = right ^ xor
            mixed *= multiplier
            mixed >>= shift
            mixed ^= left
            left, right = right, mixed
        if inverse:
            left, right = right, left
        permuted: np.ndarray = (left << width) | right
        return permuted

    result = permute(positions.astype(np.uint64))
    outside = np.flatnonzero(result >= blocks)
    while outside.size:
        result[outside] = permute(result[outside])
        outside = outside[result[outside] >= blocks]
    return result.astype(np.int64)


#: The module the built-in policies' names in states keep (see ``policy_name``): a pinned string.
PINNED_MODULES = {__name__: "spiral_lightning.work"}


def policy_name(policy: Policy) -> str:
    """A stable name for ``policy``, recorded in states so a cursor is never read by another: a
    function's qualified name, or a dataclass policy's fields too (``Shuffled(seed=1, ...)``)."""
    module = getattr(policy, "__module__", None) or type(policy).__module__
    # States and lineages hold these names, so the built-in policies keep the module they had
    # when states were first saved, wherever their code moves.
    module = PINNED_MODULES.get(module, module)
    if is_dataclass(policy):
        return f"{module}.{policy!r}"
    name = getattr(policy, "__qualname__", None) or type(policy).__qualname__
    return f"{module}.{name}"


def balanced(plan: Sequence[Split], shard: Shard, epoch: int = 0) -> list[WorkItem]:
    """Equal shares of stored rows: every consumer gets the same number of stored rows, give or
    take one, cut from the splits in stored order; the same in every epoch.

    The plan's stored rows, laid end to end, are cut into ``world_size`` ranges, one per rank in
    rank order, and each rank's range into ``workers`` ranges. A work item is the part of one split
    inside a consumer's range, so splits of any size spread evenly, and a rank's share does not
    depend on its worker count. A split that ends before it starts holds no rows.
    """
    plan = as_plan(plan)
    start, end = share(plan.total, shard)
    if start >= end:
        return []
    # Only the splits that overlap the range are cut: found by a search on their offsets.
    offsets = plan.offsets
    first = int(np.searchsorted(offsets, start, side="right")) - 1
    last = int(np.searchsorted(offsets, end, side="left"))
    rows = np.diff(offsets[first : last + 1])
    low = np.maximum(offsets[first:last], start) - offsets[first:last]
    high = np.minimum(offsets[first:last] + rows, end) - offsets[first:last]
    base = plan.starts[first:last]
    kept = low < high
    return list(
        map(WorkItem, plan.ids[first:last][kept].tolist(), (base + low)[kept].tolist(), (base + high)[kept].tolist())
    )


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


def window_key(seed: int, epoch: int, shard: Shard) -> tuple[int, ...]:
    """What a consumer's window orders are drawn from, besides the window's number."""
    return (seed, epoch, *shard)


def window_order(key: Sequence[int], window: int, rows: int) -> np.ndarray:
    """The order in which window ``window`` of ``rows`` rows is delivered: a permutation of
    ``range(rows)``, the positions of the window's rows in the consumer's stream."""
    order: np.ndarray = np.random.default_rng((*key, window)).permutation(rows)
    return order
