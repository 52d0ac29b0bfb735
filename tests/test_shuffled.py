"""The shuffled policy: every row once per epoch, a different well-mixed order each epoch, the
same order everywhere for the same seed and epoch, and exact resume inside a shuffle window."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader

from spiral_lightning import Shard, Shuffled, TableDataset, TableSpec
from spiral_lightning.core.state import Cursor
from spiral_lightning.reading.frames import cut, read_frames, start_of
from spiral_lightning.reading.shuffle import shuffled_chunks
from spiral_lightning.sources import open_source
from tests.examples import examples
from tests.tables import BACKENDS, KEEP_TEXT, kept_ids, write_layout

EXAMPLES = examples(20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
policies = st.builds(
    Shuffled, seed=st.integers(0, 5), block_rows=st.integers(1, 1000), buffer_rows=st.sampled_from([0, 1, 7, 300, 1500])
)


@contextmanager
def table(sizes: list[int], seed: int, filtered: bool, backend: str) -> Iterator[TableSpec]:
    root = Path(tempfile.mkdtemp(prefix="shuffled-"))
    try:
        spec = write_layout(root / "t", sizes, seed, backend)
        yield replace(spec, columns=("id",), filter=KEEP_TEXT if filtered else None)
    finally:
        shutil.rmtree(root)


def consumer_ids(
    spec: TableSpec, policy: Shuffled, shard: Shard, epoch: int, batch_size: int | None
) -> list[list[int]]:
    """One consumer's batches of ids, read the way TableDataset reads them."""
    source = open_source(spec)
    items = policy(source.splits, shard, epoch)
    if policy.buffer_rows:
        chunks = shuffled_chunks(source, items, start_of(items), policy.buffer_rows, (policy.seed, epoch, *shard))
        frames = cut(chunks, batch_size, "keep_partial", Cursor(len(items), 0))
    else:
        frames = read_frames(source, items, start_of(items), batch_size, "keep_partial")
    return [frame.rows().column("id").to_pylist() for frame, _ in frames]


@EXAMPLES
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=4),
    seed=st.integers(0, 50),
    filtered=st.booleans(),
    backend=st.sampled_from(BACKENDS),
    policy=policies,
    world_size=st.integers(1, 3),
    workers=st.integers(1, 3),
    batch_size=st.one_of(st.none(), st.integers(1, 700)),
    epoch=st.integers(0, 3),
)
def test_every_row_once_per_epoch(
    sizes: list[int],
    seed: int,
    filtered: bool,
    backend: str,
    policy: Shuffled,
    world_size: int,
    workers: int,
    batch_size: int | None,
    epoch: int,
) -> None:
    with table(sizes, seed, filtered, backend) as spec:
        delivered = [
            row
            for rank in range(world_size)
            for worker in range(workers)
            for batch in consumer_ids(spec, policy, Shard(rank, world_size, worker, workers), epoch, batch_size)
            for row in batch
        ]
        want = kept_ids(sizes, seed) if filtered else list(range(sum(sizes)))
        assert sorted(delivered) == want


def test_orders_are_mixed_differ_by_epoch_and_repeat_by_seed(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([8000, 6000, 6000], columns=["id"])
    policy = Shuffled(seed=3, block_rows=64, buffer_rows=2048)

    def order(epoch: int, chosen: Shuffled = policy) -> list[int]:
        return [row for batch in consumer_ids(spec, chosen, Shard(), epoch, 500) for row in batch]

    first, again, second = order(0), order(0), order(1)
    assert sorted(first) == list(range(20_000))
    assert first == again
    assert first != second and sorted(second) == sorted(first)
    assert order(0, Shuffled(seed=4, block_rows=64, buffer_rows=2048)) != first
    # With 313 blocks of 64 rows the rank correlation of a random order has a spread of about
    # 1/sqrt(313) = 0.06 around zero; stored order has 1.
    for delivered in (first, second):
        ranks = np.argsort(np.argsort(delivered))
        correlation = np.corrcoef(ranks, np.arange(len(delivered)))[0, 1]
        assert abs(correlation) < 0.2, correlation


@EXAMPLES
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=4),
    seed=st.integers(0, 50),
    filtered=st.booleans(),
    backend=st.sampled_from(BACKENDS),
    policy=policies,
    world_size=st.integers(1, 2),
    batch_size=st.integers(1, 700),
    epoch=st.integers(0, 2),
    stop=st.floats(0, 1),
)
def test_resume_inside_a_window_equals_uninterrupted(
    sizes: list[int],
    seed: int,
    filtered: bool,
    backend: str,
    policy: Shuffled,
    world_size: int,
    batch_size: int,
    epoch: int,
    stop: float,
) -> None:
    with table(sizes, seed, filtered, backend) as spec:
        for rank in range(world_size):

            def dataset(rank: int = rank) -> TableDataset:
                made = TableDataset(spec, batch_size=batch_size, policy=policy, rank=rank, world_size=world_size)
                made.set_epoch(epoch)
                return made

            whole = [batch["id"].tolist() for batch in dataset()]
            cut_at = int(stop * len(whole))
            first = dataset()
            delivering = iter(first)
            before = [next(delivering)["id"].tolist() for _ in range(cut_at)]
            second = TableDataset(spec, batch_size=batch_size, policy=policy, rank=rank, world_size=world_size)
            second.load_state_dict(first.state_dict())
            assert second.epoch == epoch
            assert before + [batch["id"].tolist() for batch in second] == whole


def ids(batches: list[dict[str, Any]]) -> list[list[int]]:
    return [batch["id"].tolist() for batch in batches]


@pytest.mark.slow
def test_stateful_dataloader_resumes_a_window_shuffle_exactly(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([5000, 3000, 7000, 1000], columns=["id"])
    policy = Shuffled(seed=1, block_rows=700, buffer_rows=900)

    def loader() -> StatefulDataLoader:
        dataset = TableDataset(spec, batch_size=256, policy=policy)
        dataset.set_epoch(2)
        return StatefulDataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="forkserver")

    whole = ids(list(loader()))
    assert sorted(row for batch in whole for row in batch) == list(range(16_000))
    first = loader()
    delivering = iter(first)
    before = [next(delivering) for _ in range(13)]
    state = first.state_dict()
    second = loader()
    second.load_state_dict(state)
    assert ids(before) + ids(list(second)) == whole


def test_policy_names_carry_their_settings(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([100])
    saved = TableDataset(spec, batch_size=10, policy=Shuffled(seed=1))
    next(iter(saved))
    with pytest.raises(ValueError, match=r"policy: saved 'spiral_lightning\.work\.Shuffled\(seed=1"):
        TableDataset(spec, batch_size=10, policy=Shuffled(seed=2)).load_state_dict(saved.state_dict())
    with pytest.raises(ValueError, match="Shuffled's block_rows must be a positive int"):
        Shuffled(block_rows=0)
