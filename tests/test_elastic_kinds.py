"""Elastic re-plans of the dataset kinds beyond plain ``TableDataset`` lists: window shuffles
saved inside a window, ``WindowDataset``, ``Mixture`` and ``access="map"``. Each continues a
saved epoch under other ranks or workers, and the row ids (or windows) delivered before and after
the stop are those of the epoch, each exactly once (a mixture: each pass of each table)."""

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
from hypothesis import HealthCheck, example, given
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from spiral_lightning import (
    Mixture,
    Policy,
    Shard,
    Shuffled,
    SpiralDataModule,
    TableDataset,
    TableSpec,
    WindowDataset,
    Windows,
    balanced,
    stripe,
)
from spiral_lightning.core.plan import fingerprint
from spiral_lightning.core.state import Cursor, State
from spiral_lightning.datasets.mixture import STOP_MODES, Stop
from spiral_lightning.datasets.windows import WindowPosition, read_windows
from spiral_lightning.lightning.loader import consumer_states
from spiral_lightning.planning.elastic_map import MapLineage, MapLink, ReplannedSampler
from spiral_lightning.planning.lineage import RowLineage
from spiral_lightning.planning.policies import policy_name, window_key
from spiral_lightning.reading.frames import cut, start_of
from spiral_lightning.reading.shuffle import shuffled_chunks
from tests.examples import examples
from tests.lightning_job import Recorder
from tests.tables import BACKENDS, KEEP_TEXT, kept_ids, write_layout, write_uneven
from tests.test_datamodule import checkpoints, ids_in, trainer
from tests.test_elastic_lightning import stopped_and_resumed
from tests.test_mixture import layouts as mixture_layouts
from tests.test_mixture import tables as mixture_tables
from tests.test_windows import episode_table, episodes, reference, split_sizes, window_ids, window_settings

EXAMPLES = examples(20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
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
        remainder=None if lineage is None else RowLineage.from_dict(lineage).digest,
    )
    return rows, state.to_dict()


@EXAMPLES
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_filtered_window_re_plans_inside_it_and_at_its_start(
    make_table: Callable[..., TableSpec], backend: str
) -> None:
    spec = make_table([500, 500], backend=backend, columns=["id"], filter=KEEP_TEXT)
    # 226 rows pass the filter: a window of 200, then one of 26.
    policy = Shuffled(block_rows=100, buffer_rows=200)
    whole = ids(list(TableDataset(spec, batch_size=30, policy=policy)))
    # Inside the first window, 60 of its rows delivered: the rest of it comes once after the re-plan.
    inside = TableDataset(spec, batch_size=30, policy=policy)
    reading = iter(inside)
    first = ids([next(reading) for _ in range(2)])
    rest = []
    for rank in range(2):
        resumed = TableDataset(spec, batch_size=30, policy=policy, rank=rank, world_size=2)
        resumed.load_elastic([inside.state_dict()])
        rest += ids(list(resumed))
    assert sorted(first + rest) == sorted(whole) and len(first) == 60
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
    assert sorted(first + rest) == sorted(whole)


@EXAMPLES
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
def test_a_map_run_resumes_under_another_worker_count_and_batch_size_and_again(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    spec = make_table(MAP_SIZES, columns=["id", "x"])
    every = list(range(sum(MAP_SIZES)))

    def data(workers: int, batch_size: int = 50) -> SpiralDataModule:
        return SpiralDataModule(spec, batch_size=batch_size, num_workers=workers, access="map", seed=7)

    # 20 batches of 50 an epoch: stop 7 batches in with 2 workers, then 5 batches of 30 more with
    # 3 workers, then the rest in batches of 50 again.
    first = Recorder()
    trainer(tmp_path / "a", max_epochs=2, max_steps=7, callbacks=[checkpoints(tmp_path / "a", 7)]).fit(
        first, datamodule=data(2)
    )
    second = Recorder()
    trainer(tmp_path / "b", max_epochs=2, max_steps=12, callbacks=[checkpoints(tmp_path / "b", 12)]).fit(
        second, datamodule=data(3, batch_size=30), ckpt_path=tmp_path / "a" / "step=7.ckpt"
    )
    # The second stop is inside the re-planned epoch: its lineage travels in the checkpoint.
    saved = torch.load(tmp_path / "b" / "step=12.ckpt", weights_only=True)["SpiralDataModule"]
    assert saved["lineage"]["links"][0]["delivered"] == [350]
    assert [len(ids) for _, _, ids in second.seen] == [30] * 5
    third = Recorder()
    trainer(tmp_path / "c", max_epochs=2).fit(third, datamodule=data(1), ckpt_path=tmp_path / "b" / "step=12.ckpt")
    before = ids_in(first.seen, 0) + ids_in(second.seen, 0)
    assert len(before) == 500 and len(set(before)) == 500
    assert sorted(before + ids_in(third.seen, 0)) == every
    # The epoch after it is the sampler's own again, under the new workers.
    assert sorted(ids_in(third.seen, 1)) == every


@pytest.mark.slow
def test_a_ddp_map_run_resumes_as_one_process(make_table: Callable[..., TableSpec], tmp_path: Path) -> None:
    spec = make_table(MAP_SIZES).resolve()
    # 1,000 rows on 2 ranks: 20 batches of 25 per rank. Stop after 9.
    before, after = stopped_and_resumed(tmp_path, spec.uri, 9, "--batch-size", "25", "--access", "map", "--seed", "7")
    assert len(before) == 2 * 9 * 25
    assert sorted(before + after) == list(range(sum(MAP_SIZES)))


def consume_windows(
    dataset: WindowDataset, shard: Shard, batches: int | None
) -> tuple[list[tuple[int, ...]], dict[str, Any]]:
    """The windows (as row ids) consumer ``shard`` of ``dataset`` delivers in its first
    ``batches`` batches (all when ``None``), read as ``WindowDataset`` reads them, and the state
    its worker would save after them."""
    items, leads = dataset.work(shard)
    position = WindowPosition(start_of(items), leads[0] if leads else 0)
    found: list[tuple[int, ...]] = []
    after: WindowPosition | None = None
    reading = read_windows(
        dataset.table.source(), items, position, dataset.windows, dataset.batch_size, dataset.last, leads
    )
    for count, (batch, after_batch) in enumerate(reading):
        if batches is not None and count == batches:
            break
        found += window_ids(batch, dataset.windows.size)
        after = after_batch
    lineage = dataset.lineage()
    table_state = State(
        dataset.table.spec.version,
        shard,
        dataset.batch_size,
        dataset.epoch,
        policy_name(dataset.table.policy),
        fingerprint(items),
        None if after is None else after.cursor,
        remainder=None if lineage is None else RowLineage.from_dict(lineage).digest,
    )
    state = {
        "format": 1,
        "table": table_state.to_dict(),
        "windows": dataset.windows.settings(),
        "lead": 0 if after is None else after.lead,
    }
    return found, state


@EXAMPLES
@given(
    sizes=split_sizes,
    seed=st.integers(0, 100),
    backend=st.sampled_from(BACKENDS),
    filtered=st.booleans(),
    windows=window_settings,
    policy=st.sampled_from([stripe, balanced]),
    hops=st.lists(st.tuples(st.sampled_from(SAVED), st.sampled_from(RESUMED)), min_size=1, max_size=1),
    batch_size=st.integers(1, 30),
    stops=st.lists(st.one_of(st.none(), st.integers(0, 6)), min_size=12, max_size=12),
)
def test_windows_re_plan_for_other_ranks_and_workers_every_window_exactly_once(
    sizes: list[int],
    seed: int,
    backend: str,
    filtered: bool,
    windows: Windows,
    policy: Policy,
    hops: list[tuple[tuple[int, int], tuple[int, int]]],
    batch_size: int,
    stops: list[int | None],
) -> None:
    (old, new), stop = hops[0], iter(stops)
    with episodes(sizes, seed, backend, filtered) as (spec, _):

        def dataset(rank: int, world_size: int) -> WindowDataset:
            made = WindowDataset(
                spec, windows=windows, batch_size=batch_size, policy=policy, rank=rank, world_size=world_size
            )
            made.set_epoch(1)
            return made

        # The windows of the saved topology's uninterrupted epoch: a balanced policy's cuts end runs.
        whole = [
            window
            for rank in range(old[0])
            for worker in range(old[1])
            for window in consume_windows(dataset(rank, old[0]), Shard(rank, old[0], worker, old[1]), None)[0]
        ]
        delivered: list[tuple[int, ...]] = []
        states: list[dict[str, Any]] = []
        lineage: dict[str, Any] | None = None
        # Saved under `old`, re-planned under `new` and stopped again, then re-planned under `old`.
        for hop, (world_size, workers) in enumerate((old, new, old)):
            saved: list[dict[str, Any]] = []
            for rank in range(world_size):
                reader = dataset(rank, world_size)
                if states:
                    reader.load_elastic(states, lineage=lineage)
                counted = reader.batches(workers)
                for worker in range(workers):
                    shard = Shard(rank, world_size, worker, workers)
                    found, state = consume_windows(reader, shard, None if hop == 2 else next(stop))
                    delivered += found
                    saved.append(state)
                    assert len(str(state)) < 1024
                    if hop == 2:
                        # The re-planned lists, leads included, counted ahead as they are read.
                        counted -= -(-len(found) // batch_size)
                assert hop < 2 or counted == 0
                next_lineage = reader.lineage()
            states, lineage = saved, next_lineage
        assert sorted(delivered) == sorted(whole)


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "workers", "batch_size"), [(1, 1, 7), (3, 1, 7), (1, 3, 4)])
def test_real_window_loaders_saved_as_2x2_resume_as_other_topologies_and_batch_sizes(
    tmp_path: Path, world_size: int, workers: int, batch_size: int
) -> None:
    sizes = [300, 170, 0, 410, 250]
    data = episode_table(sizes, seed=5)
    spec = replace(write_uneven(tmp_path / "t", data, sizes), columns=("id", "episode", "v"))
    windows = Windows(size=3, stride=5, group_by="episode")
    expected = sorted(reference(data, sizes, windows, filtered=False))

    def dataset(rank: int, world_size: int, batch_size: int = 7) -> WindowDataset:
        return WindowDataset(spec, windows=windows, batch_size=batch_size, rank=rank, world_size=world_size)

    delivered: list[tuple[int, ...]] = []
    states: list[dict[str, Any]] = []
    for rank, stop in ((0, 3), (1, 4)):
        saving = loader(dataset(rank, 2), 2)
        reading = iter(saving)
        for _ in range(stop):
            batch = next(reading)
            delivered += [tuple(row) for row in batch["id"].tolist()]
        states += consumer_states(saving.state_dict())
    assert any(state["lead"] for state in states)
    for rank in range(world_size):
        resumed = dataset(rank, world_size, batch_size)
        resumed.load_elastic(states)
        batches = list(loader(resumed, workers))
        assert all(len(batch["id"]) <= batch_size for batch in batches)
        delivered += [tuple(row) for batch in batches for row in batch["id"].tolist()]
    assert sorted(delivered) == expected


#: One delivered mixture batch: its table, the pass of that table it came from, and its row ids.
Mixed = tuple[int, int, list[int]]


def consume_mixture(mixture: Mixture, batches: int | None) -> tuple[list[Mixed], dict[str, Any]]:
    """The batches the mixture's consumer (its rank, no workers) delivers in its first
    ``batches`` batches (all when ``None``), each with its table's pass, and its state after them."""
    found: list[Mixed] = []
    reading = iter(mixture)
    while batches is None or len(found) < batches:
        batch = next(reading, None)
        if batch is None:
            break
        table = int(batch["table"])
        found.append((table, mixture.state_dict()["tables"][table]["passes"], batch["id"].tolist()))
    return found, mixture.state_dict()


def check_mixed(delivered: list[Mixed], expected: list[list[int]], stop: str) -> None:
    """Each table's rows of each pass at most once; under ``stop="cycle"`` pass 0 is every row of
    the table, and under ``"first_exhausted"`` no batch comes from a later pass."""
    rows: dict[tuple[int, int], list[int]] = {}
    for table, number, ids in delivered:
        rows.setdefault((table, number), []).extend(ids)
    for (table, number), ids in rows.items():
        assert len(ids) == len(set(ids)), f"a row of table {table}, pass {number} arrived twice"
        assert stop == "cycle" or number == 0
    if stop == "cycle":
        for table, every in enumerate(expected):
            assert sorted(rows.get((table, 0), [])) == every, f"pass 0 of table {table} is not every row once"


@EXAMPLES
@given(
    layout=mixture_layouts,
    stop=st.sampled_from(STOP_MODES),
    seed=st.integers(0, 100),
    batch_size=st.integers(4, 40),
    hops=st.sampled_from([((2, 1), (1, 1)), ((2, 1), (3, 1))]),
    stops=st.lists(st.one_of(st.none(), st.integers(0, 12)), min_size=6, max_size=6),
)
# A consumer re-planned into pass 0 of a table, re-planned again: pass 1 stays the earlier share.
@example(
    layout=[([0], "spiral", False, 1), ([0], "spiral", False, 1), ([2], "spiral", False, 1)],
    stop="cycle",
    seed=0,
    batch_size=4,
    hops=((2, 1), (1, 1)),
    stops=[None, 0, 0, None, None, None],
)
def test_mixtures_re_plan_for_other_ranks_each_pass_exactly_once(
    layout: list[tuple[list[int], str, bool, int]],
    stop: Stop,
    seed: int,
    batch_size: int,
    hops: tuple[tuple[int, int], tuple[int, int]],
    stops: list[int | None],
) -> None:
    old, new = hops
    halt = iter(stops)
    with mixture_tables(layout) as pairs:
        expected = [
            kept_ids(sizes, index) if filtered else list(range(sum(sizes)))
            for index, (sizes, _, filtered, _) in enumerate(layout)
        ]

        def mixture(rank: int, world_size: int) -> Mixture:
            made = Mixture(
                pairs,
                batch_size=batch_size,
                seed=seed,
                columns=["id"],
                stop=stop,
                rank=rank,
                world_size=world_size,
                table_key="table",
            )
            made.set_epoch(1)
            return made

        delivered: list[Mixed] = []
        states: list[dict[str, Any]] = []
        lineage: dict[str, Any] | None = None
        # Saved under `old`, re-planned under `new` and stopped again, then re-planned under `old`.
        for hop, (world_size, _) in enumerate((old, new, old)):
            saved: list[dict[str, Any]] = []
            readers = [mixture(rank, world_size) for rank in range(world_size)]
            for reader in readers:
                if states:
                    reader.load_elastic(states, lineage=lineage)
            for reader in readers:
                found, state = consume_mixture(reader, None if hop == 2 else next(halt))
                delivered += found
                saved.append(state)
                # A mixture's state holds one table state per table; a re-plan adds only digests.
                assert len(str(state)) < 1024 * len(layout)
            states, lineage = saved, readers[0].lineage()
        check_mixed(delivered, expected, stop)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stop", "workers", "batch_size"), [("cycle", 3, 50), ("first_exhausted", 3, 80), ("cycle", 1, 50)]
)
def test_real_mixture_loaders_saved_with_2_workers_resume_with_other_workers_and_batch_sizes(
    make_table: Callable[..., TableSpec], stop: Stop, workers: int, batch_size: int
) -> None:
    sizes = [[900, 600, 700], [300, 200]]
    pairs = [(make_table(sizes[0], seed=4), 3.0), (make_table(sizes[1], seed=2, backend="parquet"), 1.0)]

    def dataset(batch_size: int = 50) -> Mixture:
        return Mixture(pairs, batch_size=batch_size, seed=7, columns=["id"], stop=stop, table_key="table")

    delivered: list[tuple[int, list[int]]] = []
    saving = loader(dataset(), 2)
    reading = iter(saving)
    # Early enough that both workers are in the first pass of every table.
    delivered += [(int(batch["table"]), batch["id"].tolist()) for batch in (next(reading) for _ in range(9))]
    states = consumer_states(saving.state_dict())
    resumed = dataset(batch_size)
    resumed.load_elastic(states)
    delivered += [(int(batch["table"]), batch["id"].tolist()) for batch in loader(resumed, workers)]
    assert max(len(rows) for _, rows in delivered[9:]) == batch_size
    for table, table_sizes in enumerate(sizes):
        ids = [row for index, rows in delivered if index == table for row in rows]
        if stop == "cycle":
            # Pass 0 whole; the passes after it may repeat rows of it.
            assert set(ids) == set(range(sum(table_sizes)))
        else:
            assert len(ids) == len(set(ids))


def test_windows_and_mixtures_name_load_elastic_for_another_topology(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([500, 500], columns=["id"])
    saving = WindowDataset(spec, windows=Windows(size=4, stride=2), batch_size=10, rank=0, world_size=2)
    next(iter(saving))
    with pytest.raises(ValueError, match=r"saved by a consumer of 2 ranks x 1 workers.*WindowDataset\.load_elastic"):
        WindowDataset(spec, windows=Windows(size=4, stride=2), batch_size=10).load_state_dict(saving.state_dict())
    with pytest.raises(ValueError, match=r"windows: saved \[4, 2, None\], now \[4, 1, None\]"):
        WindowDataset(spec, windows=Windows(size=4), batch_size=10).load_elastic([saving.state_dict()])
    mixing = Mixture([(spec, 1.0)], batch_size=10, rank=0, world_size=2)
    next(iter(mixing))
    with pytest.raises(ValueError, match=r"Mixture\.load_elastic"):
        Mixture([(spec, 1.0)], batch_size=10, rank=1, world_size=3).load_state_dict(mixing.state_dict())
    with pytest.raises(ValueError, match=r"each of the 2 consumers of the saved 2 ranks x 1 workers once"):
        Mixture([(spec, 1.0)], batch_size=10).load_elastic([mixing.state_dict()])


def test_mixture_consumers_in_different_passes_re_plan_each_pass_once(make_table: Callable[..., TableSpec]) -> None:
    # Rank 0 reads the 8-row split and cycles it; rank 1 is still in the first pass of its 400 rows.
    pairs = [(make_table([400, 400], seed=4), 1.0), (make_table([8, 400], seed=2), 1.0)]

    def mixture(rank: int, world_size: int) -> Mixture:
        return Mixture(
            pairs,
            batch_size=4,
            seed=7,
            columns=["id"],
            stop="cycle",
            policy="stripe",
            rank=rank,
            world_size=world_size,
            table_key="table",
        )

    states, delivered = [], []
    for rank in range(2):
        found, state = consume_mixture(mixture(rank, 2), 20)
        delivered += found
        states.append(state)
    assert [state["tables"][1]["passes"] for state in states] == [4, 0]
    # One rank re-plans table 1's passes 0 to 4: rank 1's rest of pass 0, then what rank 0 left of
    # pass 4 and the whole of passes 1-3 for rank 1's share; each pass's rows at most once.
    resumed = mixture(0, 1)
    resumed.load_elastic(states)
    lineage = resumed.lineage()
    assert lineage is not None and [len(table) for table in lineage["later"]] == [0, 4]
    before, state = consume_mixture(resumed, 30)
    # The re-planned epoch stops and resumes again under the same layout, from its lineage.
    again = mixture(0, 1)
    again.load_lineage(lineage)
    again.load_state_dict(state)
    after, _ = consume_mixture(again, None)
    whole = mixture(0, 1)
    whole.load_elastic(states)
    assert before + after == consume_mixture(whole, None)[0]
    sizes = [800, 408]
    check_mixed(delivered + before + after, [list(range(size)) for size in sizes], "cycle")


def test_a_mixture_saved_after_its_last_batch_resumes_ended(make_table: Callable[..., TableSpec]) -> None:
    pairs = [(make_table([50, 30]), 1.0), (make_table([20], backend="parquet"), 1.0)]
    for stop in STOP_MODES:
        finished = Mixture(pairs, batch_size=8, columns=["id"], stop=stop)
        assert list(finished)
        resumed = Mixture(pairs, batch_size=8, columns=["id"], stop=stop)
        resumed.load_state_dict(finished.state_dict())
        assert list(resumed) == []


@pytest.mark.parametrize("kind", ["table", "windows"])
def test_a_state_saved_right_after_a_re_plan_starts_the_remainder(
    make_table: Callable[..., TableSpec], kind: str
) -> None:
    spec = make_table([500, 500], columns=["id"])

    def dataset(rank: int, world_size: int) -> TableDataset | WindowDataset:
        if kind == "table":
            return TableDataset(spec, batch_size=10, rank=rank, world_size=world_size)
        return WindowDataset(spec, windows=Windows(size=4, stride=4), batch_size=10, rank=rank, world_size=world_size)

    def ids(batches: Any) -> list[int]:
        return [int(i) for batch in batches for i in batch["id"].flatten().tolist()]

    saving = dataset(0, 1)
    read = iter(saving)
    before = ids(next(read) for _ in range(7))
    states = [saving.state_dict()]
    # This dataset read a whole pass before the re-plan: its position then must not leak into the re-planned epoch.
    replanned = [dataset(rank, 2) for rank in range(2)]
    after: list[int] = []
    for rank, resumed in enumerate(replanned):
        ids(resumed)
        resumed.load_elastic(states)
        again = dataset(rank, 2)
        again.load_elastic(states)
        again.load_state_dict(resumed.state_dict())
        after += ids(again)
    assert sorted(set(before + after)) == sorted(ids(dataset(0, 1))) and len(before + after) == len(set(before + after))
