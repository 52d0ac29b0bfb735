"""Arrow record batches as torch tensors, sharing Arrow's buffers through DLPack where it can."""

from __future__ import annotations

import json
from itertools import pairwise
from typing import Any, Literal, NamedTuple

import pyarrow as pa
import torch
from torch.utils.dlpack import from_dlpack

#: What ``to_torch`` makes of a batch: one tensor or list per column, by column name.
Batch = dict[str, Any]

_FIXED_SHAPE_TENSOR = "arrow.fixed_shape_tensor"
#: The field metadata key of a shaped tensor column (see ``to_torch``); its JSON value says
#: whether the values are complex numbers stored as (real, imaginary) pairs.
_SHAPED_TENSOR = b"spiral_lightning.tensor"
#: The canonical Arrow extension of tensors whose shape varies by row (``data``, ``shape``), which
#: Spiral scans produce from image columns.
_VARIABLE_SHAPE_TENSOR = "arrow.variable_shape_tensor"


def to_torch(batch: pa.RecordBatch) -> Batch:
    """Each column of ``batch`` as a tensor or a Python list.

    Integer and floating columns become ``[rows]`` tensors, and fixed-size lists of them, nested
    to any depth, ``[rows, size, ...]`` tensors; both share memory with the batch. An
    ``arrow.fixed_shape_tensor`` column takes its declared shape and dimension order. Booleans are
    copied into ``torch.bool``. Strings, binary, ragged lists, structs and any column with nulls
    stay Python lists.

    A shaped tensor column (a struct of ``data``, each row's values in C order, and ``shape``,
    marked by the field metadata key ``spiral_lightning.tensor``; the SDS backend writes them)
    becomes one ``[rows, ...]`` tensor when every row has one shape, else a list of per-row
    tensors; marked ``"complex": true``, its trailing dimension of 2 becomes a complex dtype.
    """
    plans = _plans(batch.schema)
    return {plan.name: plan.convert(array) for plan, array in zip(plans, batch.columns, strict=True)}


class BatchSlices:
    """``to_torch`` of slices of record batches that arrive batch after batch, as the frames cut
    from a stream do: each batch is converted once and a slice of it becomes slices of its
    tensors and lists.

    That equals converting the slice whenever no column's conversion depends on its rows: a
    batch with nulls in a numeric column, or a shaped column of mixed shapes, converts to lists
    where some of its slices would convert to tensors, so its slices are converted one by one.
    """

    def __init__(self) -> None:
        self._batch: pa.RecordBatch | None = None
        self._whole: Batch | None = None

    def __call__(self, batch: pa.RecordBatch, offset: int, length: int) -> Batch:
        """``to_torch(batch.slice(offset, length))``."""
        if batch is not self._batch:
            self._batch = batch
            self._whole = _sliceable(batch)
        whole = self._whole
        if whole is None:
            return to_torch(batch.slice(offset, length))
        if offset == 0 and length >= batch.num_rows:
            return dict(whole)
        end = offset + length
        return {name: value[offset:end] for name, value in whole.items()}


def _sliceable(batch: pa.RecordBatch) -> Batch | None:
    """``to_torch(batch)`` if each of its slices converts to the same slice of it, else ``None``:
    a column that became a list although its kind makes tensors depends on its rows."""
    whole = to_torch(batch)
    if any(isinstance(whole[plan.name], list) and plan.kind != "list" for plan in _plans(batch.schema)):
        return None
    return whole


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
    kind: Literal["tensor", "bool", "list", "shaped", "complex"]
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
        shaped = (field.metadata or {}).get(_SHAPED_TENSOR)
        if shaped is not None and pa.types.is_struct(storage):
            return cls(field.name, "complex" if json.loads(shaped).get("complex") else "shaped", extension)
        if _extension_name(field) == _VARIABLE_SHAPE_TENSOR and pa.types.is_struct(storage):
            return cls(field.name, "shaped", extension)
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
        if self.kind in ("shaped", "complex"):
            return _shaped(values, self.kind == "complex")
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


def _shaped(array: pa.StructArray, pairs: bool) -> torch.Tensor | list[Any]:
    """A shaped tensor column: one tensor over the rows' values, stacked when the rows share one
    shape, else cut into per-row tensors; ``pairs`` views trailing (real, imaginary) as complex."""
    data, shape = array.flatten()
    if not len(array):
        return []
    offsets = data.offsets.to_numpy()
    # Sliced arrays keep their children whole; the offsets and list sizes say which part is ours.
    values = from_dlpack(data.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0])))
    rank = shape.type.list_size
    shapes = shape.values.slice(shape.offset * rank, len(shape) * rank).to_numpy().reshape(len(shape), rank)
    if (shapes == shapes[0]).all():
        stacked = values.reshape(len(array), *shapes[0].tolist())
        return torch.view_as_complex(stacked) if pairs else stacked
    starts = (offsets - offsets[0]).tolist()
    cuts = zip(pairwise(starts), shapes.tolist(), strict=True)
    rows = [values[begin:end].reshape(*dims) for (begin, end), dims in cuts]
    return [torch.view_as_complex(row) for row in rows] if pairs else rows


def _extension_name(field: pa.Field) -> str:
    """A field's Arrow extension name, registered with pyarrow as a type or only in its metadata."""
    if isinstance(field.type, pa.BaseExtensionType):
        return str(field.type.extension_name)
    name: bytes = (field.metadata or {}).get(b"ARROW:extension:name", b"")
    return name.decode()


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
