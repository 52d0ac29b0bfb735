"""The worker hand-off: rows per second through ``dataset.loader(num_workers=N)`` against the same
dataset read in the main process, by batch size.

Run ``.venv/bin/python benchmarks/handoff.py`` (``--rows 500000`` for a quick look). The table is
the throughput benchmark's (``id`` int64, ``x`` float32, ``v`` float32[16], 20 Spiral splits).

For each batch size: the in-process rate is the best of ``--repeats`` passes of ``TableDataset``
iterated directly; each loader row is ``dataset.loader(num_workers=N)`` (persistent workers), its
first pass untimed (it starts the workers), then the best of ``--repeats`` passes after it. Every
pass's batches are checked to hold tensors of the batch's rows and the pass to hold every row.
*2 workers / in process* is issue 27's measure of what a batch pays to cross from a worker to
the trainer (targets: >= 0.9x at 1024 and 4096 rows, >= 0.6x at 256); *best workers / in process*
takes the better of the two worker counts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from throughput import benchmark_table, consume

from spiral_lightning import TableDataset, TableSpec

BATCH_SIZES = (256, 1024, 4096)
WORKERS = (1, 2)


def best_rate(passes: list[float], rows: int) -> float:
    """Rows per second of the fastest of ``passes`` (seconds each) over ``rows`` rows."""
    return rows / min(passes)


def timed_pass(batches: object, rows: int) -> float:
    """Seconds of one pass over ``batches``, which must deliver ``rows`` rows."""
    began = time.perf_counter()
    seen = consume(batches)  # type: ignore[arg-type]
    seconds = time.perf_counter() - began
    if seen != rows:
        raise AssertionError(f"a pass delivered {seen} rows, not {rows}")
    return seconds


def measure(spec: TableSpec, rows: int, batch_size: int, repeats: int) -> list[float]:
    """The in-process rate, then the rate through each of ``WORKERS``, for one batch size."""
    dataset = TableDataset(spec, batch_size=batch_size)
    rates = [best_rate([timed_pass(dataset, rows) for _ in range(repeats)], rows)]
    for workers in WORKERS:
        loader = TableDataset(spec, batch_size=batch_size).loader(num_workers=workers)
        timed_pass(loader, rows)
        rates.append(best_rate([timed_pass(loader, rows) for _ in range(repeats)], rows))
        del loader
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows in the table (default 2,000,000)")
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per path (default 2)")
    parser.add_argument("--root", type=Path, help="folder that keeps the table between runs (default: a temp folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        spec = benchmark_table(args.root or Path(temporary), args.rows)
        print(f"{args.rows:,} rows (id int64, x float32, v float32[16]), 20 Spiral splits; persistent workers,")
        print(f"first pass untimed; best of {args.repeats} passes each\n")
        header = [
            "batch rows",
            "in process",
            *(f"{n} worker{'s' * (n > 1)}" for n in WORKERS),
            "2 workers / in process",
            "best workers / in process",
        ]
        print("| " + " | ".join(header) + " |")
        print("| " + " | ".join("---:" for _ in header) + " |")
        for batch_size in BATCH_SIZES:
            rates = measure(spec, args.rows, batch_size, args.repeats)
            cells = [f"{batch_size:,}", *(f"{rate / 1e6:.2f} M rows/s" for rate in rates)]
            ratios = [f"{rates[-1] / rates[0]:.2f}x", f"{max(rates[1:]) / rates[0]:.2f}x"]
            print("| " + " | ".join([*cells, *ratios]) + " |", flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
