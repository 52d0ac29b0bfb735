"""to_torch: which Arrow columns become tensors (sharing memory), and which stay lists."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from spiral_lightning import to_torch


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
            "ragged": pa.array([[1], [2, 3], []]),
            "nulls": pa.array([1.0, None, 3.0]),
            "struct": pa.array([{"a": 1}, {"a": 2}, {"a": 3}]),
        }
    )
    out = to_torch(batch)
    assert out["flag"].dtype == torch.bool and out["flag"].tolist() == [True, False, True]
    assert out["name"] == ["a", "bb", "c"]
    assert out["blob"] == [b"x", b"", b"yz"]
    assert out["ragged"] == [[1], [2, 3], []]
    assert out["nulls"] == [1.0, None, 3.0]
    assert out["struct"] == [{"a": 1}, {"a": 2}, {"a": 3}]
