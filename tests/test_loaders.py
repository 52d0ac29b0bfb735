"""The loaders a dataset makes for itself, transforms run in the workers, and what even batches
say about the rows they leave out."""

from __future__ import annotations

import multiprocessing.forkserver
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from spiral_lightning import Mixture, SpiralDataModule, TableDataset, TableMapDataset, TableSpec, WindowDataset, Windows
from spiral_lightning.datasets.job import even_note
from spiral_lightning.datasets.loader import referenced_modules
from tests.loaders import stopped_and_resumed

SIZES = [300, 40, 500, 160]
TOTAL = sum(SIZES)
OFFSETS = [0, 300, 340, 840]


def with_double(batch: dict[str, Any]) -> dict[str, Any]:
    """A transform that must run where the batch is made: it records the worker's process."""
    return {**batch, "double": batch["x"] * 2, "pid": torch.tensor([torch.utils.data.get_worker_info() is not None])}


def ids(batches: Any) -> list[int]:
    return [int(i) for batch in batches for i in batch["id"]]


@pytest.mark.slow
def test_a_datasets_loader_hands_on_its_batches_counts_them_and_resumes(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table(SIZES, columns=["id", "x"])
    dataset = TableDataset(spec, batch_size=64)
    loader = dataset.loader(num_workers=2)
    assert (loader.multiprocessing_context.get_start_method(), loader.persistent_workers) == ("forkserver", True)
    batches = list(loader)
    # The dataset's own batches, not a DataLoader's stack of them.
    assert all(batch["id"].ndim == 1 and len(batch["id"]) <= 64 for batch in batches)
    assert len(loader) == len(batches) == dataset.batches(2)
    assert sorted(ids(batches)) == list(range(TOTAL))
    # Persistent workers read the next epoch too.
    assert sorted(ids(loader)) == list(range(TOTAL))

    before, after = stopped_and_resumed(lambda: TableDataset(spec, batch_size=64).loader(num_workers=2), stop=4)
    assert sorted(ids(before) + ids(after)) == list(range(TOTAL))

    with pytest.raises(ValueError, match=r"cuts its own batches.*\[batch_size, rows, \.\.\.\]"):
        dataset.loader(batch_size=64)


@pytest.mark.slow
def test_a_mixtures_and_a_window_datasets_loaders_hand_on_their_batches_and_resume(
    make_table: Callable[..., TableSpec],
) -> None:
    first, second = make_table(SIZES, columns=["id", "x"]), make_table([200, 200], seed=3, columns=["id", "x"])

    def mixture() -> Any:
        return Mixture([(first, 0.5), (second, 0.5)], batch_size=32, table_key="table", stop="cycle").loader(2)

    before, after = stopped_and_resumed(mixture, stop=5)
    batches = before + after
    assert all(batch["id"].ndim == 1 for batch in batches)
    # stop="cycle": each worker reads its share of both tables to the end at least once.
    for table, rows in ((0, TOTAL), (1, 400)):
        assert set(ids(batch for batch in batches if batch["table"] == table)) == set(range(rows))

    def windows() -> Any:
        return WindowDataset(first, windows=Windows(4, stride=4), batch_size=8).loader(num_workers=2)

    before, after = stopped_and_resumed(windows, stop=3)
    starts = sorted(int(start) for batch in before + after for start in batch["id"][:, 0])
    windowed = zip(OFFSETS, SIZES, strict=True)
    assert starts == [start for begin, size in windowed for start in range(begin, begin + size, 4)]


@pytest.mark.slow
def test_a_map_style_loader_stacks_rows_in_a_new_order_each_epoch(make_table: Callable[..., TableSpec]) -> None:
    dataset = TableMapDataset(make_table(SIZES, columns=["id", "x"]))
    loader = dataset.loader(batch_size=32, num_workers=2, shuffle=True, seed=5)
    first = ids(loader)
    loader.sampler.set_epoch(1)
    second = ids(loader)
    assert sorted(first) == sorted(second) == list(range(TOTAL))
    assert first != second
    assert len(loader) == -(-TOTAL // 32)


@pytest.mark.slow
def test_a_transform_runs_on_every_batch_in_the_workers(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table(SIZES, columns=["id", "x"])
    batches = list(TableDataset(spec, batch_size=100, transform=with_double).loader(num_workers=2))
    assert all(bool(batch["pid"]) for batch in batches)
    assert all(torch.equal(batch["double"], batch["x"] * 2) for batch in batches)
    assert sorted(ids(batches)) == list(range(TOTAL))

    data = SpiralDataModule(spec, batch_size=100, num_workers=2, transform=with_double)
    data.setup("fit")
    assert all(bool(batch["pid"]) and "double" in batch for batch in data.train_dataloader())
    data = SpiralDataModule(spec, batch_size=100, access="map", transform=with_double)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert torch.equal(batch["double"], batch["x"] * 2)


def test_a_datamodule_names_a_bad_column_filter_or_policy_when_built(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table(SIZES)
    with pytest.raises(ValueError, match=r"unknown columns \['nope'\]"):
        SpiralDataModule(spec, columns=["id", "nope"])
    with pytest.raises(ValueError, match="weight"):
        SpiralDataModule(spec, filter="weight > 2")
    with pytest.raises(ValueError, match="unknown policy 'balance'"):
        SpiralDataModule(spec, policy="balance")


def test_even_batches_say_what_they_leave_out_and_warn_past_a_batch_per_consumer() -> None:
    note, warn = even_note(3, consumers=4, quota=100, left_out=4, batch_size=64)
    assert note == "even batches in epoch 3: each of the 4 consumers reads 100 rows, leaving out 4 rows of this epoch"
    assert not warn
    note, warn = even_note(0, consumers=4, quota=700, left_out=9300, batch_size=64)
    assert warn and "more than a batch per consumer" in note and "'balanced'" in note


def test_the_forkserver_imports_what_a_worker_unpickles(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([10], columns=["id", "x"])
    dataset = TableDataset(spec, batch_size=5, transform=with_double)
    found = referenced_modules(dataset)
    assert {"spiral_lightning.datasets.table", "tests.test_loaders"} <= set(found)
    # The backend that opens the table in the worker, which no pickled class names.
    assert "spiral_lightning.sources.spiral" in found
    parquet = TableDataset(make_table([10], backend="parquet", columns=["id"]), batch_size=5)
    assert "spiral_lightning.sources.parquet" in referenced_modules(parquet)
    assert referenced_modules(lambda batch: batch) == []
    loader = dataset.loader(num_workers=1)
    preload = multiprocessing.forkserver._forkserver._preload_modules  # type: ignore[attr-defined]
    # torch, pyarrow and the reader first, then what the main script and the dataset name.
    assert preload[:3] == ["torch", "pyarrow", "spiral_lightning.datasets.table"]
    assert "__main__" not in preload and "tests.test_loaders" in preload
    assert sorted(ids(loader)) == list(range(10))


def test_making_a_loader_warns_of_nothing_but_the_users_data(make_table: Callable[..., TableSpec]) -> None:
    # torchdata warns at every StatefulDataLoader made that torch deprecated an API it calls.
    spec = make_table([50, 30], columns=["id"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TableDataset(spec, batch_size=10).loader()
        TableMapDataset(spec).loader(batch_size=10)
        data = SpiralDataModule(train=spec, batch_size=10)
        data.setup("fit")
        data.train_dataloader()
    assert [str(warning.message) for warning in caught] == []
