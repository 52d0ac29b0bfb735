"""Planning every consumer at once: ``plan_all`` and ``consumer_rows`` give exactly the work lists
and rows of the one-consumer policies, which give the lists of their definitions (kept here as
oracles: the whole plan walked for every consumer), and ``TableDataset``'s counts built on them
equal counting every consumer's list through the source, reading each unit once per job."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from spiral_lightning import Shard, Shuffled, Split, TableDataset, TableSpec, WorkItem, balanced, stripe
from spiral_lightning.core.plan import Plan, Policy
from spiral_lightning.planning.lists import consumer_rows, distinct, plan_all, stored_rows, unit_key, units
from spiral_lightning.planning.policies import shuffled_blocks
from spiral_lightning.reading.frames import Last
from tests import count_ddp_job
from tests.count_ddp_job import CountingSource
from tests.examples import examples
from tests.ranks import rank_jobs
from tests.tables import BACKENDS, KEEP_TEXT

ROOT = Path(__file__).resolve().parent.parent


def oracle_stripe(plan: Sequence[Split], shard: Shard, epoch: int = 0) -> list[WorkItem]:
    """``stripe`` as first defined."""
    owned = plan[shard.rank :: shard.world_size][shard.worker :: shard.workers]
    return [WorkItem(split.id, split.start, split.end) for split in owned]


def oracle_balanced(plan: Sequence[Split], shard: Shard, epoch: int = 0) -> list[WorkItem]:
    """``balanced`` as first defined: the whole plan walked for every consumer."""

    def share(total: int, index: int, parts: int) -> tuple[int, int]:
        return index * total // parts, (index + 1) * total // parts

    rank_start, rank_end = share(sum(split.end - split.start for split in plan), shard.rank, shard.world_size)
    start, end = share(rank_end - rank_start, shard.worker, shard.workers)
    start, end = rank_start + start, rank_start + end
    items: list[WorkItem] = []
    offset = 0
    for split in plan:
        rows = split.end - split.start
        low, high = max(start, offset), min(end, offset + rows)
        if low < high:
            items.append(WorkItem(split.id, split.start + low - offset, split.start + high - offset))
        offset += rows
    return items


def oracle_shuffled(policy: Shuffled) -> Policy:
    """``Shuffled.__call__`` by its definition: a work item for every block of the table in
    stored order, permuted by ``shuffled_blocks`` and dealt rank by rank, then worker by worker."""

    def call(plan: Sequence[Split], shard: Shard, epoch: int = 0) -> list[WorkItem]:
        blocks = [
            WorkItem(split.id, start, min(start + policy.block_rows, split.end))
            for split in plan
            for start in range(split.start, split.end, policy.block_rows)
        ]
        order = shuffled_blocks(np.arange(len(blocks)), len(blocks), policy.seed, epoch).tolist()
        mine = order[shard.rank :: shard.world_size][shard.worker :: shard.workers]
        return [blocks[index] for index in mine]

    return call


@st.composite
def plans(draw: st.DrawFn) -> list[Split]:
    """1 to 40 splits of 0 to 300 stored rows (some empty), starting anywhere, numbered with gaps
    as a filter that prunes splits numbers them."""
    sizes = draw(st.lists(st.one_of(st.just(0), st.integers(0, 300)), min_size=1, max_size=40))
    starts = draw(st.lists(st.integers(0, 1000), min_size=len(sizes), max_size=len(sizes)))
    ids = itertools.accumulate(draw(st.lists(st.integers(1, 3), min_size=len(sizes), max_size=len(sizes))))
    return [Split(i, start, start + size) for i, start, size in zip(ids, starts, sizes, strict=True)]


topology = {
    "plan": plans(),
    "world_size": st.integers(1, 5),
    "workers": st.integers(1, 4),
    "epoch": st.integers(0, 3),
    "seed": st.integers(0, 2**32),
    "block_rows": st.one_of(st.integers(1, 40), st.integers(41, 400)),
}


def every_shard(world_size: int, workers: int) -> list[Shard]:
    return [Shard(rank, world_size, worker, workers) for rank in range(world_size) for worker in range(workers)]


def stored(items: Sequence[WorkItem]) -> int:
    return sum(item.end - item.start for item in items)


def weight(item: WorkItem) -> int:
    """A stand-in for the rows a filter keeps of ``item``: any function of the item."""
    return (item.end - item.start) // 2 + item.split % 3


@examples(100, deadline=None)
@given(**topology)
def test_every_consumer_at_once_is_each_consumer_in_turn(
    plan: list[Split], world_size: int, workers: int, epoch: int, seed: int, block_rows: int
) -> None:
    shuffled = Shuffled(seed=seed, block_rows=block_rows)
    cases: list[tuple[Policy, Policy]] = [
        (stripe, oracle_stripe),
        (balanced, oracle_balanced),
        (shuffled, oracle_shuffled(shuffled)),
    ]
    for policy, oracle in cases:
        lists = [oracle(plan, shard, epoch) for shard in every_shard(world_size, workers)]
        # The one-consumer form: the same lists, item for item, from a list or a Plan.
        assert [policy(plan, shard, epoch) for shard in every_shard(world_size, workers)] == lists
        assert [policy(Plan(plan), shard, epoch) for shard in every_shard(world_size, workers)] == lists
        # Every consumer's list at once, consumer after consumer, each in its order.
        every = plan_all(policy, plan, world_size, workers, epoch)
        assert every.owner.tolist() == sorted(every.owner.tolist())
        assert [every.take(np.flatnonzero(every.owner == c)).items() for c in range(len(lists))] == lists
        # Every consumer's rows from its units' rows: stored rows, and any rows a filter could keep.
        found = units(policy, Plan(plan), world_size, workers)
        assert stored_rows(policy, Plan(plan), world_size, workers).tolist() == (found.end - found.start).tolist()
        for rows_of in (stored_item_rows, weight):
            unit_rows = np.array([rows_of(item) for item in found.items(np.arange(found.split.size))], dtype=np.int64)
            rows = consumer_rows(policy, Plan(plan), unit_rows, world_size, workers, epoch)
            assert rows.tolist() == [sum(map(rows_of, items)) for items in lists]


def stored_item_rows(item: WorkItem) -> int:
    return item.end - item.start


def stripe_reversed_on_odd_epochs(plan: Sequence[Split], shard: Shard, epoch: int = 0) -> list[WorkItem]:
    return stripe(list(plan)[::-1] if epoch % 2 else plan, shard, epoch)


class Dealt(Shuffled):
    """A subclass may deal otherwise, so it is planned one consumer at a time."""


@examples(30, deadline=None)
@given(plan=plans(), world_size=st.integers(1, 5), workers=st.integers(1, 4), epoch=st.integers(0, 3))
def test_other_policies_are_planned_one_consumer_at_a_time(
    plan: list[Split], world_size: int, workers: int, epoch: int
) -> None:
    for policy in (stripe_reversed_on_odd_epochs, Dealt(seed=1, block_rows=7)):
        assert unit_key(policy, world_size, workers) is None
        lists = [policy(plan, shard, epoch) for shard in every_shard(world_size, workers)]
        every = plan_all(policy, plan, world_size, workers, epoch)
        assert [every.take(np.flatnonzero(every.owner == c)).items() for c in range(len(lists))] == lists
        with pytest.raises(ValueError, match="planned one consumer at a time"):
            units(policy, Plan(plan), world_size, workers)


@examples(200, deadline=None)
@given(blocks=st.integers(0, 5000), seed=st.integers(0, 2**32), epoch=st.integers(0, 100))
def test_the_block_order_is_a_bijection_with_its_inverse(blocks: int, seed: int, epoch: int) -> None:
    positions = np.arange(blocks)
    order = shuffled_blocks(positions, blocks, seed, epoch)
    assert sorted(order.tolist()) == positions.tolist()
    assert shuffled_blocks(order, blocks, seed, epoch, inverse=True).tolist() == positions.tolist()
    # Any subset of positions gives the same blocks as the whole order does.
    some = positions[seed % 7 :: 5]
    assert shuffled_blocks(some, blocks, seed, epoch).tolist() == order[some].tolist()


def test_the_block_order_is_shuffled_and_differs_by_epoch_and_seed() -> None:
    blocks = 10_000
    first = shuffled_blocks(np.arange(blocks), blocks, 0, 0)
    assert (first != shuffled_blocks(np.arange(blocks), blocks, 0, 1)).mean() > 0.99
    assert (first != shuffled_blocks(np.arange(blocks), blocks, 1, 0)).mean() > 0.99
    # Neighbouring positions land far apart, and each tenth of the positions draws from every tenth of the blocks.
    assert np.median(np.abs(np.diff(first))) > blocks / 10
    spread = np.histogram2d(np.arange(blocks), first, bins=10)[0]
    assert spread.min() > 0.6 * blocks / 100 and spread.max() < 1.4 * blocks / 100


def test_planning_at_once_refuses_a_topology_with_no_consumer() -> None:
    plan = [Split(0, 0, 10)]
    with pytest.raises(ValueError, match="not a rank of a world of size 0"):
        plan_all(stripe, plan, 0, 1)
    with pytest.raises(ValueError, match="not a worker of 0"):
        plan_all(balanced, plan, 1, 0)


@examples(60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2**40), st.integers(0, 2**40), st.integers(-5, 2**40), st.none() | st.integers(0, 2**40)
        ),
        max_size=12,
    ),
    st.integers(-14, 14) | st.none(),
    st.integers(-14, 14) | st.none(),
    st.integers(-3, 3).filter(bool) | st.none(),
)
def test_a_plan_is_the_splits_it_was_made_from(
    splits: list[tuple[int, int, int, int | None]], low: int | None, high: int | None, step: int | None
) -> None:
    # A plan keeps columns only; each Split, its row estimate (or None) included, is made again.
    made = [Split(*split) for split in splits]
    plan = Plan(made)
    assert list(plan) == made
    assert [plan[index] for index in range(-len(made), len(made))] == made + made
    assert list(plan[low:high:step]) == made[low:high:step]
    assert plan.total == sum(max(split.end - split.start, 0) for split in made)
    rebuilt = Plan.of(plan.ids, plan.starts, plan.ends)
    assert list(rebuilt) == [split._replace(rows=None) for split in made]


@examples(60, deadline=None)
@given(st.lists(st.lists(st.integers(-(2**62), 2**62), max_size=30), min_size=1, max_size=4), st.booleans())
def test_distinct_is_numpys_unique(arrays: list[list[int]], presorted: bool) -> None:
    columns = [np.array(sorted(values) if presorted else values, dtype=np.int64) for values in arrays]
    found = distinct(*columns)
    assert found.dtype == np.int64
    assert found.tolist() == np.unique(np.concatenate(columns)).tolist()


def test_an_empty_plan_gives_every_consumer_nothing() -> None:
    for policy in (stripe, balanced, Shuffled(seed=2, block_rows=3)):
        assert plan_all(policy, [], 3, 2).items() == []
        found = units(policy, Plan(), 3, 2)
        assert consumer_rows(policy, Plan(), found.end - found.start, 3, 2, 0).tolist() == [0] * 6


def counted_one_list_at_a_time(dataset: TableDataset, workers: int, ranks: Sequence[int]) -> list[int]:
    """Each consumer's rows as ``TableDataset`` first counted them: its work list through the source."""
    consumers = max(1, workers)
    shards = [Shard(rank, dataset.world_size, worker, consumers) for rank in ranks for worker in range(consumers)]
    return [sum(dataset.source().count(dataset.work(shard))) for shard in shards]


def expected_even_rows(dataset: TableDataset, workers: int) -> tuple[int, int]:
    rows = counted_one_list_at_a_time(dataset, workers, range(dataset.world_size))
    quota = min(rows)
    if dataset.last == "require_full" and dataset.batch_size is not None:
        quota -= quota % dataset.batch_size
    return quota, sum(rows) - quota * len(rows)


def expected_batches(dataset: TableDataset, workers: int) -> int:
    assert dataset.batch_size is not None
    total = 0
    for counted in counted_one_list_at_a_time(dataset, workers, [dataset.rank]):
        rows = counted if dataset.rows_per_consumer is None else min(counted, dataset.rows_per_consumer)
        total += math.ceil(rows / dataset.batch_size) if dataset.last == "keep_partial" else rows // dataset.batch_size
    return total


POLICIES: dict[str, Policy] = {
    "stripe": stripe,
    "balanced": balanced,
    "shuffled": Shuffled(seed=3, block_rows=97),
    "other": stripe_reversed_on_odd_epochs,
}
SIZES = [300, 0, 500, 200, 1, 700, 40, 300, 120, 90]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("filtered", [False, True], ids=["unfiltered", "filtered"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_dataset_counts_equal_counting_every_list_through_the_source(
    make_table: Callable[..., TableSpec], backend: str, filtered: bool, policy: str
) -> None:
    spec = make_table(SIZES, seed=5, backend=backend, columns=["id"], filter=KEEP_TEXT if filtered else None)
    settings: list[tuple[int, Last, int | None]] = [
        (1, "keep_partial", None),
        (2, "require_full", None),
        (3, "keep_partial", 150),
    ]
    for world_size, last, quota in settings:
        for rank, epoch in itertools.product(range(world_size), range(3)):
            dataset = TableDataset(
                spec,
                batch_size=32,
                last=last,
                policy=POLICIES[policy],
                rank=rank,
                world_size=world_size,
                rows_per_consumer=quota,
            )
            dataset.set_epoch(epoch)
            for workers in (0, 1, 3):
                assert dataset.even_rows(workers) == expected_even_rows(dataset, workers)
                assert dataset.batches(workers) == expected_batches(dataset, workers)
            whole = sum(dataset.source().count(dataset.work(Shard(rank, world_size))))
            assert len(dataset) == (whole if quota is None else min(whole, quota))


def items_of(dataset: TableDataset, ranks: Sequence[int], workers: int) -> int:
    """The work items of every consumer of ``ranks``."""
    shards = [Shard(rank, dataset.world_size, worker, workers) for rank in ranks for worker in range(workers)]
    return sum(len(dataset.work(shard)) for shard in shards)


def test_filtered_counts_read_each_unit_once_per_job(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table(SIZES, seed=5, columns=["id"], filter=KEEP_TEXT)
    shuffled = Shuffled(seed=3, block_rows=97)
    for policy in (stripe, balanced, shuffled):
        dataset = TableDataset(spec, batch_size=32, policy=policy, rank=1, world_size=3)
        counting = CountingSource(dataset.source())
        dataset._source = counting
        # One call for every unit of the plan, whichever consumers are asked about.
        dataset.batches(4)
        dataset.even_rows(4)
        len(dataset)
        found = units(policy, dataset.source().splits, 3, 4)
        assert counting.calls == [found.split.size]
        # A new epoch deals Shuffled's blocks anew, from the same counts; only balanced's units
        # depend on the worker count.
        for epoch in (1, 2):
            dataset.set_epoch(epoch)
            dataset.even_rows(4)
            dataset.batches(4)
        assert len(counting.calls) == 1
        dataset.even_rows(2)
        assert len(counting.calls) == (2 if policy is balanced else 1)


def test_unfiltered_counts_ask_no_source(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table(SIZES, columns=["id"])
    for policy in POLICIES.values():
        dataset = TableDataset(spec, batch_size=32, policy=policy, rank=0, world_size=2)
        counting = CountingSource(dataset.source())
        dataset._source = counting
        assert dataset.even_rows(2)[0] > 0 and dataset.batches(2) > 0 and len(dataset) > 0
        assert counting.calls == []


@pytest.mark.parametrize("filtered", [False, True], ids=["unfiltered", "filtered"])
def test_kept_counts_follow_the_epoch_and_the_workers(make_table: Callable[..., TableSpec], filtered: bool) -> None:
    spec = make_table(SIZES, seed=5, columns=["id"], filter=KEEP_TEXT if filtered else None)
    for policy in (stripe, balanced, Shuffled(seed=3, block_rows=97)):
        dataset = TableDataset(spec, batch_size=32, policy=policy, rank=1, world_size=2)
        for epoch, workers in [(0, 2), (1, 2), (1, 3), (0, 2), (2, 0), (1, 3)]:
            dataset.set_epoch(epoch)
            fresh = TableDataset(spec, batch_size=32, policy=policy, rank=1, world_size=2)
            fresh.set_epoch(epoch)
            assert dataset.batches(workers) == expected_batches(fresh, workers)
            assert dataset.even_rows(workers) == expected_even_rows(fresh, workers)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["stripe", "balanced", "shuffled"])
def test_ranks_share_the_filtered_counts_of_a_job(
    make_table: Callable[..., TableSpec], tmp_path: Path, policy: str
) -> None:
    spec = make_table(SIZES, seed=5, columns=["id"])
    world_size = 2
    argv = ["--uri", spec.uri, "--filter", KEEP_TEXT, "--policy", policy, "--out", str(tmp_path)]
    rank_jobs(count_ddp_job.main, argv, world_size, tmp_path)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world_size)]
    # The units are counted once per job: each rank one call for its share, none in later epochs.
    whole = TableDataset(replace(spec, filter=KEEP_TEXT), batch_size=16, policy=policy, rank=0, world_size=world_size)
    found = units(whole.policy, whole.source().splits, world_size, 2)
    assert [result["calls"] for result in results] == [
        [len(range(rank, found.split.size, world_size))] for rank in range(world_size)
    ]
    # And the exchanged counts are the ones each rank would count alone.
    for rank, result in enumerate(results):
        alone = TableDataset(
            replace(spec, filter=KEEP_TEXT), batch_size=16, policy=policy, rank=rank, world_size=world_size
        )
        for epoch, counted in enumerate(result["epochs"]):
            alone.set_epoch(epoch)
            assert counted == {"even_rows": list(expected_even_rows(alone, 2)), "batches": expected_batches(alone, 2)}
