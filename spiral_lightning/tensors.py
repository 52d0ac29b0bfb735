"""Arrow record batches as torch tensors, sharing Arrow's buffers through DLPack where it can."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import torch
from torch.utils.dlpack import from_dlpack

#: What ``to_torch`` makes of a batch: one tensor or list per column, by column name.
Batch = dict[str, Any]

_FIXED_SHAPE_TENSOR = "arrow.fixed_shape_tensor"


def to_torch(batch: pa.RecordBatch) -> Batch:
    """Each column of ``batch`` as a tensor or a Python list.

    Integer and floating columns become ``[rows]`` tensors, and fixed-size lists of them, nested
    to any depth, ``[rows, size, ...]`` tensors; both share memory with the batch. An
    ``arrow.fixed_shape_tensor`` column takes its declared shape and dimension order. Booleans are
    copied into ``torch.bool``. Strings, binary, ragged lists, structs and any column with nulls
    stay Python lists.
    """
    return {field.name: column(field, batch.column(index)) for index, field in enumerate(batch.schema)}


def column(field: pa.Field, array: pa.Array) -> torch.Tensor | list[Any]:
    """One column as ``to_torch`` converts it."""
    if array.null_count:
        return _pylist(array)
    storage = array.storage if isinstance(array, pa.ExtensionArray) else array
    if pa.types.is_boolean(storage.type):
        return torch.from_numpy(storage.to_numpy(zero_copy_only=False))
    sizes: list[int] = []
    values = storage
    while pa.types.is_fixed_size_list(values.type):
        if values.null_count:
            return _pylist(array)
        sizes.append(values.type.list_size)
        values = values.flatten()
    if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)) or values.null_count:
        return _pylist(array)
    tensor = from_dlpack(values)
    shape, permutation = _declared_shape(field)
    rows = len(array)
    if shape is None:
        return tensor.reshape(rows, *sizes) if sizes else tensor
    if permutation is None:
        return tensor.reshape(rows, *shape)
    physical = tensor.reshape(rows, *(shape[axis] for axis in permutation))
    inverse = sorted(range(len(permutation)), key=permutation.__getitem__)
    return physical.permute(0, *(axis + 1 for axis in inverse))


def _declared_shape(field: pa.Field) -> tuple[list[int] | None, list[int] | None]:
    """The logical shape and permutation of an ``arrow.fixed_shape_tensor`` column, registered
    with pyarrow as an extension type or carried only in the field's metadata."""
    if isinstance(field.type, pa.FixedShapeTensorType):
        permutation = field.type.permutation
        return list(field.type.shape), None if permutation is None else list(permutation)
    metadata = field.metadata or {}
    if metadata.get(b"ARROW:extension:name") != _FIXED_SHAPE_TENSOR.encode():
        return None, None
    declared = json.loads(metadata.get(b"ARROW:extension:metadata") or b"{}")
    if "shape" not in declared:
        return None, None
    permutation = declared.get("permutation")
    return list(declared["shape"]), None if permutation is None else list(permutation)


def _pylist(array: pa.Array) -> list[Any]:
    values: list[Any] = array.to_pylist()
    return values
