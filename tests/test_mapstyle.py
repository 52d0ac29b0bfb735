"""TableMapDataset on both backends: index to row against a full scan, batched reads equal to
single ones in request order, filters (with splits the filter prunes), errors, writable rows,
DataLoader workers, DistributedSampler over two DDP processes, and Grain."""

from __future__ import annotations

import json
import pickle
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import grain
import numpy as np
import pyarrow as pa
import pytest
import torch
from grain._src.python.dataset.base import SupportsBatchedReadRandomAccessDataSource
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from torch.utils.data import DataLoader, RandomSampler

from spiral_lightning import TableMapDataset, TableSpec, WorkItem
from spiral_lightning.sources import Take, open_source
from tests import map_ddp_job
from tests.examples import examples
from tests.ranks import rank_jobs
from tests.tables import BACKENDS, KEEP_TEXT, kept_ids, write_layout

ROOT = Path(__file__).resolve().parent.parent
SIZES = [30, 0, 50, 20, 40, 10]
#: With this seed the filter keeps 82 rows: it keeps part of splits 0, 1 and 4, all of split 3
#: and none of split 2 (so a filtered Spiral scan prunes it and renumbers the splits after it).
SEED = 2
ALL = list(range(sum(SIZES)))
KEPT = kept_ids(SIZES, SEED)
MakeTable = Callable[..., TableSpec]


def scanned(spec: TableSpec) -> pa.Table:
    """Every row the spec's scan returns, in stored order: what the indices must number."""
    source = open_source(spec.resolve())
    items = [WorkItem(split.id, split.start, split.end) for split in source.splits]
    return pa.Table.from_batches([batch for batch, _, _ in source.read(items)], schema=source.schema)


def doubled(row: dict[str, Any]) -> dict[str, Any]:
    """A transform that modifies the row's tensors in place."""
    row["v"].mul_(2)
    row["x"] += 1
    return row


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("condition", [None, KEEP_TEXT])
def test_index_is_row_of_a_full_scan(make_table: MakeTable, backend: str, condition: str | None) -> None:
    spec = make_table(SIZES, SEED, backend, filter=condition)
    dataset = TableMapDataset(spec)
    full = scanned(spec)
    expected = KEPT if condition else ALL
    assert len(dataset) == len(expected) == full.num_rows
    rows = [dataset[index] for index in range(len(dataset))]
    assert [int(row["id"]) for row in rows] == expected
    columns = [full.column(name).to_pylist() for name in ("score", "x", "v")]
    for row, score, x, v in zip(rows, *columns, strict=True):
        assert int(row["score"]) == score and float(row["x"]) == x and row["v"].tolist() == v
        assert row["v"].shape == (4,) and row["id"].shape == ()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("condition", [None, KEEP_TEXT])
def test_getitems_returns_single_rows_in_request_order(
    make_table: MakeTable, backend: str, condition: str | None
) -> None:
    dataset = TableMapDataset(make_table(SIZES, SEED, backend, filter=condition))
    expected = KEPT if condition else ALL
    last = len(dataset) - 1
    # Splits out of order, a repeat next to itself and far from itself, both ends.
    indices = [last, 5, 5, 0, last - 3, 40, 5, *np.random.default_rng(0).integers(0, last + 1, 30).tolist()]
    batch = dataset.__getitems__(indices)
    assert [int(row["id"]) for row in batch] == [expected[index] for index in indices]
    for together, alone in zip(batch, (dataset[index] for index in indices), strict=True):
        assert together.keys() == alone.keys()
        assert all(torch.equal(together[name], alone[name]) for name in together)
    assert [int(row["id"]) for row in dataset._getitems(indices)] == [expected[index] for index in indices]
    assert dataset.__getitems__([]) == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("condition", [None, KEEP_TEXT])
def test_read_threads_return_the_rows_of_one_thread(make_table: MakeTable, backend: str, condition: str | None) -> None:
    spec = make_table(SIZES, SEED, backend, filter=condition)
    expected = KEPT if condition else ALL
    indices = [*np.random.default_rng(3).integers(0, len(expected), 60).tolist(), 0, len(expected) - 1, 0]
    rows = {threads: TableMapDataset(spec, read_threads=threads).__getitems__(indices) for threads in (1, 2, 3, 5)}
    for threads, batch in rows.items():
        assert [int(row["id"]) for row in batch] == [expected[index] for index in indices], threads
        for row, alone in zip(batch, rows[1], strict=True):
            assert all(torch.equal(row[name], alone[name]) for name in ("id", "x", "v")), threads
    # One dataset whose thread count changes between calls reads through new threads.
    changed = TableMapDataset(spec, read_threads=2)
    for threads in (2, 3, 1):
        changed.read_threads = threads
        assert [int(row["id"]) for row in changed.__getitems__(indices)] == [expected[index] for index in indices]
    with pytest.raises(ValueError, match="read_threads must be a positive int or None"):
        TableMapDataset(spec, read_threads=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_are_writable_and_their_own(make_table: MakeTable, backend: str) -> None:
    dataset = TableMapDataset(make_table(SIZES, SEED, backend))
    first, again, other = dataset.__getitems__([7, 7, 8])
    first["v"].add_(100)
    assert again["v"].tolist() == [28.0, 29.0, 30.0, 31.0]
    assert other["v"].tolist() == [32.0, 33.0, 34.0, 35.0]
    assert dataset[7]["v"].tolist() == [28.0, 29.0, 30.0, 31.0]
    transformed = TableMapDataset(dataset.spec, transform=doubled)
    assert [row["v"].tolist() for row in transformed.__getitems__([7, 7])] == [[56.0, 58.0, 60.0, 62.0]] * 2
    assert float(transformed[7]["x"]) == 4.5
    assert dataset[7]["v"].tolist() == [28.0, 29.0, 30.0, 31.0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_indices_outside_the_rows_raise_naming_the_length(make_table: MakeTable, backend: str) -> None:
    dataset = TableMapDataset(make_table(SIZES, SEED, backend, filter=KEEP_TEXT))
    for bad in (-1, 82, 10_000):
        with pytest.raises(IndexError, match=rf"index {bad} is out of range .* of 82 rows"):
            dataset[bad]
    with pytest.raises(IndexError, match=r"index 82 is out of range .* of 82 rows"):
        dataset.__getitems__([0, 3, 82, 4])
    with pytest.raises(TypeError):
        dataset[1.5]  # type: ignore[index]
    empty = TableMapDataset(replace(dataset.spec, filter="score > 1000"))
    assert len(empty) == 0
    with pytest.raises(IndexError, match="of 0 rows"):
        empty[0]


@examples(60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(0, 20_000), min_size=1, max_size=5),
    seed=st.integers(0, 50),
    filtered=st.booleans(),
    backend=st.sampled_from(BACKENDS),
    read_threads=st.integers(1, 3),
    draws=st.lists(st.floats(0, 1, exclude_max=True), max_size=300),
)
def test_any_indices_give_their_rows_in_request_order(
    sizes: list[int], seed: int, filtered: bool, backend: str, read_threads: int, draws: list[float]
) -> None:
    root = Path(tempfile.mkdtemp(prefix="mapstyle-"))
    try:
        spec = replace(write_layout(root / "t", sizes, seed, backend), filter=KEEP_TEXT if filtered else None)
        dataset = TableMapDataset(spec, read_threads=read_threads)
        expected = kept_ids(sizes, seed) if filtered else list(range(sum(sizes)))
        assert len(dataset) == len(expected)
        # Fractions of the length: indices anywhere in the rows, repeats and any order included.
        indices = [int(draw * len(expected)) for draw in draws] if expected else []
        rows = dataset.__getitems__(indices)
        ids = [expected[index] for index in indices]
        assert [int(row["id"]) for row in rows] == ids
        # layout_table derives every column from the id, so each row's values are known.
        assert [float(row["x"]) for row in rows] == [row_id / 2 for row_id in ids]
        assert [row["v"].tolist() for row in rows] == [[4.0 * row_id + k for k in range(4)] for row_id in ids]
        with pytest.raises(IndexError, match=f"of {len(expected)} rows"):
            dataset.__getitems__([*indices, len(expected)])
    finally:
        shutil.rmtree(root)


def test_filtered_spiral_take_matches_each_split_read(make_table: MakeTable) -> None:
    source = open_source(make_table(SIZES, SEED, "spiral", filter=KEEP_TEXT))
    # The filter pruned the split it keeps nothing of, so the filtered scan has fewer splits.
    assert len(source.splits) == 4
    takes, expected = [], []
    for split in source.splits:
        read = pa.Table.from_batches([b for b, _, _ in source.read([WorkItem(split.id, split.start, split.end)])])
        ids = read.column("id").to_pylist()
        positions = [len(ids) - 1, 0, 0, *range(0, len(ids), 3)]
        taken = source.take([Take(split.id, positions)])
        assert taken.column("id").to_pylist() == [ids[p] for p in positions]
        assert taken.column("v").to_pylist() == [read.column("v")[p].as_py() for p in positions]
        with pytest.raises(IndexError, match=f"keeps {len(ids)} rows"):
            source.take([Take(split.id, [len(ids)])])
        takes.insert(0, Take(split.id, positions[::-1]))
        expected[:0] = [ids[p] for p in positions[::-1]]
    # One call over every split, last split first, reads the same rows in request order.
    assert source.take(takes).column("id").to_pylist() == expected


def test_pickling_keeps_the_spec_and_reopens(make_table: MakeTable) -> None:
    dataset = TableMapDataset(make_table(SIZES, SEED, "spiral", filter=KEEP_TEXT))
    assert len(dataset) == 82
    copy = pickle.loads(pickle.dumps(dataset))
    assert not hasattr(copy._opened, "source") and copy._pool is None and copy.spec == dataset.spec
    assert [int(row["id"]) for row in copy.__getitems__([81, 0])] == [KEPT[81], KEPT[0]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_reads_from_many_threads_at_once_give_the_right_rows(make_table: MakeTable, backend: str) -> None:
    # Grain's thread pool calls __getitem__ concurrently; a reader shared between threads once
    # failed here with "ReadRangeCache did not find matching cache entry" on Parquet.
    dataset = TableMapDataset(make_table(SIZES, SEED, backend, filter=KEEP_TEXT))
    indices = [index for _ in range(6) for index in range(len(dataset))]
    with ThreadPoolExecutor(max_workers=8) as pool:
        single = list(pool.map(lambda index: int(dataset[index]["id"]), indices))
        batched = list(pool.map(lambda index: [int(row["id"]) for row in dataset.__getitems__([index, 0])], indices))
    assert single == [KEPT[index] for index in indices]
    assert batched == [[KEPT[index], KEPT[0]] for index in indices]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "context"), [("spiral", "forkserver"), ("parquet", "forkserver"), ("spiral", "spawn")]
)
def test_shuffled_dataloader_with_workers_reads_the_sampler_order(
    make_table: MakeTable, backend: str, context: str
) -> None:
    dataset = TableMapDataset(make_table(SIZES, SEED, backend, filter=KEEP_TEXT))
    # The parent reads first, so each worker must open its own source after the PID change. A
    # spawned worker is a fresh interpreter (seconds of imports): one is enough to show it.
    assert int(dataset[0]["id"]) == KEPT[0]
    workers = 1 if context == "spawn" else 2
    loader = DataLoader(
        dataset,
        batch_size=8,
        sampler=RandomSampler(dataset, generator=torch.Generator().manual_seed(3)),
        num_workers=workers,
        multiprocessing_context=context,
    )
    batches = list(loader)
    order = list(RandomSampler(dataset, generator=torch.Generator().manual_seed(3)))
    assert [i for batch in batches for i in batch["id"].tolist()] == [KEPT[index] for index in order]
    assert batches[0]["v"].shape == (8, 4) and batches[-1]["id"].shape == (82 % 8,)
    shuffled = DataLoader(dataset, batch_size=8, shuffle=True, num_workers=workers, multiprocessing_context=context)
    assert sorted(i for batch in shuffled for i in batch["id"].tolist()) == KEPT


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_distributed_sampler_over_two_ranks_covers_each_row_once(
    make_table: MakeTable, backend: str, tmp_path: Path
) -> None:
    spec = make_table(SIZES, SEED, backend)
    # 82 kept rows split evenly, so DistributedSampler pads no rank with repeated rows.
    assert len(KEPT) % 2 == 0
    rank_jobs(map_ddp_job.main, ["--uri", spec.uri, "--filter", KEEP_TEXT, "--out", str(tmp_path)], 2, tmp_path)
    epochs = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    orders = []
    for epoch in range(2):
        per_rank = [[i for batch in epochs[rank][epoch] for i in batch] for rank in range(2)]
        assert [len(ids) for ids in per_rank] == [41, 41]
        assert sorted(per_rank[0] + per_rank[1]) == KEPT
        orders.append(per_rank[0])
    assert orders[0] != orders[1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_grain_reads_through_getitems(make_table: MakeTable, backend: str) -> None:
    dataset = TableMapDataset(make_table(SIZES, SEED, backend, filter=KEEP_TEXT))
    # Grain reads a batch of indices with one _getitems call only from sources of this protocol.
    assert isinstance(dataset, SupportsBatchedReadRandomAccessDataSource)
    source = grain.MapDataset.source(dataset)
    indices = [81, 3, 3, 40]
    assert [int(row["id"]) for row in source._getitems(indices)] == [KEPT[index] for index in indices]
    shuffled = [int(row["id"]) for row in source.shuffle(seed=5)]
    assert sorted(shuffled) == KEPT and shuffled != KEPT
    loader = grain.DataLoader(
        data_source=dataset,
        sampler=grain.samplers.IndexSampler(
            len(dataset), shard_options=grain.sharding.NoSharding(), shuffle=True, num_epochs=1, seed=5
        ),
        worker_count=0,
    )
    assert sorted(int(row["id"]) for row in loader) == KEPT
