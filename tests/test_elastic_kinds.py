"""Elastic re-plans of the dataset kinds beyond plain ``TableDataset`` lists: window shuffles
saved inside a window, ``WindowDataset``, ``Mixture`` and ``access="map"``. Each continues a
saved epoch under other ranks or workers, and the row ids (or windows) delivered before and after
the stop are those of the epoch, each exactly once."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from spiral_lightning import (
    Mixture,
    Shard,
    Shuffled,
    SpiralDataModule,
    TableDataset,
    TableSpec,
    WindowDataset,
    Windows,
)
from spiral_lightning.elastic import Lineage
from spiral_lightning.elastic_map import MapLineage, MapLink, ReplannedSampler
from spiral_lightning.frames import cut, start_of
from spiral_lightning.loader import consumer_states
from spiral_lightning.shuffle import shuffled_chunks, window_key
from spiral_lightning.state import Cursor, State
from spiral_lightning.work import fingerprint, policy_name
from tests.lightning_job import Recorder
from tests.tables import KEEP_TEXT, write_layout
from tests.test_datamodule import checkpoints, ids_in, trainer
from tests.test_elastic_lightning import run

examples = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
#: Saved and resumed topologies as (ranks, workers): 2 -> 1 and 2 -> 3 ranks, 2 -> 3 workers.
SAVED = [(2, 1), (2, 2), (1, 2)]
RESUMED = [(1, 1), (3, 1), (1, 3), (2, 3)]
MAP_SIZES = [300, 40, 500, 160]


@contextmanager
def table(sizes: list[int], seed: int, filtered: bool = False) -> Iterator[TableSpec]:
    root = Path(tempfile.mkdtemp(prefix="elastic-kinds-"))
    try:
        spec = write_layout(root / "t", sizes, seed, "spiral")
        yield replace(spec, columns=("id",), filter=KEEP_TEXT if filtered else None)
    finally:
        shutil.rmtree(root)


def consume_shuffled(dataset: TableDataset, shard: Shard, frames: int | None) -> tuple[list[int], dict[str, Any]]:
    """The ids consumer ``shard`` of a window-shuffling ``dataset`` delivers in its first
    ``frames`` frames (all when ``None``), read as ``TableDataset`` reads them, and the state its
    worker would save after them."""
    policy = dataset.policy
    assert isinstance(policy, Shuffled)
    items = dataset.work(shard)
    key = window_key(policy.seed, dataset.epoch, shard)
    chunks = shuffled_chunks(dataset.source(), items, start_of(items), policy.buffer_rows, key)
    rows: list[int] = []
    cursor: Cursor | None = None
    for count, (frame, after) in enumerate(cut(chunks, dataset.batch_size, "keep_partial", Cursor(len(items), 0))):
        if frames is not None and count == frames:
            break
        rows += frame.rows().column("id").to_pylist()
        cursor = after
    lineage = dataset.lineage()
    state = State(
        dataset.spec.version,
        shard,
        dataset.batch_size,
        dataset.epoch,
        policy_name(policy),
        fingerprint(items),
        cursor,
        remainder=None if lineage is None else Lineage.from_dict(lineage).digest,
    )
    return rows, state.to_dict()


@examples
@given(
    sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=4),
    seed=st.integers(0, 50),
    block_rows=st.integers(1, 2000),
    buffer_rows=st.sampled_from([1, 7, 300, 2500]),
    hops=st.lists(st.tuples(st.sampled_from(SAVED), st.sampled_from(RESUMED)), min_size=1, max_size=1),
    batch_size=st.integers(1, 700),
    stops=st.lists(st.one_of(st.none(), st.integers(0, 5)), min_size=12, max_size=12),
)
def test_window_shuffles_saved_inside_a_window_re_plan_exactly_once(
    sizes: list[int],
    seed: int,
    block_rows: int,
    buffer_rows: int,
    hops: list[tuple[tuple[int, int], tuple[int, int]]],
    batch_size: int,
    stops: list[int | None],
) -> None:
    (old, new), stop = hops[0], iter(stops)
    policy = Shuffled(seed=seed, block_rows=block_rows, buffer_rows=buffer_rows)
    with table(sizes, seed) as spec:
        delivered: list[int] = []
        states: list[dict[str, Any]] = []
        lineage: dict[str, Any] | None = None
        # Saved under `old`, re-planned under `new` and stopped again, then re-planned under `old`.
        for hop, (world_size, workers) in enumerate((old, new, old)):
            saved: list[dict[str, Any]] = []
            for rank in range(world_size):
                dataset = TableDataset(spec, batch_size=batch_size, policy=policy, rank=rank, world_size=world_size)
                dataset.set_epoch(2)
                if states:
                    dataset.load_elastic(states, lineage=lineage)
                for worker in range(workers):
                    shard = Shard(rank, world_size, worker, workers)
                    rows, state = consume_shuffled(dataset, shard, None if hop == 2 else next(stop))
                    delivered += rows
                    saved.append(state)
                    assert len(str(state)) < 1024
                next_lineage = dataset.lineage()
            states, lineage = saved, next_lineage
        assert sorted(delivered) == list(range(sum(sizes)))


def ids(batches: list[dict[str, Any]]) -> list[int]:
    return [row for batch in batches for row in batch["id"].tolist()]


def loader(dataset: Any, workers: int) -> StatefulDataLoader:
    context = "forkserver" if workers else None
    return StatefulDataLoader(dataset, batch_size=None, num_workers=workers, multiprocessing_context=context)


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "workers"), [(3, 1), (1, 3)])
def test_real_window_shuffling_loaders_saved_as_2x2_resume_as_other_topologies(
    make_table: Callable[..., TableSpec], world_size: int, workers: int
) -> None:
    sizes = [3000, 700, 0, 4100, 2500]
    spec = make_table(sizes, seed=9, columns=["id"])
    policy = Shuffled(seed=3, block_rows=900, buffer_rows=1000)
    delivered: list[int] = []
    states: list[dict[str, Any]] = []
    # Batches of 300 in windows of 1,000: every state below is inside a window.
    for rank, stop in ((0, 5), (1, 7)):
        saving = loader(TableDataset(spec, batch_size=300, policy=policy, rank=rank, world_size=2), 2)
        reading = iter(saving)
        delivered += ids([next(reading) for _ in range(stop)])
        states += consumer_states(saving.state_dict())
    assert any(state["cursor"][4] for state in states)
    for rank in range(world_size):
        dataset = TableDataset(spec, batch_size=300, policy=policy, rank=rank, world_size=world_size)
        dataset.load_elastic(states)
        delivered += ids(list(loader(dataset, workers)))
    assert sorted(delivered) == list(range(sum(sizes)))


def test_a_filtered_window_saved_inside_refuses_and_a_window_start_re_plans(
    make_table: Callable[..., TableSpec],
) -> None:
    spec = make_table([500, 500], columns=["id"], filter=KEEP_TEXT)
    # 226 rows pass the filter: a window of 200, then one of 26.
    policy = Shuffled(block_rows=100, buffer_rows=200)
    inside = TableDataset(spec, batch_size=100, policy=policy)
    next(iter(inside))
    with pytest.raises(ValueError, match=r"inside shuffle window 0 of a filtered table, 100 of its rows delivered"):
        TableDataset(spec, batch_size=100, policy=policy, rank=0, world_size=2).load_elastic([inside.state_dict()])
    # Two batches of 100 fill the first window: the state is at the second window's start.
    at_start = TableDataset(spec, batch_size=100, policy=policy)
    reading = iter(at_start)
    first = ids([next(reading) for _ in range(2)])
    state = at_start.state_dict()
    assert state["cursor"][3:] == [1, 0]
    rest = []
    for rank in range(2):
        resumed = TableDataset(spec, batch_size=100, policy=policy, rank=rank, world_size=2)
        resumed.load_elastic([state])
        rest += ids(list(resumed))
    whole = ids(list(TableDataset(spec, batch_size=100, policy=policy)))
    assert sorted(first + rest) == sorted(whole)


@examples
@given(
    rows=st.integers(0, 400),
    seed=st.integers(0, 9),
    epoch=st.integers(0, 3),
    world_sizes=st.sampled_from([(2, 1, 2), (2, 3, 1), (2, 3, 2), (1, 3, 2)]),
    batch_size=st.integers(1, 60),
    stops=st.lists(st.integers(0, 8), min_size=6, max_size=6),
)
def test_a_map_epoch_re_plans_for_other_ranks_exactly_once(
    rows: int, seed: int, epoch: int, world_sizes: tuple[int, int, int], batch_size: int, stops: list[int]
) -> None:
    table = range(rows)
    # Saved by ranks of torchdata's own sampler, as access="map" reads them.
    first = world_sizes[0]
    samplers = [ReplannedSampler(table, world_size=first, rank=rank, seed=seed) for rank in range(first)]
    left_out = rows - len(samplers[0]) * first
    delivered: list[int] = []
    lineage = MapLineage(rows, seed, epoch)
    batches = 0
    stop = iter(stops)
    for hop in range(len(world_sizes)):
        last = hop == len(world_sizes) - 1
        # Ranks of DDP step together: each delivers the same number of batches.
        step = next(stop)
        done = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            order = list(sampler)
            plain = StatefulDistributedSampler(table, first, sampler.rank, True, seed, first > 1) if not hop else None
            if plain is not None:
                plain.set_epoch(epoch)
                assert order == list(plain)
            taken = order if last else order[: step * batch_size]
            delivered += taken
            done.append(len(taken))
        if last:
            break
        lineage = lineage.then(MapLink(len(samplers), tuple(done)), batches + step)
        batches += step
        following = world_sizes[hop + 1]
        samplers = [ReplannedSampler(table, world_size=following, rank=rank, seed=seed) for rank in range(following)]
        # Every rank leaves out the same rows of the remainder; count them once.
        (dropped,) = {sampler.replan(MapLineage.from_dict(lineage.to_dict())) for sampler in samplers}
        left_out += dropped
    # Rows are left out only to keep ranks equal: fewer than one per rank at each (re-)plan.
    assert len(delivered) == len(set(delivered)) == rows - left_out
    assert left_out < sum(world_sizes)


@pytest.mark.slow
def test_a_map_run_resumes_under_another_worker_count_and_again(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    spec = make_table(MAP_SIZES, columns=["id", "x"])
    every = list(range(sum(MAP_SIZES)))

    def data(workers: int) -> SpiralDataModule:
        return SpiralDataModule(spec, batch_size=50, num_workers=workers, access="map", seed=7)

    # 20 batches of 50 an epoch: stop 7 batches in with 2 workers, then 5 more with 3 workers.
    first = Recorder()
    trainer(tmp_path / "a", max_epochs=2, max_steps=7, callbacks=[checkpoints(tmp_path / "a", 7)]).fit(
        first, datamodule=data(2)
    )
    second = Recorder()
    trainer(tmp_path / "b", max_epochs=2, max_steps=12, callbacks=[checkpoints(tmp_path / "b", 12)]).fit(
        second, datamodule=data(3), ckpt_path=tmp_path / "a" / "step=7.ckpt"
    )
    # The second stop is inside the re-planned epoch: its lineage travels in the checkpoint.
    saved = torch.load(tmp_path / "b" / "step=12.ckpt", weights_only=True)["SpiralDataModule"]
    assert saved["lineage"]["links"][0]["delivered"] == [350]
    third = Recorder()
    trainer(tmp_path / "c", max_epochs=2).fit(third, datamodule=data(1), ckpt_path=tmp_path / "b" / "step=12.ckpt")
    before = ids_in(first.seen, 0) + ids_in(second.seen, 0)
    assert len(before) == 600 and len(set(before)) == 600
    assert sorted(before + ids_in(third.seen, 0)) == every
    # The epoch after it is the sampler's own again, under the new workers.
    assert sorted(ids_in(third.seen, 1)) == every


@pytest.mark.slow
def test_a_ddp_map_run_resumes_as_one_process(make_table: Callable[..., TableSpec], tmp_path: Path) -> None:
    spec = make_table(MAP_SIZES).resolve()
    options = ["--batch-size", "25", "--access", "map", "--seed", "7"]
    # 1,000 rows on 2 ranks: 20 batches of 25 per rank. Stop after 9.
    first = run(tmp_path, "first", spec.uri, 2, *options, "--max-steps", "9", "--checkpoint-every", "9")
    assert [len(record["seen"]) for record in first] == [9, 9]
    ckpt = str(tmp_path / "checkpoints" / "step=9.ckpt")
    (resumed,) = run(tmp_path, "resumed", spec.uri, 1, *options, "--workers", "0", "--ckpt-path", ckpt)
    before = [row for record in first for _, _, ids in record["seen"] for row in ids]
    after = [row for _, _, ids in resumed["seen"] for row in ids]
    assert len(before) == 2 * 9 * 25
    assert sorted(before + after) == list(range(sum(MAP_SIZES)))


def test_windows_and_mixtures_refuse_another_topology_and_say_what_to_do(
    make_table: Callable[..., TableSpec],
) -> None:
    spec = make_table([500, 500], columns=["id"])
    saving = WindowDataset(spec, windows=Windows(size=4, stride=2), batch_size=10, rank=0, world_size=2)
    next(iter(saving))
    with pytest.raises(ValueError, match=r"saved by a consumer of 2 ranks x 1 workers.*resume under the saved ranks"):
        WindowDataset(spec, windows=Windows(size=4, stride=2), batch_size=10).load_state_dict(saving.state_dict())
    mixing = Mixture([(spec, 1.0)], batch_size=10, rank=0, world_size=2)
    next(iter(mixing))
    with pytest.raises(ValueError, match=r"Mixture does not re-plan an epoch for other ranks or workers"):
        Mixture([(spec, 1.0)], batch_size=10, rank=1, world_size=3).load_state_dict(mixing.state_dict())
