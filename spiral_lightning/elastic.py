"""Elastic resume: the rows an epoch has not delivered yet, re-planned for other consumers.

A *remainder* is the undelivered rows of every consumer of a saved epoch, as stored-row ranges
in the saved consumers' order. The new consumers share it with ``balanced`` cuts, so a state
saved with W1 ranks of K1 workers continues under W2 ranks of K2 workers with no row lost and
none repeated; the epochs after it plan as usual.
"""

from __future__ import annotations

from collections.abc import Sequence

from spiral_lightning.sources import Source
from spiral_lightning.state import State
from spiral_lightning.work import Policy, Shard, Split, WorkItem, balanced, fingerprint, policy_name


def share(remainder: Sequence[WorkItem], shard: Shard) -> list[WorkItem]:
    """``shard``'s part of a remainder: equal stored rows per consumer, cut in remainder order."""
    return balanced([Split(item.split, item.start, item.end) for item in remainder], shard)


def _first_undelivered(source: Source, item: WorkItem, skip: int) -> int:
    """The stored row of ``item`` just after its first ``skip`` rows that pass the filter: the
    least ``end`` whose range from ``item.start`` holds ``skip`` of them (a binary search on
    counts, which read only the filter's columns)."""
    if skip == 0:
        return item.start
    low, high = item.start + skip, item.end
    while low < high:
        middle = (low + high) // 2
        if source.count([WorkItem(item.split, item.start, middle)])[0] >= skip:
            high = middle
        else:
            low = middle + 1
    return low


def _check_topology(states: Sequence[State]) -> tuple[int, int]:
    """The world size and worker count of ``states``: every consumer of one topology, once."""
    if not states:
        raise ValueError("an elastic resume needs the states of every consumer of the saved epoch, and got none")
    world_size, workers = states[0].shard.world_size, states[0].shard.workers
    expected = {Shard(rank, world_size, worker, workers) for rank in range(world_size) for worker in range(workers)}
    given = [state.shard for state in states]
    missing = sorted(expected - set(given))
    if missing or len(given) != len(expected) or set(given) != expected:
        raise ValueError(
            f"an elastic resume needs each of the {len(expected)} consumers of the saved {world_size} ranks x "
            f"{workers} workers once; got {sorted(given)} (missing {missing})"
        )
    return world_size, workers


def remainder(source: Source, policy: Policy, states: Sequence[State]) -> tuple[WorkItem, ...]:
    """The rows the consumers of ``states`` have not delivered in their epoch, as stored ranges."""
    _check_topology(states)
    first = states[0]
    for state in states:
        differ = [
            name for name in ("version", "epoch", "policy", "remainder") if getattr(state, name) != getattr(first, name)
        ]
        if differ:
            raise ValueError(f"the saved states of {first.shard} and {state.shard} differ in {differ}")
        if state.cursor is not None and (state.cursor.window or state.cursor.taken):
            raise ValueError(
                "a state saved inside a shuffle window (Shuffled(buffer_rows=...)) cannot be re-planned for "
                "other consumers; resume under the saved ranks and workers, or let the epoch finish"
            )
    if first.policy != policy_name(policy):
        raise ValueError(f"the states were saved with policy {first.policy}, not {policy_name(policy)}")
    undelivered: list[WorkItem] = []
    for state in sorted(states, key=lambda saved: saved.shard):
        planned = (
            share(first.remainder, state.shard)
            if first.remainder is not None
            else policy(source.splits, state.shard, state.epoch)
        )
        cursor = state.cursor
        if cursor is None:
            undelivered += planned
            continue
        if state.work is not None and fingerprint(planned) != state.work:
            raise ValueError(
                f"consumer {tuple(state.shard)}'s work list differs from the one its state was saved with; "
                "the policy must depend only on the plan, the shard and the epoch"
            )
        if cursor.item < len(planned):
            current = planned[cursor.item]
            start = _first_undelivered(source, WorkItem(current.split, cursor.row, current.end), cursor.skip)
            if start < current.end:
                undelivered.append(WorkItem(current.split, start, current.end))
            undelivered += planned[cursor.item + 1 :]
    return tuple(undelivered)
