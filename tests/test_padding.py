"""Padded ragged columns: shapes, pad values and lengths by exact values, in to_torch, TableDataset
(batches cut across read batches), TableMapDataset, the DataModule and YAML, on every backend."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from jsonargparse import ArgumentParser
from torch.utils.data import DataLoader

from spiral_lightning import (
    Nulls,
    Padded,
    SpiralDataModule,
    TableDataset,
    TableMapDataset,
    TableSpec,
    TooLong,
    to_torch,
)
from tests.tables import BACKENDS, write_uneven, write_uneven_parquet

ROWS = [[1, 2, 3], [], [4], [5, 6, 7, 8, 9], [10, 11]]


def reference(rows: list[list[Any]], width: int, pad: Any) -> list[list[Any]]:
    return [(row + [pad] * width)[:width] for row in rows]


def test_pads_to_the_longest_row_with_lengths() -> None:
    batch = pa.record_batch({"t": pa.array(ROWS, pa.list_(pa.int32()))})
    converted = to_torch(batch, padded=[Padded("t", pad=-1)])
    # Token ids arrive as int64, as PackedDataset gives them and torch's losses take them.
    assert converted["t"].dtype == torch.int64
    assert to_torch(batch, padded=[Padded("t", dtype="int32")])["t"].dtype == torch.int32
    floats = pa.record_batch({"t": pa.array([[0.5], [1.5, 2.5]], pa.list_(pa.float32()))})
    assert to_torch(floats, padded=[Padded("t")])["t"].dtype == torch.float32
    with pytest.raises(ValueError, match="dtype must name a numpy number type such as 'int32', not 'text'"):
        Padded("t", dtype="text")
    assert converted["t"].tolist() == reference(ROWS, 5, -1)
    assert converted["t_length"].tolist() == [3, 0, 1, 5, 2]
    sliced = to_torch(batch.slice(1, 3), padded=[Padded("t")])
    assert sliced["t"].tolist() == reference(ROWS[1:4], 5, 0)
    empty = to_torch(batch.slice(1, 1), padded=[Padded("t")])
    assert empty["t"].shape == (1, 0) and empty["t_length"].tolist() == [0]


def test_a_maximum_truncates_fixes_or_refuses() -> None:
    batch = pa.record_batch({"t": pa.array(ROWS, pa.large_list(pa.int64()))})
    cut = to_torch(batch, padded=[Padded("t", max_length=2, overflow="truncate")])
    assert cut["t"].tolist() == [row[:2] + [0] * (2 - len(row[:2])) for row in ROWS]
    assert cut["t_length"].tolist() == [2, 0, 1, 2, 2]
    fixed = to_torch(batch.slice(1, 2), padded=[Padded("t", max_length=6, fixed=True, pad=7)])
    assert fixed["t"].tolist() == [[7] * 6, [4] + [7] * 5]
    short = to_torch(batch.slice(0, 3), padded=[Padded("t", max_length=6)])
    assert short["t"].shape == (3, 3)
    with pytest.raises(TooLong, match=r"'t' has 5 values at row 3 of its batch, more than Padded\(max_length=4\)"):
        to_torch(batch, padded=[Padded("t", max_length=4)])


def test_a_list_of_fixed_size_lists_pads_to_rows_by_length_by_width() -> None:
    values = [[[1.0, 2.0]], [], [[3.0, 4.0], [5.0, 6.0]]]
    batch = pa.record_batch({"s": pa.array(values, pa.list_(pa.list_(pa.float32(), 2)))})
    converted = to_torch(batch, padded=[Padded("s", pad=-1.0)])
    assert converted["s"].shape == (3, 2, 2) and converted["s"].dtype == torch.float32
    assert converted["s"].tolist() == [[[1, 2], [-1, -1]], [[-1, -1], [-1, -1]], [[3, 4], [5, 6]]]
    assert converted["s_length"].tolist() == [1, 0, 2]


def test_nulls_follow_null_fill_and_null_mask() -> None:
    batch = pa.record_batch({"t": pa.array([[1, None], None, [3]], pa.list_(pa.int32()))})
    with pytest.raises(ValueError, match="column 't' is null at row 0"):
        to_torch(batch, padded=[Padded("t")])
    converted = to_torch(batch, Nulls({"t": 9}, ["t"]), [Padded("t")])
    assert converted["t"].tolist() == [[1, 9], [0, 0], [3, 0]]
    assert converted["t_length"].tolist() == [2, 0, 1]
    assert converted["t_valid"].tolist() == [False, False, True]


def test_bad_projections_are_named(tmp_path: Path) -> None:
    spec = write_uneven(tmp_path / "t", pa.table({"t": pa.array(ROWS, pa.list_(pa.int32())), "x": range(5)}), [5])
    with pytest.raises(ValueError, match=r"pads a ragged column .* not 'x' of type int64"):
        TableDataset(replace(spec, padded=(Padded("x"),)))
    with pytest.raises(ValueError, match=r"padded names columns \['y'\]"):
        TableDataset(replace(spec, padded=(Padded("y"),)))
    with pytest.raises(ValueError, match="Padded pad for column 't' must be a value of its type int32"):
        TableDataset(replace(spec, padded=(Padded("t", pad=0.5),)))
    with pytest.raises(ValueError, match="names a column more than once"):
        TableSpec(spec.uri, padded=(Padded("t"), Padded("t")))
    with pytest.raises(ValueError, match=r"fixed=True.* needs one"):
        Padded("t", fixed=True)
    tokens = replace(spec, padded=(Padded("t", max_length=4),))
    with pytest.raises(TooLong, match=r"5 values at spiral:.* \(rank 0, worker 0\), row 3 .*; raise max_length"):
        list(TableDataset(tokens, batch_size=5))


def texts(rows: int) -> pa.Table:
    """``rows`` rows: ``id`` and ``t``, a ragged int32 list of ``id % 7`` values counting from ``id``."""
    return pa.table(
        {
            "id": pa.array(np.arange(rows, dtype=np.int64)),
            "t": pa.array([list(range(i, i + i % 7)) for i in range(rows)], pa.list_(pa.int32())),
        }
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_table_dataset_pads_each_batch_to_its_own_longest_row(tmp_path: Path, backend: str) -> None:
    write = write_uneven_parquet if backend == "parquet" else write_uneven
    spec = write(tmp_path / "t", texts(300), [100, 37, 163])
    dataset = TableDataset(replace(spec, padded=(Padded("t", pad=-1),)), batch_size=64)
    seen = 0
    for batch in dataset:
        ids = batch["id"].tolist()
        rows = [list(range(i, i + i % 7)) for i in ids]
        width = max(len(row) for row in rows)
        assert batch["t"].tolist() == reference(rows, width, -1)
        assert batch["t_length"].tolist() == [len(row) for row in rows]
        seen += len(ids)
    assert seen == 300


@pytest.mark.parametrize("backend", BACKENDS)
def test_map_style_rows_pad_to_the_longest_row_requested_together(tmp_path: Path, backend: str) -> None:
    write = write_uneven_parquet if backend == "parquet" else write_uneven
    spec = write(tmp_path / "t", texts(50), [20, 30])
    dataset = TableMapDataset(replace(spec, padded=(Padded("t", max_length=4, overflow="truncate"),)))
    assert dataset[13]["t"].tolist() == [13, 14, 15, 16] and dataset[13]["t_length"].item() == 4
    assert dataset[14]["t"].tolist() == [] and dataset[14]["t_length"].item() == 0
    batch = next(iter(DataLoader(dataset, batch_size=3, sampler=[14, 8, 22])))
    assert batch["t"].tolist() == [[0], [8], [22]]  # one __getitems__ call: its longest row is 1 value
    assert batch["t_length"].tolist() == [0, 1, 1]


def test_datamodule_pads_a_spec_written_in_yaml(tmp_path: Path) -> None:
    spec = write_uneven(tmp_path / "t", texts(40), [40])
    parser = ArgumentParser()
    parser.add_class_arguments(SpiralDataModule, "data")
    config = parser.parse_string(
        f"""
data:
  train:
    uri: {spec.uri}
    padded:
      - column: t
        max_length: 8
        fixed: true
        pad: -1
  batch_size: 16
"""
    )
    data = parser.instantiate(config).data
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    rows = [list(range(i, i + i % 7)) for i in range(16)]
    assert batch["t"].tolist() == reference(rows, 8, -1)
    assert batch["t_length"].tolist() == [len(row) for row in rows]
