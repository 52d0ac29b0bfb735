"""SDS records as Arrow columns: each field's shape and type (shaped tensors as fixed-size lists
with their shape kept), and each metadata key's column type."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import signal_dataset as sds

#: The field metadata key that marks a shaped tensor column; its value is JSON with ``complex``
#: and ``dim_names``. ``to_torch`` reads the same key.
TENSOR_KEY = b"spiral_lightning.tensor"


class TensorField(NamedTuple):
    """How a field's arrays become a shaped tensor column: the stored dtype (native byte order),
    the value dtype of the column (a complex dtype's real part), and the rank of its arrays."""

    dtype: np.dtype[Any]
    values: np.dtype[Any]
    rank: int

    @property
    def complex(self) -> bool:
        return self.dtype.kind == "c"


def tensor_field(name: str, field: sds.FieldMetadata, uri: str) -> tuple[TensorField, pa.Field]:
    """The layout and Arrow field of SDS field ``name`` as the first record declares it."""
    dtype = np.dtype(field.dtype).newbyteorder("=")
    if dtype.kind not in "iufc":
        raise ValueError(
            f"field {name!r} of {uri!r} has dtype {dtype}; the SDS backend reads integer, float and complex fields"
        )
    values = np.dtype(f"f{dtype.itemsize // 2}") if dtype.kind == "c" else dtype
    layout = TensorField(dtype, values, len(field.shape))
    dims = [axis.name for axis in field.axes] + (["real_imag"] if layout.complex else [])
    storage = pa.struct(
        [
            pa.field("data", pa.large_list(pa.from_numpy_dtype(values))),
            pa.field("shape", pa.list_(pa.int32(), len(dims))),
        ]
    )
    marker = json.dumps({"complex": layout.complex, "dim_names": dims})
    return layout, pa.field(name, storage, nullable=False, metadata={TENSOR_KEY: marker.encode()})


def key_type(value: Any) -> pa.DataType:
    """The column type of a metadata key whose first record's value is ``value``."""
    if isinstance(value, bool):
        return pa.bool_()
    if isinstance(value, int):
        return pa.int64()
    if isinstance(value, float):
        return pa.float64()
    return pa.string()


#: The Python types each numeric metadata column takes (ints widen into a float64 column).
ACCEPTED: dict[int, type | tuple[type, ...]] = {
    pa.bool_().id: bool,
    pa.int64().id: int,
    pa.float64().id: (int, float),
}


def text_of(value: Any) -> str | None:
    """A metadata value of a string column: strings as they are, other JSON values as JSON text."""
    return value if value is None or isinstance(value, str) else json.dumps(plain_value(value))


def plain_value(value: Any) -> Any:
    """A frozen JSON value (tuples, read-only mappings) as the plain one ``json`` writes."""
    if isinstance(value, Mapping):
        return {key: plain_value(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return [plain_value(item) for item in value]
    return value


class Layout(NamedTuple):
    """The full schema of a dataset's rows and how to build each column from records."""

    schema: pa.Schema
    tensors: dict[str, TensorField]
    keys: dict[str, pa.DataType]

    @classmethod
    def of(cls, first: sds.RecordMetadata | None, uri: str) -> Layout:
        if first is None:
            return cls(pa.schema([pa.field("id", pa.string(), nullable=False)]), {}, {})
        tensors: dict[str, TensorField] = {}
        fields = [pa.field("id", pa.string(), nullable=False)]
        for name, declared in first.fields.items():
            tensors[name], field = tensor_field(name, declared, uri)
            fields.append(field)
        keys = {name: key_type(value) for name, value in first.metadata.items()}
        fields += [pa.field(name, kind) for name, kind in keys.items()]
        names = [field.name for field in fields]
        clashes = sorted({name for name in names if names.count(name) > 1})
        if clashes:
            raise ValueError(
                f"{uri!r} has fields and metadata keys named {clashes}, which would be two columns of one name "
                "(the record id is the column 'id')"
            )
        return cls(pa.schema(fields), tensors, keys)

    def column(self, name: str, records: Sequence[sds.Record | sds.RecordMetadata]) -> pa.Array:
        """Column ``name`` of ``records`` (full records for a field column)."""
        if name == "id":
            return pa.array([record.id for record in records], pa.string())
        if name in self.tensors:
            # Field columns are built only from full records; metadata carries no samples.
            return shaped_column(name, self.tensors[name], records)  # type: ignore[arg-type]
        kind = self.keys[name]
        values = [record.metadata.get(name) for record in records]
        if kind == pa.string():
            return pa.array([text_of(value) for value in values], kind)
        # pyarrow would truncate 0.5 into an int64 column without a word; check the types first.
        accepted = ACCEPTED[kind.id]
        for record, value in zip(records, values, strict=True):
            if value is not None and (
                isinstance(value, bool) != (kind == pa.bool_()) or not isinstance(value, accepted)
            ):
                raise ValueError(
                    f"metadata key {name!r} of record {record.id!r} is {value!r}, but the column is {kind} (from the "
                    "dataset's first record); one key keeps one type in every record"
                )
        return pa.array(values, kind)


def shaped_column(name: str, layout: TensorField, records: Sequence[sds.Record]) -> pa.StructArray:
    """Field ``name`` of ``records`` as a shaped tensor column: every array copied once, into
    one buffer that the column (and the tensors made from it) own."""
    arrays = []
    for record in records:
        try:
            data = record.fields[name].data
        except KeyError:
            raise ValueError(f"record {record.id!r} has no field {name!r}, which the first record has") from None
        if data.ndim != layout.rank or data.dtype.newbyteorder("=") != layout.dtype:
            raise ValueError(
                f"field {name!r} of record {record.id!r} is {data.dtype}{list(data.shape)}, but the first "
                f"record's is {layout.dtype} of rank {layout.rank}; one column holds one dtype and rank"
            )
        arrays.append(data.reshape(-1))
    flat = np.concatenate(arrays, dtype=layout.dtype) if arrays else np.empty(0, layout.dtype)
    pairs = 2 if layout.complex else 1
    offsets = np.zeros(len(arrays) + 1, np.int64)
    np.cumsum([array.size * pairs for array in arrays], out=offsets[1:])
    shapes = [(*record.fields[name].data.shape, *((2,) if layout.complex else ())) for record in records]
    data_array = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat.view(layout.values)))
    shape_array = pa.array(shapes, pa.list_(pa.int32(), layout.rank + (pairs - 1)))
    return pa.StructArray.from_arrays([data_array, shape_array], names=["data", "shape"])
