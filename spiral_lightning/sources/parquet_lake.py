"""A Parquet table read as a data lake is: files whose schemas differ, and hive partition folders.

A table's schema is the union of its files' columns, in the order they are first seen (files in
path order), then the partition keys of its folders. A column a file lacks reads as nulls in that
file's rows; a column whose types differ across files reads as the type every file's type widens
to without loss (``int32`` and ``int64`` as ``int64``, ``float`` and ``double`` as ``double``,
``string`` and ``large_string`` as ``large_string``, ...). Types that do not widen to one type are
a conflict, refused (naming both files, the column and both types) only when the column is read.

A path segment ``key=value`` below the table's root (a folder, or a glob's folder before its
first wildcard) gives each row of the files under it the column ``key`` with that value: ``int64``
when every value of the key parses as an integer, else ``string`` (``__HIVE_DEFAULT_PARTITION__``
is a null, as Hive and Spark write it; a file outside any ``key=`` folder reads a null too).
Since such values, and the nulls of a missing column, are constant in a file, the conjuncts of a
filter that read only them decide per file whether any of its rows can be kept (``kept_files``),
and the source leaves the files they exclude out of its plan; ``arrow_filter`` gives the
expression that keeps the rows of the files it reads.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple, TypeVar
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from spiral_lightning.core import filters

#: The value of a partition folder that stands for a null (Hive's and Spark's).
NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"

#: Bits of an integer each float type holds exactly.
_MANTISSA = {16: 11, 32: 24, 64: 53}

_INTEGER = re.compile(r"-?[0-9]+")

Data = TypeVar("Data", pa.RecordBatch, pa.Table)

#: A partition value: a string, an integer, or null.
Value = int | str | None


def partition_root(path: str) -> str:
    """The folder below which ``key=value`` segments name partitions: a glob's folder before its
    first wildcard, else the path the uri names (a single file has no segment below itself)."""
    if any(mark in path for mark in "*?["):
        return path[: min(path.index(mark) for mark in "*?[" if mark in path)].rsplit("/", 1)[0]
    return path.rstrip("/")


def partitions_of(root: str, path: str) -> list[tuple[str, str | None]]:
    """The ``key=value`` folders of ``path`` below ``root``, outermost first, values unquoted."""
    if not path.startswith(f"{root}/"):
        return []
    found: list[tuple[str, str | None]] = []
    for segment in path[len(root) + 1 :].split("/")[:-1]:
        key, equals, value = segment.partition("=")
        if equals and key:
            text = unquote(value)
            found.append((unquote(key), None if text == NULL_PARTITION else text))
    return found


class Lake(NamedTuple):
    """The union schema of a version's files and what each file holds of it."""

    #: Every column: the files' columns in first-seen order, then the partition keys.
    schema: pa.Schema
    #: Each file's own schema (equal schemas shared).
    stored: tuple[pa.Schema, ...]
    #: Each file's partition values, by key (every key, ``None`` where the file has no folder).
    partitions: tuple[dict[str, Value], ...]
    #: Why a column cannot be read, by column: types that do not widen, or a key twice.
    conflicts: dict[str, str]

    @classmethod
    def of(cls, paths: Sequence[str], schemas: Sequence[pa.Schema], root: str) -> Lake:
        fields: dict[str, pa.Field] = {}
        origin: dict[str, str] = {}
        conflicts: dict[str, str] = {}
        shared: dict[pa.Schema, pa.Schema] = {}
        for path, schema in zip(paths, schemas, strict=True):
            schema = shared.setdefault(schema, schema)
            for field in schema:
                name, current = field.name, fields.get(field.name)
                if current is None:
                    fields[name], origin[name] = field, path
                elif name not in conflicts and not current.type.equals(field.type):
                    unified = widened(current.type, field.type)
                    if unified is None:
                        conflicts[name] = (
                            f"column {name!r} is {current.type} in {origin[name]!r} but {field.type} in {path!r}, "
                            "types that do not widen to one type without loss; rewrite one of the files with the "
                            "other's type, or select columns without it"
                        )
                    elif not unified.equals(current.type):
                        fields[name], origin[name] = current.with_type(unified), path
        stored = tuple(shared[schema] for schema in schemas)
        # A column is not nullable only when every file stores it as not nullable.
        required = {name for name in fields if all(name in s.names and not s.field(name).nullable for s in shared)}
        union = [field if name in required else field.with_nullable(True) for name, field in fields.items()]
        raw = [partitions_of(root, path) for path in paths]
        keys = list(dict.fromkeys(key for found in raw for key, _ in found))
        for path, found in zip(paths, raw, strict=True):
            for key in {key for key, _ in found if [k for k, _ in found].count(key) > 1}:
                conflicts.setdefault(key, f"{path!r} is in more than one folder of the partition key {key!r}")
        for key in keys:
            if key in fields:
                conflicts.setdefault(
                    key, f"{key!r} is a partition folder of the table and a column stored in {origin[key]!r}"
                )
        partition_keys = [key for key in keys if key not in fields]
        texts = [dict(found) for found in raw]
        values: list[dict[str, Value]] = [{} for _ in paths]
        for key in partition_keys:
            given = [found.get(key) for found in texts]
            numbers = all(text is None or (_INTEGER.fullmatch(text) and abs(int(text)) < 1 << 63) for text in given)
            kind = pa.int64() if numbers and any(text is not None for text in given) else pa.string()
            union.append(pa.field(key, kind))
            for value, text in zip(values, given, strict=True):
                value[key] = int(text) if numbers and text is not None else text
        metadata = schemas[0].metadata if schemas else None
        return cls(pa.schema(union, metadata=metadata), stored, tuple(values), conflicts)

    def check(self, columns: Sequence[str], uri: str) -> None:
        """``ValueError`` when a column of ``columns`` cannot be read."""
        for name in columns:
            if name in self.conflicts:
                raise ValueError(f"cannot read {uri!r}: {self.conflicts[name]}")

    def columns_in(self, file: int, columns: Sequence[str]) -> list[str]:
        """The columns of ``columns`` that file ``file`` stores."""
        names = self.stored[file].names
        return [name for name in columns if name in names]

    def conform(self, file: int, data: Data, schema: pa.Schema) -> Data:
        """``data`` read from file ``file`` as columns of ``schema``: partition values and the
        nulls of missing columns added, other types widened."""
        partitions = self.partitions[file]
        if not partitions and data.schema.equals(schema):
            return data  # the file has every column, each of its type: most tables, every batch
        rows, arrays = data.num_rows, []
        index = {name: position for position, name in enumerate(data.schema.names)}
        for field in schema:
            if field.name in partitions:
                arrays.append(constant(partitions[field.name], field.type, rows))
            elif field.name not in index:
                arrays.append(pa.nulls(rows, field.type))
            else:
                column = data.column(index[field.name])
                arrays.append(column if column.type.equals(field.type) else column.cast(field.type))
        return type(data).from_arrays(arrays, schema=schema)

    def constant(self, file: int) -> set[str]:
        """The columns whose value is the same in every row of file ``file``."""
        return set(self.partitions[file]) | (set(self.schema.names) - set(self.stored[file].names))

    def kept_files(self, tree: filters.Filter, text: str) -> list[bool]:
        """Whether each file may hold rows ``tree`` keeps: False when a conjunct of it reads only
        columns constant in the file and holds for none of their values."""
        parts = conjuncts(tree)
        needs = [filters.columns(part) for part in parts]
        compiled: dict[int, pc.Expression] = {}
        decided: dict[tuple[int, tuple[Value, ...]], bool] = {}
        kept = []
        for file in range(len(self.stored)):
            constant, keep = self.constant(file), True
            for index, (part, columns) in enumerate(zip(parts, needs, strict=True)):
                if not keep or not columns <= constant:
                    continue
                names = sorted(columns)
                given = tuple(self.partitions[file].get(name) for name in names)
                if (index, given) not in decided:
                    if index not in compiled:
                        compiled[index] = filters.to_arrow(part, self.schema, text)
                    fields = pa.schema([self.schema.field(name) for name in names])
                    values = [pa.array([value], field.type) for field, value in zip(fields, given, strict=True)]
                    row = pa.table(values, schema=fields)
                    decided[index, given] = row.filter(compiled[index]).num_rows > 0
                keep = decided[index, given]
            kept.append(keep)
        return kept


def constant(value: Value, kind: pa.DataType, rows: int) -> pa.Array:
    """``rows`` copies of a partition value, built from buffers (``pa.repeat`` is far slower)."""
    if value is None:
        return pa.nulls(rows, kind)
    if isinstance(value, int):
        return pa.array(np.full(rows, value, dtype=np.int64), kind)
    encoded = value.encode()
    if rows * len(encoded) >= 1 << 31:
        return pa.repeat(pa.scalar(value, kind), rows)
    offsets = np.arange(rows + 1, dtype=np.int32) * len(encoded)
    return pa.Array.from_buffers(kind, rows, [None, pa.py_buffer(offsets), pa.py_buffer(encoded * rows)])


def conjuncts(tree: filters.Filter) -> list[filters.Filter]:
    """The parts of ``tree`` joined by its outermost ``AND``s."""
    if isinstance(tree, filters.And):
        return conjuncts(tree.left) + conjuncts(tree.right)
    return [tree]


def widened(first: pa.DataType, second: pa.DataType) -> pa.DataType | None:
    """The type both types widen to without loss, or None when there is none."""
    if pa.types.is_dictionary(first) and pa.types.is_dictionary(second):
        first, second = first.value_type, second.value_type
    if first.equals(second):
        return first
    try:
        unified = pa.unify_schemas(
            [pa.schema([pa.field("x", first)]), pa.schema([pa.field("x", second)])], promote_options="permissive"
        ).field(0)
    except (pa.ArrowException, TypeError):
        unified = None
    if unified is None and (pa.types.is_dictionary(first) or pa.types.is_dictionary(second)):
        decoded = [kind.value_type if pa.types.is_dictionary(kind) else kind for kind in (first, second)]
        return widened(decoded[0], decoded[1])
    if unified is None or not (lossless(first, unified.type) and lossless(second, unified.type)):
        return None
    return unified.type


def lossless(source: pa.DataType, target: pa.DataType) -> bool:
    """Whether every value of ``source`` casts to ``target`` and back unchanged."""
    types = pa.types
    if source.equals(target) or types.is_null(source):
        return True
    if types.is_dictionary(source):
        return lossless(source.value_type, target)
    if types.is_integer(source) and types.is_integer(target):
        # A signed type holds an unsigned one of fewer bits; an unsigned type holds no signed one.
        room = source.bit_width < target.bit_width or (
            source.bit_width == target.bit_width and types.is_signed_integer(source)
        )
        return bool(room if types.is_signed_integer(target) else types.is_unsigned_integer(source) and room)
    if types.is_integer(source) and types.is_floating(target):
        return bool(source.bit_width < _MANTISSA[target.bit_width])
    if types.is_floating(source) and types.is_floating(target):
        return bool(source.bit_width <= target.bit_width)
    if (types.is_string(source) and types.is_large_string(target)) or (
        types.is_binary(source) and types.is_large_binary(target)
    ):
        return True
    if types.is_timestamp(source) and types.is_timestamp(target):
        units = ["s", "ms", "us", "ns"]
        return bool(source.tz == target.tz and units.index(source.unit) <= units.index(target.unit))
    if types.is_fixed_size_list(source) or types.is_fixed_size_list(target):
        same = types.is_fixed_size_list(source) and types.is_fixed_size_list(target)
        return bool(same and source.list_size == target.list_size and lossless(source.value_type, target.value_type))
    lists = (types.is_list(source) or types.is_large_list(source), types.is_list(target) or types.is_large_list(target))
    if all(lists):
        narrowed = types.is_large_list(source) and types.is_list(target)
        return not narrowed and lossless(source.value_type, target.value_type)
    if types.is_struct(source) and types.is_struct(target):
        names = [target.field(index).name for index in range(target.num_fields)]
        return all(
            field.name in names and lossless(field.type, target.field(field.name).type)
            for field in (source.field(index) for index in range(source.num_fields))
        )
    return False


def arrow_filter(condition: object, schema: pa.Schema) -> tuple[pc.Expression | None, list[str]]:
    """The pyarrow expression for a spec's filter and the columns it reads."""
    if condition is None:
        return None, []
    if isinstance(condition, str):
        tree = filters.parse(condition)
        return filters.to_arrow(tree, schema, condition), sorted(filters.columns(tree))
    if isinstance(condition, pc.Expression):
        # A native expression does not list its columns, so counting reads every column.
        return condition, list(schema.names)
    raise TypeError(
        "a Parquet table's filter is filter-language text or a pyarrow.compute.Expression, "
        f"not {type(condition).__name__}"
    )
