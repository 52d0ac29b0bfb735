"""Arrow record batches as torch tensors, sharing Arrow's buffers through DLPack where it can."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from itertools import pairwise
from typing import Any, Literal, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.dlpack import from_dlpack

from spiral_lightning.core.sequences import LENGTH_SUFFIX, Padded, is_ragged, pad, per_row, ragged, validity, width

#: What ``to_torch`` makes of a batch: one tensor or list per column, by column name.
Batch = dict[str, Any]

#: What a column's nulls become (see ``Nulls``).
Fill = int | float | bool

#: The name of the validity mask ``to_torch`` adds for a column of ``Nulls.mask``.
VALID_SUFFIX = "_valid"


class Nulls(NamedTuple):
    """What the nulls of columns that become tensors turn into: ``fill[column]`` is the value a
    column's nulls become, and each column of ``mask`` also gets a ``[rows]`` bool tensor
    ``f"{column}_valid"``, True where the row has its whole value; a masked column without a fill
    value holds 0 (False) in its null rows. A null in any other such column raises ``NullError``."""

    fill: Mapping[str, Fill] | None = None
    mask: Sequence[str] = ()


class NullError(ValueError):
    """A null in a column that becomes a tensor, which has no fill value and no mask for it.

    ``column`` and ``position`` (the row within the converted batch) say where; a dataset
    re-raises it naming its table and the row of its stream (see ``located``).
    """

    def __init__(self, message: str, *, column: str = "", position: int = 0, example: Fill = 0) -> None:
        super().__init__(message)
        self.column = column
        self.position = position
        self.example = example

    @classmethod
    def at(cls, column: str, position: int, example: Fill, where: str | None = None) -> NullError:
        """The error for a null in ``column`` at ``position`` of its batch (``where`` names the row
        when the caller knows more); ``example`` is a fill value of the column's type."""
        row = where or f"row {position} of its batch"
        return cls(
            f"column {column!r} is null at {row}, but it becomes a tensor, which holds no nulls; set "
            f"TableSpec(null_fill={{{column!r}: {example!r}}}) to fill its nulls, or null_mask=[{column!r}] for the "
            f"mask {column + VALID_SUFFIX!r} (False in null rows, which then hold 0)",
            column=column,
            position=position,
            example=example,
        )

    def located(self, where: str) -> NullError:
        """This error naming its row as ``where`` (a table and a row of a stream, or an index)."""
        return NullError.at(self.column, self.position, self.example, where)


def check_nulls(nulls: Nulls, schema: pa.Schema, table: str, padded: Sequence[Padded] = ()) -> None:
    """``ValueError`` unless every column ``nulls`` names is a column of ``schema`` (the rows
    ``table`` returns) that becomes a tensor, with a fill value of its type, and every ``padded``
    column is a ragged column of ``schema`` with a pad value of its type."""
    named = [*(nulls.fill or {}), *nulls.mask]
    unknown = sorted({name for name in named if name not in schema.names})
    if unknown:
        raise ValueError(
            f"null_fill and null_mask name columns {unknown} that {table!r} does not return; "
            f"its columns are {schema.names}"
        )
    missing = sorted({projection.column for projection in padded} - set(schema.names))
    if missing:
        raise ValueError(
            f"padded names columns {missing} that {table!r} does not return; its columns are {schema.names}"
        )
    _plans(schema, nulls, padded)


_FIXED_SHAPE_TENSOR = "arrow.fixed_shape_tensor"
#: The field metadata key of a shaped tensor column (see ``to_torch``); its JSON value says
#: whether the values are complex numbers stored as (real, imaginary) pairs.
_SHAPED_TENSOR = b"spiral_lightning.tensor"
#: The canonical Arrow extension of tensors whose shape varies by row (``data``, ``shape``), which
#: Spiral scans produce from image columns.
_VARIABLE_SHAPE_TENSOR = "arrow.variable_shape_tensor"


def to_torch(batch: pa.RecordBatch, nulls: Nulls | None = None, padded: Sequence[Padded] = ()) -> Batch:
    """Each column of ``batch`` as a tensor or a Python list, decided by the schema alone.

    Integer and floating columns become ``[rows]`` tensors, and fixed-size lists of them, nested
    to any depth, ``[rows, size, ...]`` tensors; without nulls both share memory with the batch.
    An ``arrow.fixed_shape_tensor`` column takes its declared shape and dimension order. Booleans
    are copied into ``torch.bool``. Strings, binary, ragged lists and structs stay Python lists,
    with ``None`` for a null.

    A null in a column that becomes a tensor (a null row, or a null inside a fixed-size list)
    becomes the column's fill value in ``nulls``, and a column ``nulls`` masks gains its
    ``<column>_valid`` tensor; a null in any other raises ``NullError`` naming column and row.

    A shaped tensor column (a struct of ``data``, each row's values in C order, and ``shape``,
    marked by the field metadata key ``spiral_lightning.tensor``; the SDS backend writes them)
    becomes one ``[rows, ...]`` tensor when every row has one shape, else a list of per-row
    tensors; marked ``"complex": true``, its trailing dimension of 2 becomes a complex dtype.

    A ragged column that ``padded`` names becomes one padded tensor and its ``<column>_length``
    (see ``Padded``); its nulls follow ``nulls`` as a tensor column's do, a null row counting as
    a row of no values.
    """
    converted: Batch = {}
    for plan, array in zip(_plans(batch.schema, nulls, padded), batch.columns, strict=True):
        if plan.kind == "padded":
            values, lengths, whole = plan.padded_tensor(array)
            converted[plan.name] = values
            converted[plan.name + LENGTH_SUFFIX] = lengths
            if plan.mask:
                converted[plan.name + VALID_SUFFIX] = whole
            continue
        if plan.kind not in ("tensor", "bool"):
            converted[plan.name] = plan.convert(array)
            continue
        tensor, valid = plan.tensor(array)
        converted[plan.name] = tensor
        if plan.mask:
            converted[plan.name + VALID_SUFFIX] = valid
    return converted


class BatchSlices:
    """``to_torch`` of slices of record batches that arrive batch after batch, as the frames cut
    from a stream do: each batch is converted once and a slice of it becomes slices of its
    tensors and lists.

    That equals converting the slice whenever no column's conversion depends on its rows, as the
    schema decides every tensor column's type and fills its nulls value by value. A shaped column
    of mixed shapes (or with a null) converts to lists where some of its slices would convert to
    tensors, and a null that raises must raise for the slice that holds it, so such a batch's
    slices are converted one by one. So are the slices of a batch with a padded column, whose
    width is its slice's longest row (and padding a whole read batch would take far more memory).
    """

    def __init__(self, nulls: Nulls | None = None, padded: Sequence[Padded] = ()) -> None:
        self._nulls = nulls
        self._padded = tuple(padded)
        self._batch: pa.RecordBatch | None = None
        self._whole: Batch | None = None

    def __call__(self, batch: pa.RecordBatch, offset: int, length: int) -> Batch:
        """``to_torch(batch.slice(offset, length), nulls)``."""
        if batch is not self._batch:
            self._batch = batch
            self._whole = sliceable(batch, self._nulls, self._padded)
        whole = self._whole
        if whole is None:
            return to_torch(batch.slice(offset, length), self._nulls, self._padded)
        if offset == 0 and length >= batch.num_rows:
            return dict(whole)
        end = offset + length
        return {name: value[offset:end] for name, value in whole.items()}


def sliceable(batch: pa.RecordBatch, nulls: Nulls | None = None, padded: Sequence[Padded] = ()) -> Batch | None:
    """``to_torch(batch, nulls, padded)`` if each of its slices converts to the same slice of it,
    else ``None``: a shaped column that became a list or a padded column depends on its rows, and
    a null that raises belongs to one slice."""
    if any(plan.kind == "padded" for plan in _plans(batch.schema, nulls, padded)):
        return None
    try:
        whole = to_torch(batch, nulls, padded)
    except NullError:
        return None
    if any(isinstance(whole[plan.name], list) and plan.kind != "list" for plan in _plans(batch.schema, nulls, padded)):
        return None
    return whole


def column(field: pa.Field, array: pa.Array, nulls: Nulls | None = None) -> torch.Tensor | list[Any]:
    """One column as ``to_torch`` converts it (without its mask)."""
    plan = _Plan.of(field, nulls or Nulls())
    return plan.tensor(array)[0] if plan.kind in ("tensor", "bool") else plan.convert(array)


class _Plan(NamedTuple):
    """How one field's arrays convert, decided once per schema rather than once per batch.

    ``kind`` says what the column becomes. A tensor's values sit below one fixed-size list level
    per entry of ``sizes``; ``dims`` is the shape after the row dimension (``None``: keep the
    values flat) and ``order`` the dimensions to permute them into. Its nulls become ``fill``, and
    ``mask`` adds its validity mask (see ``Nulls``).
    """

    name: str
    kind: Literal["tensor", "bool", "list", "shaped", "complex", "padded"]
    extension: bool
    sizes: tuple[int, ...] = ()
    dims: tuple[int, ...] | None = None
    order: tuple[int, ...] | None = None
    fill: Fill | None = None
    mask: bool = False
    #: A fill value of the column's type, which a ``NullError`` suggests.
    example: Fill = 0
    #: How a ragged column pads (kind ``padded``).
    padded: Padded | None = None

    @classmethod
    def of(cls, field: pa.Field, nulls: Nulls, padded: Padded | None = None) -> _Plan:
        plan = cls._of(field) if padded is None else cls._padding(field, padded)
        fill = (nulls.fill or {}).get(field.name)
        mask = field.name in nulls.mask
        if plan.kind not in ("tensor", "bool", "padded"):
            if fill is not None or mask:
                raise ValueError(
                    f"null_fill and null_mask apply to columns that become tensors (numbers, booleans and "
                    f"fixed-size lists of numbers), not to {field.name!r} of type {field.type}, which becomes a "
                    "list with None for its nulls"
                )
            return plan
        leaf = _leaf(field)
        example: Fill = False if plan.kind == "bool" else 0.0 if pa.types.is_floating(leaf) else 0
        checked = None if fill is None else _checked_fill(field.name, fill, leaf)
        return plan._replace(fill=checked, mask=mask, example=example)

    @classmethod
    def _padding(cls, field: pa.Field, padded: Padded) -> _Plan:
        if not is_ragged(field.type):
            raise ValueError(
                f"Padded({field.name!r}) pads a ragged column (a list or large_list of numbers, or of fixed-size "
                f"lists of numbers), not {field.name!r} of type {field.type}"
            )
        _checked_fill(field.name, padded.pad, _leaf(field), "Padded pad")
        return cls(field.name, "padded", False, padded=padded)

    def padded_tensor(self, array: pa.Array) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A padded column, each row's count of values in it, and whether each row has its whole
        value (a null row, or a null among its values, does not)."""
        assert self.padded is not None, "a padded plan has its projection"
        rows = ragged(array)
        invalid = np.zeros(len(rows.lengths), dtype=bool) if rows.rows_valid is None else ~rows.rows_valid
        leaf = rows.leaf
        if leaf.null_count:
            invalid |= per_row(rows, ~validity(leaf))
        if self.fill is None and not self.mask and invalid.any():
            raise NullError.at(self.name, int(np.argmax(invalid)), self.example)
        length = width(rows, self.padded)
        if leaf.null_count:
            leaf = pc.fill_null(leaf, pa.scalar(self.example if self.fill is None else self.fill, leaf.type))
        values = leaf.to_numpy(zero_copy_only=False)
        out, kept = pad(rows, values, length, self.padded.pad, self.padded.out_dtype(values.dtype))
        return torch.from_numpy(out), torch.from_numpy(kept), torch.from_numpy(~invalid)

    @classmethod
    def _of(cls, field: pa.Field) -> _Plan:
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
        """A list or shaped column (a tensor column converts through ``tensor``)."""
        if array.null_count or self.kind == "list":
            return _pylist(array)
        values = array.storage if self.extension else array
        return _shaped(values, self.kind == "complex")

    def tensor(self, array: pa.Array) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A tensor column, and its ``[rows]`` validity mask when the plan masks it."""
        rows = len(array)
        values = array.storage if self.extension else array
        # Where a null lies at any depth, per leaf value; None while there is none, which keeps
        # the column's tensor on Arrow's buffer.
        valid = _validity(values) if values.null_count else None
        for size in self.sizes:
            # The child of a sliced list array is unsliced; cutting it here is cheaper than
            # flatten(), which goes through a compute kernel.
            values = values.values.slice(values.offset * size, len(values) * size)
            if valid is not None:
                valid = np.repeat(valid, size)
            if values.null_count:
                own = _validity(values)
                valid = own if valid is None else valid & own
        rows_valid = None if valid is None else valid.reshape(rows, -1).all(axis=1) if rows else valid
        if rows_valid is not None and self.fill is None and not self.mask:
            raise NullError.at(self.name, int(np.argmin(rows_valid)), self.example)
        fill = self.fill if self.fill is not None else self.example
        if values.null_count:
            values = pc.fill_null(values, pa.scalar(fill, values.type))
        # Arrow packs booleans in bits, which DLPack cannot share.
        bits = self.kind == "bool"
        tensor = torch.from_numpy(values.to_numpy(zero_copy_only=False)) if bits else from_dlpack(values)
        if valid is not None and self.sizes:
            # The values under a null list are undefined, not null.
            tensor = tensor.masked_fill(~torch.from_numpy(valid), fill)
        if self.dims is not None:
            tensor = tensor.reshape(rows, *self.dims)
            if self.order is not None:
                tensor = tensor.permute(self.order)
        if not self.mask:
            return tensor, None
        if rows_valid is None:
            return tensor, torch.ones(rows, dtype=torch.bool)
        return tensor, torch.from_numpy(rows_valid)


#: The last schema, nulls and padded columns converted and their plans: a loader converts batch
#: after batch of one schema, and comparing schemas costs far less than planning them again.
_last: tuple[pa.Schema, Nulls, tuple[Padded, ...], tuple[_Plan, ...]] | None = None


def _plans(schema: pa.Schema, nulls: Nulls | None = None, padded: Sequence[Padded] = ()) -> tuple[_Plan, ...]:
    global _last
    nulls = nulls or Nulls()
    padded = tuple(padded)
    last = _last
    if last is not None and last[1] == nulls and last[2] == padded and last[0].equals(schema, check_metadata=True):
        return last[3]
    by_column = {projection.column: projection for projection in padded}
    plans = tuple(_Plan.of(field, nulls, by_column.get(field.name)) for field in schema)
    added = [plan.name + VALID_SUFFIX for plan in plans if plan.mask]
    added += [plan.name + LENGTH_SUFFIX for plan in plans if plan.kind == "padded"]
    taken = set(added) & set(schema.names)
    if taken:
        raise ValueError(
            f"null_mask and padded would add the columns {sorted(taken)}, which the table already has; "
            "rename them or select other columns"
        )
    _last = (schema, nulls, padded, plans)
    return plans


def _validity(array: pa.Array) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """True where ``array`` holds a value."""
    valid: np.ndarray[Any, np.dtype[np.bool_]] = pc.is_valid(array).to_numpy(zero_copy_only=False)
    return valid


def _leaf(field: pa.Field) -> pa.DataType:
    """The type of a tensor column's values, below its fixed-size lists (and the list of a
    ragged column)."""
    values = field.type.storage_type if isinstance(field.type, pa.BaseExtensionType) else field.type
    if pa.types.is_list(values) or pa.types.is_large_list(values):
        values = values.value_type
    while pa.types.is_fixed_size_list(values):
        values = values.value_type
    return values


def _checked_fill(column: str, fill: Any, leaf: pa.DataType, option: str = "null_fill") -> Fill:
    """``fill`` when it is a value of ``leaf`` (a bool for booleans, an int in range for integers,
    any number for floats), else ``ValueError`` naming the column and the ``option`` it came from."""
    if pa.types.is_boolean(leaf):
        fits = isinstance(fill, bool)
    elif pa.types.is_integer(leaf):
        fits = isinstance(fill, int) and not isinstance(fill, bool)
    else:
        fits = isinstance(fill, int | float) and not isinstance(fill, bool)
    if fits:
        try:
            pa.scalar(fill, leaf)
        except (OverflowError, pa.ArrowInvalid):
            fits = False
    if not fits:
        raise ValueError(f"{option} for column {column!r} must be a value of its type {leaf}, not {fill!r}")
    checked: Fill = fill
    return checked


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
