"""Windows of consecutive rows: equal to a brute-force reference from the full table, never across
a group or a work item, every window exactly once over all consumers, and resume = uninterrupted,
as properties over random layouts of episodes; and through a real StatefulDataLoader."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader

from spiral_lightning import Shard, TableSpec, WindowDataset, Windows, stripe
from spiral_lightning.datasets.windows import WindowPosition, read_windows
from spiral_lightning.reading.frames import start_of
from spiral_lightning.reading.windows import count_windows
from spiral_lightning.sources import open_source
from tests.examples import examples
from tests.loaders import stopped_and_resumed
from tests.tables import BACKENDS, KEEP_TEXT, THRESHOLD, write_uneven, write_uneven_parquet

split_sizes = st.lists(st.integers(0, 400), min_size=1, max_size=4)
window_settings = st.builds(Windows, st.integers(1, 6), st.integers(1, 7), st.sampled_from([None, "episode"]))
EXAMPLES = examples(40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def episode_table(split_sizes: list[int], seed: int) -> pa.Table:
    """Rows ``id`` 0..n-1, ``episode`` numbers in runs of 1 to 12 rows that may span splits,
    ``score`` (the filter keeps below ``THRESHOLD``) and ``v`` float32[2]."""
    generator = np.random.default_rng(seed)
    rows = sum(split_sizes)
    episode = np.repeat(np.arange(rows + 1), generator.integers(1, 13, rows + 1))[:rows]
    return pa.table(
        {
            "id": pa.array(np.arange(rows, dtype=np.int64)),
            "episode": pa.array(episode.astype(np.int64)),
            "score": pa.array(generator.integers(0, 2 * THRESHOLD, rows)),
            "v": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(rows * 2, dtype=np.float32)), 2),
        }
    )


@contextmanager
def episodes(sizes: list[int], seed: int, backend: str, filtered: bool) -> Iterator[tuple[TableSpec, pa.Table]]:
    root = Path(tempfile.mkdtemp(prefix="windows-"))
    try:
        data = episode_table(sizes, seed)
        write = write_uneven_parquet if backend == "parquet" else write_uneven
        spec = write(root / "t", data, sizes)
        yield replace(spec, columns=("id", "episode", "v"), filter=KEEP_TEXT if filtered else None), data
    finally:
        shutil.rmtree(root)


def reference(data: pa.Table, sizes: list[int], windows: Windows, filtered: bool) -> list[tuple[int, ...]]:
    """Every window of the table, computed row by row: runs of kept rows of one split (and one
    episode), windows at every ``stride``-th row of a run that fit in it."""
    ids, episode, score = (data.column(name).to_pylist() for name in ("id", "episode", "score"))
    found: list[tuple[int, ...]] = []
    offset = 0
    for size in sizes:
        runs: list[list[int]] = []
        last_key: Any = object()
        for row in range(offset, offset + size):
            if filtered and score[row] >= THRESHOLD:
                continue
            key = episode[row] if windows.group_by else None
            if not runs or key != last_key:
                runs.append([])
            runs[-1].append(ids[row])
            last_key = key
        for run in runs:
            for start in range(0, len(run) - windows.size + 1, windows.stride):
                found.append(tuple(run[start : start + windows.size]))
        offset += size
    return found


def window_ids(batch: pa.RecordBatch, size: int) -> list[tuple[int, ...]]:
    ids = batch.column("id").to_pylist()
    return [tuple(ids[start : start + size]) for start in range(0, len(ids), size)]


@EXAMPLES
@given(
    sizes=split_sizes,
    seed=st.integers(0, 100),
    backend=st.sampled_from(BACKENDS),
    filtered=st.booleans(),
    windows=window_settings,
    world_size=st.integers(1, 3),
    workers=st.integers(1, 2),
    batch_size=st.integers(1, 40),
)
def test_consumers_window_every_run_exactly_once_as_the_reference_does(
    sizes: list[int],
    seed: int,
    backend: str,
    filtered: bool,
    windows: Windows,
    world_size: int,
    workers: int,
    batch_size: int,
) -> None:
    with episodes(sizes, seed, backend, filtered) as (spec, data):
        source = open_source(spec)
        episode_of = dict(zip(data.column("id").to_pylist(), data.column("episode").to_pylist(), strict=True))
        found: list[tuple[int, ...]] = []
        for rank in range(world_size):
            for worker in range(workers):
                items = stripe(source.splits, Shard(rank, world_size, worker, workers))
                batches = list(
                    read_windows(source, items, WindowPosition(start_of(items)), windows, batch_size, "keep_partial")
                )
                assert all(batch.num_rows == batch_size * windows.size for batch, _ in batches[:-1])
                mine = [window for batch, _ in batches for window in window_ids(batch, windows.size)]
                assert count_windows(source, items, [], windows) == len(mine), "counted ahead, other windows"
                found += mine
        if windows.group_by:
            assert all(len({episode_of[row] for row in window}) == 1 for window in found)
        assert sorted(found) == sorted(reference(data, sizes, windows, filtered))


@EXAMPLES
@given(
    sizes=split_sizes,
    seed=st.integers(0, 100),
    backend=st.sampled_from(BACKENDS),
    filtered=st.booleans(),
    windows=window_settings,
    world_size=st.integers(1, 2),
    batch_size=st.integers(1, 40),
    stop=st.floats(0, 1),
)
def test_dataset_resumes_from_any_batch_exactly(
    sizes: list[int],
    seed: int,
    backend: str,
    filtered: bool,
    windows: Windows,
    world_size: int,
    batch_size: int,
    stop: float,
) -> None:
    with episodes(sizes, seed, backend, filtered) as (spec, _):
        for rank in range(world_size):
            options: dict[str, Any] = {"windows": windows, "batch_size": batch_size, "rank": rank}
            options["world_size"] = world_size
            whole = [batch["id"].tolist() for batch in WindowDataset(spec, **options)]
            assert whole == [batch["id"].tolist() for batch in WindowDataset(spec, **options)]
            assert WindowDataset(spec, **options).batches(0) == len(whole)
            cut = int(stop * len(whole))
            first = WindowDataset(spec, **options)
            delivering = iter(first)
            before = [next(delivering)["id"].tolist() for _ in range(cut)]
            second = WindowDataset(spec, **options)
            second.load_state_dict(first.state_dict())
            assert before + [batch["id"].tolist() for batch in second] == whole


def test_batches_are_batch_by_size_tensors(tmp_path: Path) -> None:
    spec = write_uneven(tmp_path / "t", episode_table([200, 150], seed=3), [200, 150])
    dataset = WindowDataset(
        replace(spec, columns=("id", "episode", "v")), windows=Windows(5, 2, "episode"), batch_size=8
    )
    batch = next(iter(dataset))
    assert batch["id"].shape == (8, 5)
    assert batch["v"].shape == (8, 5, 2)
    assert (batch["episode"] == batch["episode"][:, :1]).all()
    assert (batch["id"][:, 1:] - batch["id"][:, :-1] == 1).all()


def test_group_column_must_be_selected_and_states_must_match(tmp_path: Path) -> None:
    spec = write_uneven_parquet(tmp_path / "t", episode_table([50], seed=1), [50])
    with pytest.raises(ValueError, match="group column 'episode' is not among the columns"):
        WindowDataset(replace(spec, columns=("id",)), windows=Windows(3, group_by="episode"), batch_size=2)
    saved = WindowDataset(spec, windows=Windows(3, 1, "episode"), batch_size=2)
    next(iter(saved))
    state = saved.state_dict()
    with pytest.raises(ValueError, match="windows: saved"):
        WindowDataset(spec, windows=Windows(4, 1, "episode"), batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size"):
        WindowDataset(spec, windows=Windows(3, 1, "episode"), batch_size=3).load_state_dict(state)
    with pytest.raises(ValueError, match="lead must be a non-negative int"):
        WindowDataset(spec, windows=Windows(3, 1, "episode"), batch_size=2).load_state_dict({**state, "lead": -1})
    with pytest.raises(ValueError, match="size must be a positive int"):
        Windows(0)
    with pytest.raises(TypeError, match="has no length"):
        len(saved)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_stateful_dataloader_with_two_workers_resumes_windows_exactly(tmp_path: Path, backend: str) -> None:
    sizes = [900, 40, 1200, 700]
    write = write_uneven_parquet if backend == "parquet" else write_uneven
    spec = replace(write(tmp_path / "t", episode_table(sizes, seed=5), sizes), columns=("id", "episode"))

    def loader() -> StatefulDataLoader:
        dataset = WindowDataset(spec, windows=Windows(6, 4, "episode"), batch_size=16)
        return StatefulDataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="forkserver")

    whole = [batch["id"].tolist() for batch in loader()]
    before, after = stopped_and_resumed(loader, 7)
    assert [batch["id"].tolist() for batch in before + after] == whole
    assert sorted(tuple(window) for batch in whole for window in batch) == sorted(
        reference(episode_table(sizes, seed=5), sizes, Windows(6, 4, "episode"), filtered=False)
    )
