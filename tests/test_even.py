"""Equal shares for every consumer: the ``balanced`` policy, the per-consumer row quota of
TableDataset, and the quota's place in the saved state."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader

from spiral_lightning import Shard, Split, State, TableDataset, TableSpec, WorkItem, balanced, stripe
from spiral_lightning.sources import Source
from tests.examples import examples
from tests.tables import KEEP, kept_ids

plans = st.lists(st.integers(0, 60), max_size=12).map(
    lambda sizes: [Split(i, 5, 5 + size) for i, size in enumerate(sizes)]
)


def rows_of(plan: list[Split], shard: Shard) -> list[tuple[int, int]]:
    return [(item.split, row) for item in balanced(plan, shard) for row in range(item.start, item.end)]


@examples(200, deadline=None)
@given(plan=plans, world_size=st.integers(1, 4), workers=st.integers(1, 4), epoch=st.integers(0, 3))
def test_balanced_gives_every_stored_row_once_in_equal_shares(
    plan: list[Split], world_size: int, workers: int, epoch: int
) -> None:
    shares = [
        rows_of(plan, Shard(rank, world_size, worker, workers))
        for rank in range(world_size)
        for worker in range(workers)
    ]
    every = [row for share in shares for row in share]
    assert every == [(split.id, row) for split in plan for row in range(split.start, split.end)]
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    rank_zero = Shard(0, world_size, 0, workers)
    assert balanced(plan, rank_zero, epoch) == balanced(plan, rank_zero, 0)


@examples(100, deadline=None)
@given(plan=plans, world_size=st.integers(1, 4), workers=st.integers(1, 4))
def test_balanced_rank_share_does_not_depend_on_workers(plan: list[Split], world_size: int, workers: int) -> None:
    for rank in range(world_size):
        alone = rows_of(plan, Shard(rank, world_size))
        assert [row for w in range(workers) for row in rows_of(plan, Shard(rank, world_size, w, workers))] == alone


def ids(dataset: TableDataset) -> list[int]:
    return [int(i) for batch in dataset for i in batch["id"]]


def test_quota_stops_each_consumer_after_its_rows_and_counts_batches(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([700, 50, 300], columns=["id"])
    dataset = TableDataset(spec, batch_size=64, policy=balanced, rank=1, world_size=2, rows_per_consumer=200)
    assert ids(dataset) == list(range(525, 725))
    assert len(dataset) == 200
    assert dataset.batches(0) == 4
    # Two workers of rank 1 read 262 and 263 stored rows; each stops at 200: 4 batches each.
    assert dataset.batches(2) == 8
    dataset.set_rows_per_consumer(None)
    assert len(dataset) == 525
    assert dataset.batches(2) == 10


def test_quota_resumes_at_the_same_last_row(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([400, 30, 900], columns=["id"], filter=KEEP)
    expected = kept_ids([400, 30, 900])
    quota = 150

    def dataset() -> TableDataset:
        return TableDataset(spec, batch_size=40, policy=balanced, rank=0, world_size=2, rows_per_consumer=quota)

    whole = ids(dataset())
    assert whole == [i for i in expected if i < 665][:quota]
    first = dataset()
    loader = StatefulDataLoader(first, batch_size=None)
    delivered: list[int] = []
    for number, batch in enumerate(loader):
        delivered += batch["id"].tolist()
        if number == 1:
            state = loader.state_dict()
            break
    second = dataset()
    resumed = StatefulDataLoader(second, batch_size=None)
    resumed.load_state_dict(state)
    assert delivered + [i for batch in resumed for i in batch["id"].tolist()] == whole


def test_quota_is_part_of_the_settings_a_state_must_match(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([300], columns=["id"])
    saved = TableDataset(spec, batch_size=10, rows_per_consumer=100)
    iterator = iter(saved)
    next(iterator)
    state = saved.state_dict()
    assert state["rows_per_consumer"] == 100
    assert state["delivered"] == 10
    assert State.from_dict(state).delivered == 10
    plain = TableDataset(spec, batch_size=10)
    assert "rows_per_consumer" not in plain.state_dict()
    with pytest.raises(ValueError, match=r"rows_per_consumer: saved 100, now None"):
        plain.load_state_dict(state)


def test_bad_quotas_name_the_fix(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([100])
    with pytest.raises(ValueError, match="rows_per_consumer must be a non-negative int"):
        TableDataset(spec, rows_per_consumer=-1)
    with pytest.raises(ValueError, match=r"not a multiple of batch_size 8.*round the quota down"):
        TableDataset(spec, batch_size=8, last="require_full", rows_per_consumer=20)
    with pytest.raises(ValueError, match="cannot be counted ahead"):
        TableDataset(spec).batches(1)


@pytest.mark.parametrize("workers", [0, 2])
def test_even_rows_is_the_fewest_rows_of_any_consumer(make_table: Callable[..., TableSpec], workers: int) -> None:
    sizes = [300, 500, 200, 700, 300, 400]
    spec = make_table(sizes, filter=KEEP)
    kept = set(kept_ids(sizes))
    bounds = list(itertools.accumulate(sizes, initial=0))
    counts = [len(kept.intersection(range(begin, end))) for begin, end in itertools.pairwise(bounds)]
    # The filtered scan prunes the splits it keeps nothing of (their scores' statistics say so);
    # stripe then gives rank r splits r, r + 2, ... and its worker k of n every n-th from the k-th.
    per_split = [count for count in counts if count]
    assert 0 in counts
    consumers = max(1, workers)
    rows = [sum(per_split[rank::2][worker::consumers]) for rank in range(2) for worker in range(consumers)]
    dataset = TableDataset(spec, batch_size=64, policy="stripe", rank=1, world_size=2)
    assert dataset.even_rows(workers) == (min(rows), sum(rows) - min(rows) * len(rows))
    full = TableDataset(spec, batch_size=64, last="require_full", policy="stripe", rank=0, world_size=2)
    assert full.even_rows(workers) == (min(rows) // 64 * 64, sum(rows) - min(rows) // 64 * 64 * len(rows))


def stripe_reversed_on_odd_epochs(plan: list[Split], shard: Shard, epoch: int) -> list[WorkItem]:
    """``stripe`` over the plan, the plan reversed in odd epochs, so shares change with the epoch."""
    return stripe(plan[::-1] if epoch % 2 else plan, shard, epoch)


class CountingSource:
    """A real source that also counts the ``count`` calls made through it."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.counts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)

    def count(self, items: Sequence[WorkItem]) -> list[int]:
        self.counts += 1
        return self.source.count(items)


def test_counts_follow_the_epochs_work_lists_and_are_made_once_per_list(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([300, 500, 200, 700, 300], filter=KEEP)
    policy = stripe_reversed_on_odd_epochs
    dataset = TableDataset(spec, batch_size=64, rank=0, world_size=2, policy=policy)
    counting = CountingSource(dataset.source())
    dataset._source = counting  # type: ignore[assignment]
    counted = []
    for epoch in [0, 1, 0, 1, 2]:
        dataset.set_epoch(epoch)
        fresh = TableDataset(spec, batch_size=64, rank=0, world_size=2, policy=policy)
        fresh.set_epoch(epoch)
        counts = (len(dataset), dataset.batches(2), dataset.even_rows(2))
        assert counts == (len(fresh), fresh.batches(2), fresh.even_rows(2))
        counted.append(counting.counts)
    # The odd epochs read other lists (rank 0's share changes), which are counted once; epochs
    # 0 and 2 read the same lists, so after epochs 0 and 1 nothing is counted again.
    assert counted[0] < counted[1] == counted[2] == counted[3] == counted[4]


def even_epoch_ids(spec: TableSpec, epoch: int, **options: Any) -> set[int]:
    """The ids two ranks deliver in ``epoch`` under even batches (the fewest rows of any consumer)."""
    delivered: set[int] = set()
    for rank in range(2):
        dataset = TableDataset(spec, batch_size=50, rank=rank, world_size=2, **options)
        dataset.set_epoch(epoch)
        dataset.set_rows_per_consumer(dataset.even_rows(0)[0])
        delivered.update(int(i) for batch in dataset for i in batch["id"])
    return delivered


def test_rows_left_out_for_even_batches_follow_the_shuffle_and_stay_in_stored_order(
    make_table: Callable[..., TableSpec],
) -> None:
    sizes = [900, 300, 600, 200]
    spec = make_table(sizes, columns=["id"], filter=KEEP)
    kept = set(kept_ids(sizes))
    # In stored order every epoch leaves out the same rows.
    stored = [kept - even_epoch_ids(spec, epoch) for epoch in range(2)]
    assert stored[0] and stored[0] == stored[1]
    # Shuffled, each epoch leaves out others, and a few epochs read every row.
    shuffled = [kept - even_epoch_ids(spec, epoch, shuffle=True, seed=3) for epoch in range(4)]
    assert all(shuffled) and len({frozenset(left) for left in shuffled}) == 4
    assert set.intersection(*shuffled) == set()
