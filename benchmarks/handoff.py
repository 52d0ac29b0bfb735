"""The worker hand-off: rows per second through ``dataset.loader(num_workers=N)`` against the same
dataset read in the main process, by batch size.

Run ``.venv/bin/python benchmarks/handoff.py`` (``--rows 500000`` for a quick look). The table is
the throughput benchmark's (``id`` int64, ``x`` float32, ``v`` float32[16], 20 Spiral splits).

For each batch size: the in-process rate is ``TableDataset`` iterated directly; each loader row is
``dataset.loader(num_workers=N)`` (persistent workers). Every setting's first pass is untimed (it
opens the table and starts the workers); then the settings take ``--repeats`` turns, a pass each,
and a setting's rate is the median of its passes: taking turns puts load from elsewhere on all of
them alike, and the median does not favour the setting whose passes spread wider, as the best
pass does (worker passes spread wider on 2 cores). Every pass's batches are checked to hold
tensors of the batch's rows and the pass to hold every row.
*2 workers / in process* is issue 27's measure of what a batch pays to cross from a worker to
the trainer (targets: >= 0.9x at 1024 and 4096 rows, >= 0.6x at 256); *best workers / in process*
takes the better of the two worker counts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from throughput import benchmark_table, consume, in_turns

from spiral_lightning import TableDataset, TableSpec

BATCH_SIZES = (256, 1024, 4096)
WORKERS = (1, 2)


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
    settings: list[object] = [
        TableDataset(spec, batch_size=batch_size),
        *(TableDataset(spec, batch_size=batch_size).loader(num_workers=workers) for workers in WORKERS),
    ]
    passes: list[list[float]] = [[] for _ in settings]
    for setting in settings:
        timed_pass(setting, rows)
    indices = list(range(len(settings)))
    for turn in range(repeats):
        for index in in_turns(indices, turn):
            passes[index].append(timed_pass(settings[index], rows))
    return [rows / statistics.median(seconds) for seconds in passes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows in the table (default 2,000,000)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes a setting (default 5)")
    parser.add_argument("--root", type=Path, help="folder that keeps the table between runs (default: a temp folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        spec = benchmark_table(args.root or Path(temporary), args.rows)
        print(f"{args.rows:,} rows (id int64, x float32, v float32[16]), 20 Spiral splits; persistent workers,")
        print(f"first pass untimed; the median of {args.repeats} passes each, the settings taking turns\n")
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
