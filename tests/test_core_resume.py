"""Exactly once and resume = uninterrupted, as properties over random table layouts, consumers,
batch sizes and stop points, checked by row ids; and through a real StatefulDataLoader."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader

from spiral_lightning import Shard, Split, TableDataset, TableSpec, stripe, to_torch
from spiral_lightning.reading.frames import read_frames, start_of
from spiral_lightning.sources import open_source
from tests.examples import examples
from tests.lightning_job import reversed_on_odd_epochs
from tests.loaders import stopped_and_resumed
from tests.tables import BACKENDS, KEEP_TEXT, kept_ids, write_layout

split_sizes = st.lists(st.integers(0, 9000), min_size=1, max_size=5)
batch_sizes = st.one_of(st.none(), st.integers(1, 3000))
EXAMPLES = examples(25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextmanager
def table(sizes: list[int], seed: int, filtered: bool, backend: str) -> Iterator[TableSpec]:
    root = Path(tempfile.mkdtemp(prefix="resume-"))
    try:
        spec = write_layout(root / "t", sizes, seed, backend)
        yield replace(spec, columns=("id",), filter=KEEP_TEXT if filtered else None)
    finally:
        shutil.rmtree(root)


def expected(sizes: list[int], seed: int, filtered: bool) -> list[int]:
    return kept_ids(sizes, seed) if filtered else list(range(sum(sizes)))


@given(
    plan=st.lists(st.integers(0, 50), max_size=30).map(lambda ends: [Split(i, 0, e) for i, e in enumerate(ends)]),
    world_size=st.integers(1, 4),
    workers=st.integers(1, 4),
)
def test_stripe_gives_every_split_to_one_consumer_and_ranks_ignore_workers(
    plan: list[Split], world_size: int, workers: int
) -> None:
    owners: dict[int, Shard] = {}
    for rank in range(world_size):
        whole = stripe(plan, Shard(rank, world_size))
        per_worker = []
        for worker in range(workers):
            shard = Shard(rank, world_size, worker, workers)
            items = stripe(plan, shard)
            per_worker += items
            for item in items:
                assert item.split not in owners, f"split {item.split} given to {owners.get(item.split)} and {shard}"
                owners[item.split] = shard
        assert sorted(per_worker) == sorted(whole)
    assert sorted(owners) == [split.id for split in plan]


@EXAMPLES
@given(
    sizes=split_sizes,
    seed=st.integers(0, 100),
    filtered=st.booleans(),
    backend=st.sampled_from(BACKENDS),
    world_size=st.integers(1, 3),
    workers=st.integers(1, 3),
    batch_size=batch_sizes,
)
def test_consumers_read_every_row_once(
    sizes: list[int],
    seed: int,
    filtered: bool,
    backend: str,
    world_size: int,
    workers: int,
    batch_size: int | None,
) -> None:
    with table(sizes, seed, filtered, backend) as spec:
        source = open_source(spec)
        delivered: list[int] = []
        for rank in range(world_size):
            for worker in range(workers):
                items = stripe(source.splits, Shard(rank, world_size, worker, workers))
                for frame, _ in read_frames(source, items, start_of(items), batch_size, "keep_partial"):
                    delivered += frame.rows().column("id").to_pylist()
        assert sorted(delivered) == expected(sizes, seed, filtered)
        assert len(delivered) == len(set(delivered))


@EXAMPLES
@given(
    sizes=split_sizes,
    seed=st.integers(0, 100),
    filtered=st.booleans(),
    backend=st.sampled_from(BACKENDS),
    world_size=st.integers(1, 3),
    workers=st.integers(1, 3),
    batch_size=batch_sizes,
    stop=st.floats(0, 1),
)
def test_resuming_from_any_frame_continues_exactly(
    sizes: list[int],
    seed: int,
    filtered: bool,
    backend: str,
    world_size: int,
    workers: int,
    batch_size: int | None,
    stop: float,
) -> None:
    """For every consumer, frames before a stop plus frames read from the cursor saved there equal
    the uninterrupted frames, boundaries included."""
    with table(sizes, seed, filtered, backend) as spec:
        source = open_source(spec)
        for rank in range(world_size):
            for worker in range(workers):
                items = stripe(source.splits, Shard(rank, world_size, worker, workers))
                frames = list(read_frames(source, items, start_of(items), batch_size, "keep_partial"))
                whole = [frame.rows().column("id").to_pylist() for frame, _ in frames]
                cut = int(stop * len(frames))
                cursor = frames[cut - 1][1] if cut else start_of(items)
                rest = read_frames(source, items, cursor, batch_size, "keep_partial")
                assert whole[:cut] + [frame.rows().column("id").to_pylist() for frame, _ in rest] == whole


@EXAMPLES
@given(
    sizes=split_sizes,
    seed=st.integers(0, 100),
    filtered=st.booleans(),
    backend=st.sampled_from(BACKENDS),
    world_size=st.integers(1, 3),
    batch_size=batch_sizes,
    stop=st.floats(0, 1),
)
def test_dataset_state_resumes_each_rank_exactly(
    sizes: list[int],
    seed: int,
    filtered: bool,
    backend: str,
    world_size: int,
    batch_size: int | None,
    stop: float,
) -> None:
    with table(sizes, seed, filtered, backend) as spec:
        delivered: list[int] = []
        for rank in range(world_size):
            options: dict[str, Any] = {"batch_size": batch_size, "rank": rank, "world_size": world_size}
            whole = [batch["id"].tolist() for batch in TableDataset(spec, **options)]
            cut = int(stop * len(whole))
            first = TableDataset(spec, **options)
            delivering = iter(first)
            before = [next(delivering)["id"].tolist() for _ in range(cut)]
            second = TableDataset(spec, **options)
            second.load_state_dict(first.state_dict())
            assert before + [batch["id"].tolist() for batch in second] == whole
            delivered += [row for batch in whole for row in batch]
        assert sorted(delivered) == expected(sizes, seed, filtered)


def ids(batches: list[dict[str, Any]]) -> list[list[int]]:
    return [batch["id"].tolist() for batch in batches]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("stop", [1, 7, 15])
def test_stateful_dataloader_resumes_exactly(
    make_table: Callable[..., TableSpec], workers: int, stop: int, backend: str
) -> None:
    """A StatefulDataLoader stopped after ``stop`` batches and restored in a new loader continues
    with exactly the batches an uninterrupted loader delivers, in the same order."""
    sizes = [9000, 300, 0, 12000, 4500, 7000]
    spec = make_table(sizes, seed=11, backend=backend, columns=["id", "x"], filter=KEEP_TEXT)

    made = itertools.count()

    def loader() -> StatefulDataLoader:
        # In one case the resumed loader (the third made) starts its worker by spawn, a fresh
        # interpreter (seconds of imports), from a state saved under a forkserver worker; the rest
        # fork theirs from the preloaded forkserver, which starts them in milliseconds.
        spawned = next(made) == 2 and (workers, stop, backend) == (1, 7, "spiral")
        context = None if not workers else "spawn" if spawned else "forkserver"
        dataset = TableDataset(spec, batch_size=500)
        return StatefulDataLoader(dataset, batch_size=None, num_workers=workers, multiprocessing_context=context)

    whole = ids(list(loader()))
    assert stop < len(whole), "the stop must fall inside the epoch"
    before, after = stopped_and_resumed(loader, stop)
    assert ids(before) + ids(after) == whole
    assert sorted(row for batch in whole for row in batch) == kept_ids(sizes, seed=11)


def with_pid(batch: pa.RecordBatch) -> dict[str, Any]:
    """``to_torch``'s batch and the process that read it."""
    return {**to_torch(batch), "pid": os.getpid()}


@pytest.mark.slow
def test_set_epoch_and_quota_reach_persistent_workers_without_restarting_them(
    make_table: Callable[..., TableSpec],
) -> None:
    spec = make_table([100, 60, 140, 100], columns=["id"])

    def loader(dataset: TableDataset, persistent: bool) -> StatefulDataLoader:
        return StatefulDataLoader(
            dataset, batch_size=None, num_workers=2, multiprocessing_context="forkserver", persistent_workers=persistent
        )

    def dataset(epoch: int, quota: int | None) -> TableDataset:
        made = TableDataset(spec, batch_size=30, policy=reversed_on_odd_epochs, collate=with_pid)
        made.set_epoch(epoch)
        made.set_rows_per_consumer(quota)
        return made

    def read(batches: Iterable[dict[str, Any]]) -> tuple[list[int], set[int]]:
        seen = list(batches)
        return [int(i) for batch in seen for i in batch["id"]], {batch["pid"] for batch in seen}

    persistent = dataset(0, None)
    kept = loader(persistent, persistent=True)
    rows, workers = {}, []
    for epoch, quota in [(0, None), (1, None), (2, 90), (3, None)]:
        persistent.set_epoch(epoch)
        persistent.set_rows_per_consumer(quota)
        rows[epoch], pids = read(kept)
        workers.append(pids)
    assert len(workers[0]) == 2 and all(pids == workers[0] for pids in workers)
    # Each epoch equals what freshly started workers read for it: the odd epochs' order, the quota.
    for epoch, quota in [(1, None), (2, 90)]:
        assert rows[epoch] == read(loader(dataset(epoch, quota), persistent=False))[0]
    assert sorted(rows[0]) == sorted(rows[1]) == sorted(rows[3]) == list(range(400))
    assert rows[1] != rows[0] and rows[3] == rows[1]
    assert len(rows[2]) == 180
