"""Rows per second of the ``Shuffled`` policy against ``stripe`` on the same table, in process.

Run ``.venv/bin/python benchmarks/shuffled.py`` (``--rows 200000`` for a quick look). It reads the
table of ``throughput.py`` (id int64, x float32, v float32[16], 20 splits) with batch 1024, once in
stored order (``stripe``), then with shuffled blocks of a few sizes, with and without a window
shuffle; each rate is the best of ``--repeats`` passes, taken in turns. Target: shuffled at least
0.8x stripe.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from throughput import BATCH_SIZE, benchmark_table, in_turns, timed

from spiral_lightning import Shuffled, TableDataset, stripe
from spiral_lightning.core.plan import Policy
from spiral_lightning.planning.policies import shuffle_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", type=Path, default=None, help="keep the table here between runs")
    args = parser.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="shuffled-bench-"))
    spec = benchmark_table(root, args.rows)
    policies: dict[str, Policy] = {
        "`stripe` (stored order)": stripe,
        "`Shuffled(block_rows=65536)`": Shuffled(seed=1, block_rows=65_536),
        "`Shuffled(block_rows=8192)`": Shuffled(seed=1, block_rows=8192),
        "`Shuffled(block_rows=1024)`": Shuffled(seed=1, block_rows=1024),
        "`Shuffled(block_rows=8192, buffer_rows=65536)`": Shuffled(seed=1, block_rows=8192, buffer_rows=65_536),
    }
    chosen = shuffle_for(args.rows, seed=1)
    policies[f"`shuffle=True`: block_rows={chosen.block_rows}, buffer_rows={chosen.buffer_rows}"] = chosen
    datasets = {name: TableDataset(spec, batch_size=BATCH_SIZE, policy=policy) for name, policy in policies.items()}
    best = {name: float("inf") for name in datasets}
    for round_ in range(args.repeats):
        names = list(datasets)
        for name in in_turns(names, round_):
            dataset = datasets[name]
            dataset.set_epoch(round_)
            best[name] = min(best[name], timed(lambda dataset=dataset: dataset, args.rows))
    baseline = args.rows / best["`stripe` (stored order)"]
    print(f"{args.rows:,} rows, batch {BATCH_SIZE}, best of {args.repeats}\n")
    print("| policy | rows/s | vs stripe |")
    print("| --- | ---: | ---: |")
    for name, seconds in best.items():
        rate = args.rows / seconds
        print(f"| {name} | {rate:,.0f} | {rate / baseline:.2f}x |")


if __name__ == "__main__":
    main()
