"""Padded sequences: a ragged column of numbers as one ``[rows, L]`` tensor and each row's length.

A ragged column holds a list of numbers per row (``list`` or ``large_list``, of numbers or of
fixed-size lists of numbers), of any length: the token ids of a text, the samples of a
recording. Padding puts each row's values first in a row of ``L`` and fills the rest with a pad
value, so rows of different lengths stack; the lengths say where each row's values end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np
import pyarrow as pa

from spiral_lightning.core.checks import check_positive

#: What happens to a row longer than ``Padded.max_length``: an error, or its values past the
#: maximum are dropped.
Overflow = Literal["raise", "truncate"]
OVERFLOW: tuple[Overflow, ...] = ("raise", "truncate")

#: The name of the ``[rows]`` lengths tensor a padded column adds: ``<column>_length``.
LENGTH_SUFFIX = "_length"


@dataclass(frozen=True)
class Padded:
    """A ragged column padded into one tensor: ``[rows, L]``, or ``[rows, L, D, ...]`` for a list
    of fixed-size lists, beside ``<column>_length``, the ``[rows]`` int64 count of each row's
    values in it.

    ``L`` is the batch's longest row, at most ``max_length``; ``fixed=True`` makes ``L`` equal
    ``max_length`` in every batch (static shapes, for compiled models). A row longer than
    ``max_length`` raises, naming table, column and row, or with ``overflow="truncate"`` keeps its
    first ``max_length`` values. The places after a row's values hold ``pad``, a value of the
    column's type. A column of integers (token ids) becomes int64, as packed tokens and torch's
    losses take them; any other keeps its number type; ``dtype`` (a numpy name such as
    ``"int32"`` or ``"float16"``) asks for another.

        spec = TableSpec("parquet:corpus", padded=[Padded("tokens", max_length=512, pad=-1)])
        batch = next(iter(TableDataset(spec, batch_size=8)))
        batch["tokens"]  # int64 [8, L], L the batch's longest row; batch["tokens_length"]: [8]
    """

    column: str
    max_length: int | None = None
    fixed: bool = False
    pad: int | float = 0
    overflow: Overflow = "raise"
    dtype: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.column, str) or not self.column:
            raise ValueError(f"Padded needs the name of a ragged column, not {self.column!r}")
        limit = self.max_length
        if limit is not None:
            check_positive(f"Padded({self.column!r}) max_length", limit, "or None")
        if self.fixed and limit is None:
            raise ValueError(f"Padded({self.column!r}, fixed=True) pads to max_length, so it needs one")
        if isinstance(self.pad, bool) or not isinstance(self.pad, int | float):
            raise ValueError(f"Padded({self.column!r}) pad must be a number, not {self.pad!r}")
        if self.overflow not in OVERFLOW:
            raise ValueError(f"Padded({self.column!r}) overflow must be one of {OVERFLOW}, not {self.overflow!r}")
        if self.dtype is not None:
            try:
                number = np.issubdtype(np.dtype(self.dtype), np.number)
            except TypeError:
                number = False
            if not number:
                raise ValueError(
                    f"Padded({self.column!r}) dtype must name a numpy number type such as 'int32', not {self.dtype!r}"
                )

    def out_dtype(self, values: np.dtype[Any]) -> np.dtype[Any]:
        """The type of the padded tensor of a column whose values are of type ``values``."""
        if self.dtype is not None:
            return np.dtype(self.dtype)
        return np.dtype(np.int64) if np.issubdtype(values, np.integer) else values


class TooLong(ValueError):
    """A row longer than its padded column's ``max_length`` with ``overflow="raise"``.

    ``position`` is the row within the converted batch; a dataset re-raises it naming its table
    and the row of its stream (see ``located``).
    """

    def __init__(self, padded: Padded, position: int, length: int, where: str | None = None) -> None:
        row = where or f"row {position} of its batch"
        super().__init__(
            f"column {padded.column!r} has {length} values at {row}, more than Padded(max_length="
            f"{padded.max_length}); raise max_length, set overflow='truncate' to keep the first "
            f"{padded.max_length}, or filter the long rows out"
        )
        self.padded = padded
        self.position = position
        self.length = length

    def located(self, where: str) -> TooLong:
        """This error naming its row as ``where`` (a table and a row of a stream, or an index)."""
        return TooLong(self.padded, self.position, self.length, where)


def is_ragged(kind: pa.DataType) -> bool:
    """Whether a column of type ``kind`` can be padded: a list or large list of numbers, or of
    fixed-size lists (nested) of numbers."""
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        return False
    values = kind.value_type
    while pa.types.is_fixed_size_list(values):
        values = values.value_type
    return bool(pa.types.is_integer(values) or pa.types.is_floating(values))


class Ragged(NamedTuple):
    """A ragged array's rows as numpy: row ``i`` is ``values[starts[i] : starts[i] + lengths[i]]``.

    ``values`` is the leaf values reshaped to ``[n, *inner]`` for lists of fixed-size lists, with
    ``leaf`` the Arrow array they came from (its nulls not yet filled). ``rows_valid`` is False
    at null rows, whose length is 0; ``None`` when no row is null.
    """

    starts: np.ndarray[Any, np.dtype[np.int64]]
    lengths: np.ndarray[Any, np.dtype[np.int64]]
    leaf: pa.Array
    inner: tuple[int, ...]
    rows_valid: np.ndarray[Any, np.dtype[np.bool_]] | None


def ragged(array: pa.Array) -> Ragged:
    """``array`` (a list or large list array, possibly sliced) as a ``Ragged``; no value is copied."""
    offsets = array.offsets.to_numpy().astype(np.int64)
    starts = offsets[:-1] - offsets[0]
    lengths = np.diff(offsets)
    rows_valid = None
    if array.null_count:
        rows_valid = validity(array)
        # A null row's offsets may span values; they are not the row's.
        lengths = np.where(rows_valid, lengths, 0)
    child = array.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    inner: list[int] = []
    while pa.types.is_fixed_size_list(child.type):
        inner.append(child.type.list_size)
        child = child.flatten()
    return Ragged(starts, lengths, child, tuple(inner), rows_valid)


def validity(array: pa.Array) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """True where ``array`` holds a value (its validity bitmap as bools)."""
    valid: np.ndarray[Any, np.dtype[np.bool_]] = array.is_valid().to_numpy(zero_copy_only=False)
    return valid


def per_row(rows: Ragged, flags: np.ndarray[Any, np.dtype[np.bool_]]) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """For each row, whether any of its values has ``flags`` set (``flags``: one per leaf value)."""
    per_value = flags.reshape(len(flags) // max(1, int(np.prod(rows.inner))), -1).any(axis=1)
    counts = np.concatenate(([0], np.cumsum(per_value, dtype=np.int64)))
    has: np.ndarray[Any, np.dtype[np.bool_]] = counts[rows.starts + rows.lengths] > counts[rows.starts]
    return has


def width(rows: Ragged, padded: Padded) -> int:
    """``L``, the padded length of the batch ``rows`` (see ``Padded``); ``TooLong`` for a row
    past ``max_length`` that must not be truncated."""
    longest = int(rows.lengths.max()) if len(rows.lengths) else 0
    limit = padded.max_length
    if limit is None:
        return longest
    if longest > limit and padded.overflow == "raise":
        position = int(np.argmax(rows.lengths > limit))
        raise TooLong(padded, position, int(rows.lengths[position]))
    return limit if padded.fixed else min(longest, limit)


def pad(
    rows: Ragged, values: np.ndarray[Any, Any], length: int, fill: int | float, dtype: np.dtype[Any] | None = None
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, np.dtype[np.int64]]]:
    """The rows padded to ``length`` (each row's first ``length`` values, then ``fill``) from
    ``values``, the leaf values as numpy, as ``dtype`` (theirs when ``None``), and the count of
    each row's values kept.

    One boolean-mask assignment places every kept value: the mask's True places, in row-major
    order, are exactly the kept values in stored order.
    """
    count = len(rows.lengths)
    kept = np.minimum(rows.lengths, length)
    values = values.reshape(-1, *rows.inner)
    out = np.full((count, length, *rows.inner), fill, dtype=values.dtype if dtype is None else dtype)
    mask = np.arange(length) < kept[:, None]
    if np.array_equal(kept, rows.lengths) and (count == 0 or _contiguous(rows)):
        out[mask] = values[: int(kept.sum())]
    else:
        # Truncated or gapped rows: gather each kept value by its place in ``values``.
        within = np.arange(int(kept.sum())) - np.repeat(np.cumsum(kept) - kept, kept)
        out[mask] = values[np.repeat(rows.starts, kept) + within]
    return out, kept


def _contiguous(rows: Ragged) -> bool:
    """Whether the rows' values follow one another in ``values`` with no gap (null rows that
    span values leave one)."""
    return bool(rows.starts[0] == 0 and np.array_equal(rows.starts[1:], np.cumsum(rows.lengths)[:-1]))
