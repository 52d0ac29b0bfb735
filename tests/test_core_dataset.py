"""write_table's splits, TableSpec values, len, pickling and what a consumer sees."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from spiral_lightning import TableDataset, TableSpec, write_table
from spiral_lightning.sources import open_source
from spiral_lightning.sources.spiral import parse
from tests.tables import BACKENDS, KEEP, KEEP_TEXT, kept_ids


def test_write_table_cuts_one_split_per_split_rows(tmp_path: Path) -> None:
    data = pa.table({"id": np.arange(2_500, dtype=np.int64), "name": [str(i) for i in range(2_500)]})
    reader = pa.RecordBatchReader.from_batches(data.schema, data.to_batches(max_chunksize=333))
    spec = write_table(f"spiral:{tmp_path / 't'}", reader, split_rows=1_000)
    source = open_source(spec)
    assert [(split.start, split.end) for split in source.splits] == [(0, 1000), (0, 1000), (0, 500)]
    assert source.count([(s.id, s.start, s.end) for s in source.splits]) == [1000, 1000, 500]  # type: ignore[misc]
    rows = [row for batch in TableDataset(spec) for row in batch["id"].tolist()]
    assert rows == list(range(2_500))
    assert TableSpec(f"spiral:{tmp_path / 't'}").resolve() == spec


def test_spec_is_a_plain_picklable_value(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([10], columns=["id", "x"], filter=KEEP)
    yaml_like = TableSpec(spec.uri, columns=["id", "x"])  # type: ignore[arg-type]
    assert yaml_like.columns == ("id", "x")
    assert pickle.loads(pickle.dumps(spec)).uri == spec.uri
    with pytest.raises(TypeError, match="columns must be a list of column names"):
        TableSpec(spec.uri, columns="id")  # type: ignore[arg-type]


def test_remote_addresses_parse_to_project_path_and_ids() -> None:
    location = parse("spiral://my-project/datasets/images@v12")
    assert (location.project, location.path, location.resolved) == ("my-project", "datasets/images@v12", False)
    pinned = parse("spiral://my-project/datasets/images?resource_id=r&version_id=v")
    assert (pinned.project, pinned.path, pinned.resource_id, pinned.version_id) == (
        "my-project",
        "datasets/images",
        "r",
        "v",
    )
    assert TableSpec("spiral://my-project/datasets/images?resource_id=r&version_id=v").version == "r@v"


@pytest.mark.parametrize("backend", BACKENDS)
def test_len_counts_each_ranks_rows_after_the_filter(make_table: Callable[..., TableSpec], backend: str) -> None:
    sizes = [400, 0, 1200, 300, 800]
    spec = make_table(sizes, seed=7, backend=backend, filter=KEEP_TEXT)
    lengths = [len(TableDataset(spec, rank=rank, world_size=2)) for rank in range(2)]
    delivered = [
        [r for b in TableDataset(spec, rank=rank, world_size=2) for r in b["id"].tolist()] for rank in range(2)
    ]
    assert lengths == [len(rows) for rows in delivered]
    assert sorted(delivered[0] + delivered[1]) == kept_ids(sizes, seed=7)


def test_pickled_dataset_carries_no_open_source(make_table: Callable[..., TableSpec]) -> None:
    dataset = TableDataset(make_table([100, 100]), batch_size=64)
    assert len(dataset) == 200
    copy = pickle.loads(pickle.dumps(dataset))
    assert copy._source is None
    assert [len(batch["id"]) for batch in copy] == [64, 64, 64, 8]


def test_batches_are_tensors_and_arrow_without_collate(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([50, 70], columns=["id", "x", "v"])
    batch = next(iter(TableDataset(spec, batch_size=100)))
    assert batch["v"].shape == (100, 4) and batch["x"].dtype == torch.float32
    assert torch.equal(batch["x"], torch.arange(100, dtype=torch.float32) / 2)
    raw = next(iter(TableDataset(spec, batch_size=100, collate=None)))
    assert isinstance(raw, pa.RecordBatch) and raw.num_rows == 100


def test_set_epoch_is_recorded_and_a_restored_dataset_keeps_its_epoch(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([300])
    dataset = TableDataset(spec, batch_size=100)
    dataset.set_epoch(3)
    next(iter(dataset))
    restored = TableDataset(spec, batch_size=100)
    restored.load_state_dict(dataset.state_dict())
    assert restored.epoch == 3
    assert [batch["id"][0].item() for batch in restored] == [100, 200]
    with pytest.raises(ValueError, match="epoch must be a non-negative int"):
        dataset.set_epoch(-1)


def test_a_new_epoch_starts_with_nothing_delivered(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([300])
    dataset = TableDataset(spec, batch_size=100)
    assert len(list(dataset)) == 3
    dataset.set_epoch(1)
    state = dataset.state_dict()
    assert (state["epoch"], state["cursor"]) == (1, None)
    restored = TableDataset(spec, batch_size=100)
    restored.load_state_dict(state)
    assert [batch["id"][0].item() for batch in restored] == [0, 100, 200]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_resolved_spec_names_its_table_from_any_folder(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ray Train workers, for one, run in folders of their own.
    monkeypatch.chdir(tmp_path)
    write_table(f"{backend}:relative", pa.table({"id": list(range(30))}), split_rows=10)
    pinned = TableSpec(f"{backend}:relative").resolve()
    monkeypatch.chdir("/")
    assert [int(i) for batch in TableDataset(pinned, batch_size=7) for i in batch["id"]] == list(range(30))
