"""Rows per second of TableDataset over Parquet against a raw ``pyarrow.dataset`` scan of the
same files, with and without a filter.

Run ``.venv/bin/python benchmarks/parquet_read.py`` (``--rows 200000 --repeats 2`` for a quick
look). The table has columns ``id`` int64, ``x`` float32 and ``v`` fixed_size_list<float32>[16],
written by ``write_table("parquet:...", split_rows=100_000)`` as one file with a row group per
100,000 rows; ``--root`` keeps it between runs.

Both paths read in process, the same three columns, in batches of ``--batch-size`` (1024), and
hand every batch to the same consumer: every column as a torch tensor, its rows counted. The raw
path is ``pyarrow.dataset.dataset(folder).to_batches(columns=..., batch_size=1024)`` with each
batch converted by ``spiral_lightning.to_torch``, so the comparison is loader against loader.
With the filter ``x > 0`` the dataset gets the filter-language text and the raw scan the pyarrow
expression ``pc.field("x") > 0``; the raw scan then yields the rows each 1024-row read batch
keeps (about half), while the dataset still yields full 1024-row batches. Both must deliver the
same number of rows. `TableDataset` reads with its default threads (the cores, up to 4), and
`TableDataset(read_threads=1)` one work item at a time. `TableDataset`, lists by Arrow, reads as
`TableDataset` does with every list column left to Arrow's decoding (``sources/parquet_pages``
finds none for the pass), as before list columns were read from their plain pages: what that
path saves, measured in the same run.

A *rate* is the rows of one full pass divided by its wall time. Each path takes the best of
``--repeats`` passes, the paths taking turns (each round starting at another one) so that load
from other processes falls on all of them alike; the dataset and the pyarrow dataset are built
before the first pass, so opening is excluded. The last column divides each TableDataset rate by
the raw rate of the same filter; the target is at least 0.9.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pyarrow.dataset as ds
from throughput import WIDTH, in_turns, table_data

from spiral_lightning import TableDataset, TableSpec, to_torch, write_table
from spiral_lightning.sources import parquet_pages

COLUMNS = ["id", "x", "v"]
SPLIT_ROWS = 100_000

#: A path: one full pass, returning the rows it delivered.
Pass = Callable[[], int]


def table(root: Path, rows: int) -> Path:
    """The Parquet folder under ``root``, written when missing."""
    folder = root / f"parquet-{rows}"
    if not folder.exists():
        write_table(f"parquet:{folder}", table_data(rows), split_rows=SPLIT_ROWS)
    return folder


def consume(batches: Iterable[dict[str, Any]]) -> int:
    """What a training loop would do with the batches: check each column holds the batch's rows."""
    rows = 0
    for batch in batches:
        count = len(batch["id"])
        if len(batch["x"]) != count or batch["v"].shape != (count, WIDTH):
            raise AssertionError("a batch's columns disagree on its rows")
        rows += count
    return rows


def table_dataset(folder: Path, batch_size: int, condition: str | None, threads: int | None = None) -> Pass:
    spec = TableSpec(f"parquet:{folder}", columns=COLUMNS, filter=condition)
    dataset = TableDataset(spec, batch_size=batch_size, read_threads=threads)
    dataset.source()
    return lambda: consume(dataset)


def lists_by_arrow(run: Pass) -> Pass:
    """``run`` with no column read from its pages: every list decoded by Arrow's reader."""

    def arrow_run() -> int:
        found = parquet_pages.fixed_lists
        parquet_pages.fixed_lists = lambda parquet, columns: {}
        try:
            return run()
        finally:
            parquet_pages.fixed_lists = found

    return arrow_run


def raw_scan(folder: Path, batch_size: int, condition: str | None) -> Pass:
    dataset = ds.dataset(folder, format="parquet")
    expression = pc.field("x") > 0 if condition is not None else None

    def run() -> int:
        batches = dataset.to_batches(columns=COLUMNS, filter=expression, batch_size=batch_size)
        return consume(to_torch(batch) for batch in batches)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--root", type=Path, default=None, help="keep the table here between runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        folder = table(args.root or Path(temporary), args.rows)
        paths: dict[tuple[str, str], Pass] = {}
        for label, condition in (("none", None), ("`x > 0`", "x > 0")):
            paths[("raw `pyarrow.dataset` scan + `to_torch`", label)] = raw_scan(folder, args.batch_size, condition)
            paths[("`TableDataset`", label)] = table_dataset(folder, args.batch_size, condition)
            paths[("`TableDataset(read_threads=1)`", label)] = table_dataset(folder, args.batch_size, condition, 1)
            by_arrow = lists_by_arrow(table_dataset(folder, args.batch_size, condition))
            paths[("`TableDataset`, lists by Arrow", label)] = by_arrow
        best = dict.fromkeys(paths, float("inf"))
        delivered: dict[tuple[str, str], int] = {}
        names = list(paths)
        for repeat in range(args.repeats):
            for name in in_turns(names, repeat):
                began = time.perf_counter()
                rows = paths[name]()
                best[name] = min(best[name], time.perf_counter() - began)
                if delivered.setdefault(name, rows) != rows:
                    raise AssertionError(f"{name} delivered {rows} rows, then {delivered[name]}")
    for label in ("none", "`x > 0`"):
        counts = {delivered[name] for name in paths if name[1] == label}
        if len(counts) != 1:
            raise AssertionError(f"the paths delivered different rows with filter {label}: {counts}")
    print(
        f"{args.rows:,} rows of Parquet ({SPLIT_ROWS:,}-row row groups), columns {COLUMNS}, "
        f"batch {args.batch_size}, in process, best of {args.repeats} passes\n"
    )
    print("| path | filter | rows delivered | rows/s | / raw |")
    print("| --- | --- | ---: | ---: | ---: |")
    for (path, label), seconds in best.items():
        raw = best[("raw `pyarrow.dataset` scan + `to_torch`", label)]
        rate = args.rows / seconds
        print(f"| {path} | {label} | {delivered[(path, label)]:,} | {rate / 1e6:.2f} M | {raw / seconds:.2f}x |")
    for label in ("none", "`x > 0`"):
        gain = best[("`TableDataset`, lists by Arrow", label)] / best[("`TableDataset`", label)]
        print(f"\nfilter {label}: `TableDataset` {gain:.2f}x the same reads with lists by Arrow", end="")
    print()


if __name__ == "__main__":
    main()
