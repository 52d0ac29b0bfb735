"""to_torch: which Arrow columns become tensors (sharing memory), and which stay lists."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from spiral_lightning import to_torch
from spiral_lightning.reading.tensors import BatchSlices, NullError, Nulls


def test_numbers_and_fixed_size_lists_share_arrow_memory() -> None:
    values = np.arange(24, dtype=np.float32)
    batch = pa.record_batch(
        {
            "i": pa.array(np.arange(6, dtype=np.int64)),
            "f": pa.array(np.arange(6, dtype=np.float16)),
            "v": pa.FixedSizeListArray.from_arrays(pa.array(values), 4),
            "m": pa.FixedSizeListArray.from_arrays(pa.FixedSizeListArray.from_arrays(pa.array(values), 2), 2),
        }
    ).slice(1, 4)
    out = to_torch(batch)
    assert out["i"].tolist() == [1, 2, 3, 4] and out["i"].dtype == torch.int64
    assert out["f"].dtype == torch.float16
    assert out["v"].shape == (4, 4) and torch.equal(out["v"], torch.arange(4, 20, dtype=torch.float32).reshape(4, 4))
    assert out["m"].shape == (4, 2, 2) and torch.equal(out["m"].reshape(4, 4), out["v"])
    column = batch.column("v").flatten()
    assert out["v"].data_ptr() == column.buffers()[1].address + column.offset * 4


def test_fixed_shape_tensors_take_their_declared_shape_and_order() -> None:
    array = np.arange(2 * 3 * 4 * 5, dtype=np.int32).reshape(2, 3, 4, 5)
    plain = pa.FixedShapeTensorArray.from_numpy_ndarray(array)
    permuted_type = pa.fixed_shape_tensor(pa.int32(), [3, 4, 5], permutation=[2, 0, 1])
    physical = np.ascontiguousarray(array.transpose(0, 3, 1, 2))
    storage = pa.FixedSizeListArray.from_arrays(pa.array(physical.reshape(-1)), 60)
    permuted = pa.ExtensionArray.from_storage(permuted_type, storage)
    out = to_torch(pa.record_batch({"plain": plain, "permuted": permuted}))
    assert torch.equal(out["plain"], torch.from_numpy(array))
    # The Arrow spec: physical dimension i holds logical dimension permutation[i].
    assert torch.equal(out["permuted"], torch.from_numpy(array))


def test_booleans_are_copied_and_other_columns_stay_lists() -> None:
    batch = pa.record_batch(
        {
            "flag": pa.array([True, False, True]),
            "name": pa.array(["a", "bb", "c"]),
            "blob": pa.array([b"x", b"", b"yz"]),
            "ragged": pa.array([[1], [2, None], None]),
            "struct": pa.array([{"a": 1}, {"a": 2}, {"a": 3}]),
        }
    )
    out = to_torch(batch)
    assert out["flag"].dtype == torch.bool and out["flag"].tolist() == [True, False, True]
    assert out["name"] == ["a", "bb", "c"]
    assert out["blob"] == [b"x", b"", b"yz"]
    assert out["ragged"] == [[1], [2, None], None]
    assert out["struct"] == [{"a": 1}, {"a": 2}, {"a": 3}]


def _shaped_column(shapes: list[tuple[int, ...]]) -> pa.StructArray:
    """A shaped tensor column (``data`` in C order, ``shape``) of float32 arrays of ``shapes``."""
    sizes = [int(np.prod(shape)) for shape in shapes]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    data = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.arange(offsets[-1], dtype=np.float32)))
    shape = pa.array([list(s) for s in shapes], pa.list_(pa.int32(), len(shapes[0])))
    return pa.StructArray.from_arrays([data, shape], names=["data", "shape"])


def _same(got: object, expected: object) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)
    elif isinstance(expected, list) and expected and isinstance(expected[0], torch.Tensor):
        assert isinstance(got, list) and len(got) == len(expected)
        for got_row, row in zip(got, expected, strict=True):
            _same(got_row, row)
    else:
        assert got == expected


def test_batch_slices_equal_converting_each_slice() -> None:
    rows = 12
    permuted = pa.fixed_shape_tensor(pa.int32(), [2, 3], permutation=[1, 0])
    storage = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(rows * 6, dtype=np.int32)), 6)
    # Row 4 holds a 2x2 among 1x3 arrays: slices that miss it convert to tensors, so its batch
    # must not be converted once and sliced. Row 5 holds a null, filled and masked.
    nulls = [float(i) if i != 5 else None for i in range(rows)]
    mixed = [(2, 2) if i == 4 else (1, 3) for i in range(rows)]
    clean = {
        "i": pa.array(np.arange(rows, dtype=np.int64)),
        "flag": pa.array([i % 3 == 0 for i in range(rows)]),
        "v": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(rows * 4, dtype=np.float32)), 4),
        "t": pa.ExtensionArray.from_storage(permuted, storage),
        "name": pa.array([f"r{i}" for i in range(rows)]),
        "same": _shaped_column([(1, 3)] * rows),
    }
    shaped = pa.field("same", clean["same"].type, metadata={b"spiral_lightning.tensor": b"{}"})
    clean_batch = pa.RecordBatch.from_arrays(
        list(clean.values()),
        schema=pa.schema([*(pa.field(k, v.type) for k, v in clean.items() if k != "same"), shaped]),
    )
    mixed_field = pa.field("same", clean["same"].type, metadata={b"spiral_lightning.tensor": b"{}"})
    filled = Nulls({"x": -1.0}, ("x",))
    for batch, options in (
        (clean_batch, None),
        (pa.record_batch({"i": clean["i"], "x": pa.array(nulls, pa.float64())}), filled),
        (
            pa.RecordBatch.from_arrays(
                [clean["i"], _shaped_column(mixed)], schema=pa.schema([("i", pa.int64()), mixed_field])
            ),
            None,
        ),
        (clean_batch.slice(3, 7), None),
    ):
        slices = BatchSlices(options)
        for offset, length in [(0, 4), (4, 4), (8, batch.num_rows - 8), (6, 1), (0, batch.num_rows)]:
            if offset + length > batch.num_rows or length <= 0:
                continue
            got = slices(batch, offset, length)
            expected = to_torch(batch.slice(offset, length), options)
            assert list(got) == list(expected)
            for name, value in expected.items():
                _same(got[name], value)
    # The clean batch is converted once: its booleans, a copy, are one copy for every slice.
    slices = BatchSlices()
    first, second = slices(clean_batch, 0, 4), slices(clean_batch, 4, 4)
    assert first["flag"].untyped_storage().data_ptr() == second["flag"].untyped_storage().data_ptr()
    assert isinstance(first["same"], torch.Tensor) and first["same"].shape == (4, 1, 3)
    # An unhandled null raises for the slice that holds it, at its position there, and only there.
    with_null = pa.record_batch({"x": pa.array(nulls, pa.float64())})
    assert isinstance(slices(with_null, 0, 4)["x"], torch.Tensor)
    with pytest.raises(NullError) as raised:
        slices(with_null, 4, 4)
    assert raised.value.column == "x" and raised.value.position == 1
    assert isinstance(slices(with_null, 8, 4)["x"], torch.Tensor)
