"""One rank of a two-process job (gloo on CPU) that shares a table's counts (``main``, started by
``tests.ranks.rank_jobs``): ``--rank r`` of ``--world-size w``, meeting at ``--port``.

Each rank calls ``count_shared`` then ``even_rows`` and ``batches`` for ``--epochs`` epochs, as
the DataModule does, through a source that records its ``count`` and ``read`` calls, and writes
the calls and the counts to ``<out>/rank<r>.json``. The dataset is a ``TableDataset`` under
``--filter``, or with ``--packed COLUMN`` a ``PackedDataset`` of blocks of ``PACKED_LENGTH``
tokens of that column.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from spiral_lightning import PackedDataset, TableDataset, TableSpec
from spiral_lightning.core.plan import WorkItem
from spiral_lightning.sources import ReadBatch, Source
from tests.ddp_group import process_group, rank_arguments

WORKERS = 2
#: Tokens per block of the packed dataset.
PACKED_LENGTH = 8


class CountingSource:
    """A real source that also records the size of each ``count`` and ``read`` call made through it."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.calls: list[int] = []
        self.reads: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)

    def count(self, items: Sequence[WorkItem]) -> list[int]:
        self.calls.append(len(items))
        return self.source.count(items)

    def read(self, items: Sequence[WorkItem]) -> Iterator[ReadBatch]:
        self.reads.append(len(items))
        return self.source.read(items)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--uri", required=True)
    parser.add_argument("--filter")
    parser.add_argument("--packed")
    parser.add_argument("--policy", required=True)
    rank_arguments(parser)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    with process_group(args):
        spec = TableSpec(args.uri, filter=args.filter)
        placing = {"policy": args.policy, "rank": args.rank, "world_size": args.world_size}
        dataset = (
            TableDataset(spec, batch_size=16, **placing)
            if args.packed is None
            else PackedDataset(spec, column=args.packed, length=PACKED_LENGTH, batch_size=3, **placing)
        )
        counting = CountingSource(dataset.source())
        dataset._source = counting  # type: ignore[assignment]
        epochs = []
        for epoch in range(args.epochs):
            dataset.set_epoch(epoch)
            dataset.count_shared(WORKERS)
            epochs.append({"even_rows": dataset.even_rows(WORKERS), "batches": dataset.batches(WORKERS)})
    recorded = {"calls": counting.calls, "reads": counting.reads, "epochs": epochs}
    (args.out / f"rank{args.rank}.json").write_text(json.dumps(recorded))


if __name__ == "__main__":
    main()
