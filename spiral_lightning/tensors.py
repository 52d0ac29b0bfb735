"""Arrow record batches as torch tensors, sharing Arrow's buffers through DLPack where it can."""

from __future__ import annotations

import json
from typing import Any, Literal, NamedTuple

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
    plans = _plans(batch.schema)
    return {plan.name: plan.convert(array) for plan, array in zip(plans, batch.columns, strict=True)}


def column(field: pa.Field, array: pa.Array) -> torch.Tensor | list[Any]:
    """One column as ``to_torch`` converts it."""
    return _Plan.of(field).convert(array)


class _Plan(NamedTuple):
    """How one field's arrays convert, decided once per schema rather than once per batch.

    ``kind`` says what a column without nulls becomes. A tensor's values sit below one
    fixed-size list level per entry of ``sizes``; ``dims`` is the shape after the row dimension
    (``None``: keep the values flat) and ``order`` the dimensions to permute them into.
    """

    name: str
    kind: Literal["tensor", "bool", "list"]
    extension: bool
    sizes: tuple[int, ...] = ()
    dims: tuple[int, ...] | None = None
    order: tuple[int, ...] | None = None

    @classmethod
    def of(cls, field: pa.Field) -> _Plan:
        extension = isinstance(field.type, pa.BaseExtensionType)
        storage = field.type.storage_type if extension else field.type
        if pa.types.is_boolean(storage):
            return cls(field.name, "bool", extension)
        sizes: list[int] = []
        values = storage
        while pa.types.is_fixed_size_list(values):
            sizes.append(values.list_size)
            values = values.value_type
        if not (pa.types.is_integer(values) or pa.types.is_floating(values)):
            return cls(field.name, "list", extension)
        shape, permutation = _declared_shape(field)
        if shape is None:
            return cls(field.name, "tensor", extension, tuple(sizes), tuple(sizes) if sizes else None)
        if permutation is None:
            return cls(field.name, "tensor", extension, tuple(sizes), tuple(shape))
        physical = tuple(shape[axis] for axis in permutation)
        inverse = sorted(range(len(permutation)), key=permutation.__getitem__)
        return cls(field.name, "tensor", extension, tuple(sizes), physical, (0, *(axis + 1 for axis in inverse)))

    def convert(self, array: pa.Array) -> torch.Tensor | list[Any]:
        if array.null_count or self.kind == "list":
            return _pylist(array)
        values = array.storage if self.extension else array
        if self.kind == "bool":
            return torch.from_numpy(values.to_numpy(zero_copy_only=False))
        for size in self.sizes:
            # The child of a sliced list array is unsliced; cutting it here is cheaper than
            # flatten(), which goes through a compute kernel.
            values = values.values.slice(values.offset * size, len(values) * size)
            if values.null_count:
                return _pylist(array)
        tensor = from_dlpack(values)
        if self.dims is None:
            return tensor
        tensor = tensor.reshape(len(array), *self.dims)
        return tensor if self.order is None else tensor.permute(self.order)


#: The last schema converted and its plans: a loader converts batch after batch of one schema,
#: and comparing schemas costs far less than planning them again.
_last: tuple[pa.Schema, tuple[_Plan, ...]] | None = None


def _plans(schema: pa.Schema) -> tuple[_Plan, ...]:
    global _last
    last = _last
    if last is not None and last[0].equals(schema, check_metadata=True):
        return last[1]
    plans = tuple(_Plan.of(field) for field in schema)
    _last = (schema, plans)
    return plans


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
