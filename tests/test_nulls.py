"""Nulls: a column's type comes from the schema, never from a batch; nulls are filled or masked
as the spec says, and an unhandled one raises naming the column, the row and the option."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader

from spiral_lightning import (
    NullError,
    Nulls,
    TableDataset,
    TableMapDataset,
    TableSpec,
    WindowDataset,
    Windows,
    to_torch,
    write_table,
)

ROWS = 40
#: Rows per row group (and per Spiral split): the nulls lie in the second and fourth only.
GROUP = 10
X_NULLS = (13, 17, 35)
V_NULL_ROWS = (14,)
V_NULL_VALUES = ((36, 1),)


def data() -> pa.Table:
    """``id``; ``x`` float32 and ``v`` float32[2] with nulls in some row groups; ``flag`` and
    ``name``, whose nulls lie in other rows."""
    x = [None if row in X_NULLS else row / 2 for row in range(ROWS)]
    v: list[Any] = [[float(row), -float(row)] for row in range(ROWS)]
    for row in V_NULL_ROWS:
        v[row] = None
    for row, position in V_NULL_VALUES:
        v[row][position] = None
    return pa.table(
        {
            "id": pa.array(np.arange(ROWS, dtype=np.int64)),
            "x": pa.array(x, pa.float32()),
            "v": pa.array(v, pa.list_(pa.float32(), 2)),
            "flag": pa.array([None if row == 15 else row % 2 == 0 for row in range(ROWS)]),
            "name": pa.array([None if row == 16 else f"r{row}" for row in range(ROWS)]),
        }
    )


def write(folder: Path, backend: str) -> str:
    """``data()`` as a Parquet file of ``GROUP``-row row groups, or a Spiral table of such splits."""
    if backend == "spiral":
        return write_table(f"spiral:{folder / 'table'}", data(), split_rows=GROUP).uri
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(data(), folder / "part-0.parquet", row_group_size=GROUP)
    return f"parquet:{folder}"


def expected_x(fill: float) -> list[float]:
    return [fill if row in X_NULLS else row / 2 for row in range(ROWS)]


def test_to_torch_decides_types_from_the_schema() -> None:
    batch = data().to_batches()[0]
    filled = to_torch(batch, Nulls({"x": -1.0, "v": 7.0, "flag": True}))
    clean = to_torch(batch.slice(0, GROUP), Nulls({"x": -1.0, "v": 7.0, "flag": True}))
    for out in (filled, clean):
        assert out["x"].dtype == torch.float32 and out["v"].dtype == torch.float32
        assert out["flag"].dtype == torch.bool
        assert isinstance(out["name"], list)
    assert filled["x"].tolist() == expected_x(-1.0)
    assert filled["flag"][15].item() is True
    assert filled["name"][16] is None
    # A null-free batch still shares Arrow's buffer.
    column = batch.slice(0, GROUP).column("x")
    assert clean["x"].data_ptr() == column.buffers()[1].address


def test_unhandled_null_names_column_row_and_option() -> None:
    batch = data().to_batches()[0].slice(10, 10)
    with pytest.raises(ValueError, match=r"column 'x' is null at row 3 of its batch.*null_fill=\{'x': 0\.0\}"):
        to_torch(batch)
    with pytest.raises(ValueError, match=r"column 'v' is null at row 4 .*null_mask=\['v'\]"):
        to_torch(batch, Nulls({"x": 0.0, "flag": False}))
    with pytest.raises(ValueError, match=r"column 'flag' is null at row 5 .*null_fill=\{'flag': False\}"):
        to_torch(batch, Nulls({"x": 0.0}, ("v",)))


def test_masks_and_filled_values() -> None:
    batch = data().to_batches()[0]
    out = to_torch(batch, Nulls({"x": 2.5}, ("x", "v", "flag")))
    for name in ("x", "flag"):
        valid = out[f"{name}_valid"]
        assert valid.dtype == torch.bool and valid.shape == (ROWS,)
        assert valid.tolist() == pc.is_valid(batch.column(name)).to_pylist()
    x = out["x"]
    assert x[~out["x_valid"]].tolist() == [2.5] * len(X_NULLS)
    assert x[out["x_valid"]].tolist() == [value for value in batch.column("x").to_pylist() if value is not None]
    # Without a fill value a masked column holds 0 (False) in its null rows.
    assert out["flag"][15].item() is False
    assert list(out)[:3] == ["id", "x", "x_valid"]


def test_fixed_size_list_with_a_null_row_and_a_null_value() -> None:
    batch = data().to_batches()[0]
    out = to_torch(batch, Nulls({"v": -9.0, "x": 0.0, "flag": False}, ("v",)))
    v = out["v"]
    assert v.shape == (ROWS, 2) and v.dtype == torch.float32
    assert v[14].tolist() == [-9.0, -9.0]
    assert v[36].tolist() == [36.0, -9.0]
    assert v[20].tolist() == [20.0, -20.0]
    # A row is valid when it holds its whole value: not null, and no null inside.
    invalid = [row for row, valid in enumerate(out["v_valid"].tolist()) if not valid]
    assert invalid == [14, 36]
    masked = to_torch(batch, Nulls({"x": 0.0, "flag": False}, ("v",)))
    assert masked["v"][14].tolist() == [0.0, 0.0] and masked["v"][36].tolist() == [36.0, 0.0]
    # The Arrow batch is left as it was: filling copies.
    assert batch.column("v").to_pylist()[36] == [36.0, None]


def test_batch_slices_fill_and_mask_like_each_slice(tmp_path: Path) -> None:
    spec = TableSpec(write(tmp_path, "parquet"), null_fill={"x": 1.5, "v": 0.0, "flag": False}, null_mask=["v"])
    assert spec.null_mask == ("v",)
    # Frames of 3 rows cut each 10-row read batch, so most are slices of one converted batch.
    batches = list(TableDataset(spec, batch_size=3))
    assert all(batch["x"].dtype == torch.float32 and batch["v_valid"].dtype == torch.bool for batch in batches)
    assert torch.cat([batch["x"] for batch in batches]).tolist() == expected_x(1.5)
    valid = torch.cat([batch["v_valid"] for batch in batches])
    assert [row for row, ok in enumerate(valid.tolist()) if not ok] == [14, 36]


@pytest.mark.parametrize("backend", ["parquet", "spiral"])
def test_filled_column_is_a_tensor_in_every_batch_through_workers(tmp_path: Path, backend: str) -> None:
    spec = TableSpec(write(tmp_path, backend), null_fill={"x": -1.0, "v": 0.0, "flag": False}, null_mask=["x"])
    loader = DataLoader(
        TableDataset(spec, batch_size=4), batch_size=None, num_workers=2, multiprocessing_context="forkserver"
    )
    batches = list(loader)
    assert len(batches) == ROWS // 4
    for batch in batches:
        assert isinstance(batch["x"], torch.Tensor) and batch["x"].dtype == torch.float32
        assert isinstance(batch["v"], torch.Tensor) and batch["v"].shape == (4, 2)
        assert batch["x_valid"].dtype == torch.bool
    ids = torch.cat([batch["id"] for batch in batches])
    x = torch.cat([batch["x"] for batch in batches])[ids.argsort()]
    valid = torch.cat([batch["x_valid"] for batch in batches])[ids.argsort()]
    assert x.tolist() == expected_x(-1.0)
    assert [row for row, ok in enumerate(valid.tolist()) if not ok] == list(X_NULLS)


def test_windows_fill_and_mask_as_the_spec_says(tmp_path: Path) -> None:
    spec = TableSpec(write(tmp_path, "parquet"), columns=["id", "x"], null_fill={"x": -1.0}, null_mask=["x"])
    batches = list(WindowDataset(spec, windows=Windows(5, 5), batch_size=2))
    assert all(batch["x"].shape == batch["x_valid"].shape == (2, 5) for batch in batches)
    x = torch.cat([batch["x"].reshape(-1) for batch in batches])
    assert x.dtype == torch.float32 and x.tolist() == expected_x(-1.0)


def test_dataset_names_table_consumer_and_stream_row(tmp_path: Path) -> None:
    uri = write(tmp_path, "parquet")
    with pytest.raises(
        ValueError,
        match=r"column 'x' is null at parquet:.* \(rank 0, worker 0\), row 13 \(position 1 of its batch\).*null_fill",
    ):
        list(TableDataset(uri, batch_size=4))
    spec = TableSpec(uri, columns=["id", "x"])
    loader = DataLoader(
        TableDataset(spec, batch_size=4), batch_size=None, num_workers=2, multiprocessing_context="forkserver"
    )
    # The error reaches the main process as itself, message and all.
    with pytest.raises(NullError, match=r"column 'x' is null at parquet:.*, worker \d\), row \d+ .*null_fill"):
        list(loader)


def test_map_style_batches_collate_with_filled_nulls(tmp_path: Path) -> None:
    # Strings keep None for a null, which default_collate refuses, so ``name`` stays out.
    spec = TableSpec(
        write(tmp_path, "parquet"),
        columns=["id", "x", "v", "flag"],
        null_fill={"x": 0.0, "v": 0.0, "flag": False},
        null_mask=["x"],
    )
    dataset = TableMapDataset(spec)
    assert dataset[13]["x"].dtype == torch.float32 and dataset[13]["x_valid"].item() is False
    loader = DataLoader(
        dataset, batch_size=8, shuffle=True, num_workers=2, multiprocessing_context="forkserver", drop_last=False
    )
    seen: dict[int, tuple[float, bool]] = {}
    for batch in loader:
        assert batch["x"].dtype == torch.float32 and batch["x_valid"].dtype == torch.bool
        assert batch["v"].shape[1:] == (2,)
        for row, value, ok in zip(batch["id"].tolist(), batch["x"].tolist(), batch["x_valid"].tolist(), strict=True):
            seen[row] = (value, ok)
    assert [seen[row][0] for row in range(ROWS)] == expected_x(0.0)
    assert [row for row in range(ROWS) if not seen[row][1]] == list(X_NULLS)


def test_map_style_unhandled_null_names_the_index(tmp_path: Path) -> None:
    dataset = TableMapDataset(TableSpec(write(tmp_path, "parquet"), columns=["id", "x"]))
    assert dataset[12]["x"].item() == 6.0
    with pytest.raises(ValueError, match=r"column 'x' is null at parquet:.*, index 35, .*null_fill=\{'x': 0\.0\}"):
        dataset.__getitems__([3, 35, 1])


def test_unknown_or_unfit_columns_are_refused_when_built(tmp_path: Path) -> None:
    uri = write(tmp_path, "parquet")
    for make in (TableDataset, TableMapDataset):
        with pytest.raises(ValueError, match=r"columns \['nope'\] that .* does not return"):
            make(TableSpec(uri, null_fill={"nope": 0.0}))
        with pytest.raises(ValueError, match=r"columns \['x'\] that .* does not return"):
            make(TableSpec(uri, columns=["id"], null_mask=["x"]))
        with pytest.raises(ValueError, match=r"not to 'name' of type string"):
            make(TableSpec(uri, null_fill={"name": 0}))
        with pytest.raises(ValueError, match=r"null_fill for column 'id' must be a value of its type int64, not 0.5"):
            make(TableSpec(uri, null_fill={"id": 0.5}))
        with pytest.raises(ValueError, match=r"null_fill for column 'flag' must be a value of its type bool"):
            make(TableSpec(uri, null_fill={"flag": 1}))
    with pytest.raises(TypeError, match="null_fill must map column names"):
        TableSpec(uri, null_fill={"x": "zero"})
    with pytest.raises(TypeError, match="null_mask must be a list of column names"):
        TableSpec(uri, null_mask="x")  # type: ignore[arg-type]  # a string is refused at run time too
    with pytest.raises(ValueError, match=r"would add the columns \['x_valid'\]"):
        to_torch(pa.record_batch({"x": [1.0], "x_valid": [True]}), Nulls(mask=("x",)))
