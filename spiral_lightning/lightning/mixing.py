"""Training a SpiralDataModule on a weighted mixture of tables: the tables as a config names them,
and the ``Mixture`` they make."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import pyarrow as pa

from spiral_lightning.core.schedule import by_table
from spiral_lightning.core.spec import TableSpec, as_spec, with_selection
from spiral_lightning.datasets.mixture import Mixture, Stop
from spiral_lightning.reading.tensors import to_torch


@dataclass(frozen=True)
class MixedTable:
    """One table of the mixture a ``SpiralDataModule`` trains on: a spec or uri and its weight, its
    share of the rows delivered (weights need not sum to 1), or ``(step, weight)`` points from
    step 0 on, each in force from that step of the epoch (``Mixture``'s ``schedule``).

        data = SpiralDataModule(train=[MixedTable("spiral:data/web", 0.7), MixedTable("spiral:data/books", 0.3)])

    In a config: ``train: [{table: spiral:data/web, weight: 0.7}, {table: spiral:data/books, weight: 0.3}]``;
    ``weight: [[0, 0.9], [1000, 0.5]]`` changes a share at step 1000.
    """

    table: TableSpec | str
    weight: float | Sequence[tuple[int, float]]


def mixed_tables(
    train: Sequence[Any], storage_options: dict[str, Any] | None, columns: list[str] | None, filter: Any
) -> list[tuple[TableSpec, Any]]:
    """The (spec, weight) pairs of a train mixture given as ``MixedTable`` values, mappings with
    ``table`` and ``weight``, or pairs, with the DataModule's columns and filter applied;
    ``ValueError`` naming the entry that is none of them."""
    pairs = []
    for index, entry in enumerate(train):
        if isinstance(entry, Mapping) and set(entry) == {"table", "weight"}:
            entry = MixedTable(entry["table"], entry["weight"])
        elif isinstance(entry, tuple | list) and len(entry) == 2:
            entry = MixedTable(*entry)
        if not isinstance(entry, MixedTable) or not isinstance(entry.table, TableSpec | str):
            raise ValueError(
                f"train[{index}] of the mixture must be a MixedTable(table, weight), {{table: ..., weight: ...}} "
                f"or a (table, weight) pair, not {entry!r}"
            )
        pairs.append((with_selection(as_spec(entry.table, storage_options), columns, filter), entry.weight))
    if not pairs:
        raise ValueError("train is an empty list; give one table, or a mixture of (table, weight) entries")
    return pairs


def then_transform(transform: Callable[[Any], Any], batch: pa.RecordBatch) -> Any:
    """A mixture's collate with a DataModule's ``transform``: tensors, then the transform."""
    return transform(to_torch(batch))


def train_mixture(
    pairs: Sequence[tuple[TableSpec, Any]],
    settings: Mapping[str, Any],
    stop: Stop,
    table_key: str | None,
    transform: Callable[[Any], Any] | None,
) -> Mixture:
    """The ``Mixture`` of pinned ``pairs`` a rank trains on, with the DataModule's ``settings``
    (batch size, rank, world size, policy or shuffle, seed, read-ahead); a weight given as points
    by step makes the mixture's schedule."""
    collate = to_torch if transform is None else partial(then_transform, transform)
    first, schedule = by_table([weight for _, weight in pairs])
    tables = [(spec, weight) for (spec, _), weight in zip(pairs, first, strict=True)]
    return Mixture(tables, stop=stop, table_key=table_key, collate=collate, schedule=schedule, **settings)
