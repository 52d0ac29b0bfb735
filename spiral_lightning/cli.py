"""The ``spiral-lightning`` command line."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from torchdata.stateful_dataloader import StatefulDataLoader

from spiral_lightning.dataset import TableDataset
from spiral_lightning.demo import demo_table


def _demo(args: argparse.Namespace) -> None:
    spec = demo_table(args.root)
    dataset = TableDataset(spec, batch_size=args.batch_size)
    plan = dataset.source().splits
    print(f"table {spec.uri}\n  {len(plan)} splits, {len(dataset)} rows")
    for worker in range(args.workers):
        items = dataset.work(dataset.shard()._replace(worker=worker, workers=max(1, args.workers)))
        print(f"  worker {worker}: splits {[item.split for item in items]}")
    loader = StatefulDataLoader(
        dataset,
        batch_size=None,
        num_workers=args.workers,
        multiprocessing_context="forkserver" if args.workers else None,
    )
    started = time.perf_counter()
    rows = sum(len(batch["id"]) for batch in loader)
    elapsed = time.perf_counter() - started
    print(f"read {rows} rows in {elapsed:.2f} s through {args.workers} workers: {rows / elapsed:,.0f} rows/s")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="spiral-lightning")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="create the demo table when missing and read it through a DataLoader")
    demo.add_argument("--root", default="data/demo", help="the demo table's folder")
    demo.add_argument("--batch-size", type=int, default=1024)
    demo.add_argument("--workers", type=int, default=2)
    demo.set_defaults(run=_demo)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
