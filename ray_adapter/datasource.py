"""A Ray Data source over an exact table version, whose read tasks are a policy's work items.

A read task is a group of consecutive work items of one work list; it opens the table inside the
Ray worker that runs it, so only the resolved spec and the items travel to workers.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Mapping, Sequence
from itertools import accumulate, pairwise
from typing import Any

import pyarrow as pa
import ray.data
from ray.data import Datasource, ReadTask
from ray.data.block import BlockMetadata

from spiral_lightning.core.plan import Policy, Shard, Split, WorkItem, as_plan
from spiral_lightning.core.spec import TableSpec, as_spec
from spiral_lightning.planning.policies import as_policy, balanced, shuffle_for
from spiral_lightning.sources import open_source

#: Bytes per row guessed for each column whose width the schema does not fix (strings, binary,
#: ragged lists): only the planner's size estimate uses it, never a read.
VARIABLE_WIDTH_BYTES = 64


class ReadWork:
    """The function a read task runs: open ``spec`` in this process and return the rows of
    ``items`` as Arrow tables, one per read batch, in work-list order.

    A class rather than a closure so that a task pickles to the spec and the items only.
    """

    def __init__(self, spec: TableSpec, items: Sequence[WorkItem]) -> None:
        self.spec = spec
        self.items = list(items)

    def __call__(self) -> Iterator[pa.Table]:
        source = open_source(self.spec)
        for batch, _, _ in source.read(self.items):
            if batch.num_rows:
                yield pa.Table.from_batches([batch])


class TableDatasource(Datasource):  # type: ignore[misc]  # Ray's classes are untyped under mypy's follow_imports=skip
    """The rows of one table version as a Ray Data source.

    With ``shard=None`` the source holds the whole table, in the order of the one-consumer work list
    ``policy`` gives for ``epoch`` (``balanced`` by default; ``shuffle=True`` instead reads blocks
    of rows in an order drawn from ``seed`` and ``epoch``, see ``shuffle_for``); with a shard
    (``Shard(rank, world_size)``), exactly the rows ``TableDataset`` gives that consumer. Each read
    task reads consecutive items of that list: one item per task when Ray asks for at least as many
    tasks as there are items, else items grouped into tasks of near-equal stored rows.

    The spec is resolved and the table opened once, here in the driver, to plan; a missing table,
    unknown column or bad filter raises here rather than inside a task. Media projections decode
    into tensors, which Arrow blocks cannot hold, so a spec with ``media`` is refused, and so is
    one with ``padded`` columns, which pad only where rows become tensors.
    """

    def __init__(
        self,
        spec: TableSpec | str,
        *,
        policy: Policy | str | None = None,
        shard: Shard | None = None,
        epoch: int = 0,
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.spec = as_spec(spec).resolve()
        if self.spec.media:
            raise ValueError(
                "TableDatasource yields Arrow blocks and cannot hold decoded media; read the encoded columns "
                "and decode them in Dataset.map_batches, or train through ray_adapter.train_loader"
            )
        if self.spec.padded:
            raise ValueError(
                "TableDatasource yields Arrow blocks, which keep ragged columns as lists, so padded columns do not "
                "apply; drop padded from the spec and pad in iter_torch_batches' collate_fn, or train through "
                "ray_adapter.train_loader"
            )
        self.shard = Shard() if shard is None else Shard(*shard).check()
        source = open_source(self.spec)
        self.schema: pa.Schema = source.schema
        plan = as_plan(source.splits)
        index = dict(zip(plan.ids.tolist(), range(len(plan)), strict=True))
        if shuffle and policy is not None:
            raise ValueError(f"shuffle=True chooses the policy, so it cannot be given with policy={policy!r}; pass one")
        # Ray blocks hold a task's rows in read order, so shuffle=True permutes blocks of rows
        # only; Dataset.random_shuffle() mixes rows across all of them at the cost of a shuffle.
        chosen = as_policy(balanced if policy is None else policy, seed)
        if shuffle:
            chosen = shuffle_for(plan.total, seed, windows=False)
        self.items = chosen(plan, self.shard, epoch)
        self._rows = [_rows(plan[index[item.split]], item) for item in self.items]
        # Without a filter every stored row is returned, so a task's rows are known exactly.
        self._exact = self.spec.filter is None
        self._row_bytes = row_bytes(self.schema)

    def get_name(self) -> str:
        return "SpiralTable"

    def estimate_inmemory_data_size(self) -> int:
        """The bytes the rows take in memory: rows (estimated before the filter) times the bytes
        of one row."""
        return sum(self._rows) * self._row_bytes

    def get_read_tasks(
        self, parallelism: int, per_task_row_limit: int | None = None, data_context: Any = None
    ) -> list[ReadTask]:
        """At most ``parallelism`` tasks, each a run of consecutive work items."""
        tasks = []
        for start, end in groups(self._rows, parallelism):
            rows = sum(self._rows[start:end])
            metadata = BlockMetadata(
                num_rows=rows if self._exact else None,
                size_bytes=rows * self._row_bytes,
                exec_stats=None,
                input_files=None,
            )
            work = ReadWork(self.spec, self.items[start:end])
            tasks.append(ReadTask(work, metadata, schema=self.schema, per_task_row_limit=per_task_row_limit))
        return tasks


def _rows(split: Split, item: WorkItem) -> int:
    """The stored rows of ``item``, scaled by the split's own row estimate when it gives one."""
    stored = item.end - item.start
    if split.rows is None or split.end == split.start:
        return stored
    return stored * split.rows // (split.end - split.start)


def groups(rows: Sequence[int], parallelism: int) -> list[tuple[int, int]]:
    """Index ranges cutting ``rows`` into at most ``parallelism`` runs of consecutive entries, each
    cut placed where the running sum comes closest to its equal share; each entry alone when there
    are no more entries than ``parallelism``."""
    count = len(rows)
    parts = max(1, min(parallelism, count))
    if count == 0:
        return []
    if parts == count:
        return [(index, index + 1) for index in range(count)]
    prefix = list(accumulate(rows, initial=0))
    cuts = [0]
    for part in range(1, parts):
        target = part * prefix[-1] / parts
        # Each run keeps at least one entry: after the previous cut, and before the runs still to come.
        low, high = cuts[-1] + 1, count - (parts - part)
        near = bisect_left(prefix, target)
        candidates = {min(max(index, low), high) for index in (near - 1, near)}
        cuts.append(min(sorted(candidates), key=lambda index: abs(prefix[index] - target)))
    cuts.append(count)
    return list(pairwise(cuts))


def row_bytes(schema: pa.Schema) -> int:
    """The in-memory bytes of one row of ``schema``: exact for fixed-width columns, and
    ``VARIABLE_WIDTH_BYTES`` for each other column."""
    return max(1, sum(_type_bytes(field.type) for field in schema))


def _type_bytes(kind: pa.DataType) -> int:
    if isinstance(kind, pa.FixedSizeListType):
        return int(kind.list_size) * _type_bytes(kind.value_type)
    if isinstance(kind, pa.BaseExtensionType):
        return _type_bytes(kind.storage_type)
    try:
        width: int = kind.bit_width
    except ValueError:
        return VARIABLE_WIDTH_BYTES
    return max(1, width // 8)


def read_table(
    spec: TableSpec | str,
    *,
    policy: Policy | str | None = None,
    shard: Shard | None = None,
    epoch: int = 0,
    shuffle: bool = False,
    seed: int = 0,
    storage_options: Mapping[str, Any] | None = None,
    **read_args: Any,
) -> ray.data.Dataset:
    """The rows of ``spec`` (a Parquet table in an object store reached with ``storage_options``,
    see ``TableSpec``) as a Ray ``Dataset`` through a ``TableDatasource``; ``read_args`` go to
    ``ray.data.read_datasource`` (``override_num_blocks``, ``concurrency``, ...)."""
    source = TableDatasource(
        as_spec(spec, storage_options), policy=policy, shard=shard, epoch=epoch, shuffle=shuffle, seed=seed
    )
    return ray.data.read_datasource(source, **read_args)
