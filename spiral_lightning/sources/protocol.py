"""The Source protocol: one opened table version in one process, and the reads it offers."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol

import numpy as np
import pyarrow as pa

from spiral_lightning.core.plan import Plan, WorkItem

#: One read batch of a work list: the rows, the index of their item in the list, and the stored
#: row after them, from which that item resumes without reading a row twice.
ReadBatch = tuple[pa.RecordBatch, int, int]


class Take(NamedTuple):
    """Rows of one split by position: position ``p`` is the ``p``-th row the split returns after
    the filter. Positions may come in any order and repeat."""

    split: int
    positions: Sequence[int]


class Reader(Protocol):
    """What reads a consumer's work items: a source, or a source read ahead on a thread."""

    def read(self, items: Sequence[WorkItem]) -> Iterator[ReadBatch]:
        """The rows of ``items`` after the filter, item after item, each in stored order."""
        ...


class Source(Reader, Protocol):
    """An exact table version opened in the process that reads it, with its scan options applied.

    Split indexes belong to the source: with a filter a backend may prune splits, so a plan, its
    counts and its reads all come from one source.

    A source whose one ``read`` keeps several items in flight itself (Parquet in an object store)
    may say so with a ``fetches_ahead = True`` attribute: a consumer then reads its items in one
    read by default, since reading them on threads of their own would add requests, not speed.
    """

    @property
    def version(self) -> str:
        """The exact version every read of this source returns."""
        ...

    @property
    def schema(self) -> pa.Schema:
        """The schema of the rows the reads return (the selected columns)."""
        ...

    @property
    def decoded(self) -> frozenset[str]:
        """The media columns the source itself decodes into tensors (inside its scan), which the
        reading process must not decode again."""
        ...

    @property
    def splits(self) -> Plan:
        """The plan: every split, in stored order."""
        ...

    def count(self, items: Sequence[WorkItem]) -> list[int]:
        """The exact rows each item returns after the filter, reading only the filter's columns."""
        ...

    def kept(self, split: int) -> np.ndarray:
        """The stored rows of ``split`` (int64, in order) that the filter keeps, all of them
        without one: found once per source, reading only the filter's columns."""
        ...

    def take(self, takes: Sequence[Take]) -> pa.Table:
        """The rows of ``takes``, take after take, each in the order of its positions; one call
        reads each split it names once, so a sampler's whole batch is one call."""
        ...


def refuse_storage_options(uri: str, storage_options: object) -> None:
    """``ValueError`` when ``storage_options`` are given for a backend that reads none."""
    if storage_options:
        raise ValueError(f"storage_options apply to Parquet tables, not {uri!r}")
