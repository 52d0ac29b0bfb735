"""One rank of a two-process DDP job (gloo on CPU) reading a TableMapDataset through
DistributedSampler (``main``, started by ``tests.ranks.rank_jobs``): ``--rank r`` of
``--world-size w``, meeting at ``--port``.

Each rank reads ``--epochs`` epochs, calling ``set_epoch`` before each, and writes the ids of
every batch it read, epoch by epoch, to ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from torch.utils.data import DataLoader, DistributedSampler

from spiral_lightning import TableMapDataset, TableSpec
from tests.ddp_group import process_group, rank_arguments

BATCH_SIZE = 8


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--uri", required=True)
    parser.add_argument("--filter", default=None)
    rank_arguments(parser)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    with process_group(args):
        dataset = TableMapDataset(TableSpec(args.uri, filter=args.filter))
        sampler: DistributedSampler[int] = DistributedSampler(dataset, shuffle=True, seed=7)
        loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)
        epochs = []
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            epochs.append([batch["id"].tolist() for batch in loader])
    (args.out / f"rank{args.rank}.json").write_text(json.dumps(epochs))


if __name__ == "__main__":
    main()
