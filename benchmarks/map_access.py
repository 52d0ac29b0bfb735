"""Random access: one ``__getitems__`` call against one ``__getitem__`` call per row, and against
pyarrow reading the same rows from a Parquet copy of the table, for several split sizes.

Run ``.venv/bin/python benchmarks/map_access.py`` (``--rows 200000`` for a quick look). The table
has columns ``id`` int64, ``x`` float32 and ``v`` fixed_size_list<float32>[16], written once as a
local Spiral table and once as Parquet with one row group per split, for each of ``--split-rows``
(rows per split; by default ``write_table``'s 100,000 first, then 250,000, 50,000 and 20,000);
``--root`` keeps them between runs.

Each path fetches the rows of the same ``--indices`` random indices (a new draw per round) and
checks their ids. A *time* is the best of ``--repeats`` rounds, the paths taking turns so that
load from other processes falls on all of them alike; each dataset is opened and its splits
counted before the first round, so opening is excluded. The pyarrow path groups the indices by
row group, reads each row group once (``ParquetFile.read_row_group``) and takes the rows from it:
the read a hand-written Parquet sampler would do.

The first table is the first split size, every path; its last column divides the time of
``__getitems__`` into the time of the path, so a ratio above 1 means ``__getitems__`` is faster.
The second gives, per split size, the Spiral and Parquet ratios of one row at a time over
``__getitems__``: a take pays a fixed cost for every split it reads (about 1 ms on Spiral here),
and random indices touch every split, so the gain of batching grows with the rows per split.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from throughput import in_turns, table_data

from spiral_lightning import TableMapDataset, TableSpec, write_table
from spiral_lightning.sources.write import DEFAULT_SPLIT_ROWS

#: A path: fetches the rows of the given indices and returns their ids in request order.
Fetch = Callable[[np.ndarray], list[int]]


def tables(root: Path, rows: int, split_rows: int) -> tuple[TableSpec, TableSpec]:
    """The Spiral table and its Parquet copy under ``root``, written when missing."""
    spiral_root, parquet_root = root / f"spiral-{rows}-{split_rows}", root / f"parquet-{rows}-{split_rows}"
    spiral_spec = (
        TableSpec(f"spiral:{spiral_root}").resolve()
        if spiral_root.exists()
        else write_table(f"spiral:{spiral_root}", table_data(rows), split_rows=split_rows)
    )
    parquet_spec = (
        TableSpec(f"parquet:{parquet_root}").resolve()
        if parquet_root.exists()
        else write_table(f"parquet:{parquet_root}", table_data(rows), split_rows=split_rows)
    )
    return spiral_spec, parquet_spec


def batched(dataset: TableMapDataset) -> Fetch:
    return lambda indices: [int(row["id"]) for row in dataset.__getitems__(indices.tolist())]


def one_at_a_time(dataset: TableMapDataset) -> Fetch:
    return lambda indices: [int(dataset[index]["id"]) for index in indices.tolist()]


def pyarrow_row_groups(spec: TableSpec) -> Fetch:
    """Rows by global index from the Parquet copy: one ``read_row_group`` per row group hit."""
    files = [pq.ParquetFile(file.path) for file in spec.files or ()]
    groups = [(file, group) for file in files for group in range(file.num_row_groups)]
    ends = np.cumsum([file.metadata.row_group(group).num_rows for file, group in groups])

    def fetch(indices: np.ndarray) -> list[int]:
        held_by = np.searchsorted(ends, indices, side="right")
        starts = np.concatenate(([0], ends))
        parts = []
        for group in np.unique(held_by):
            file, number = groups[group]
            chosen = np.flatnonzero(held_by == group)
            rows = file.read_row_group(number).take(pa.array(indices[chosen] - starts[group]))
            parts.append((chosen, rows.column("id").to_numpy()))
        ids = np.empty(indices.size, dtype=np.int64)
        for chosen, values in parts:
            ids[chosen] = values
        return ids.tolist()

    return fetch


def best_times(spiral_spec: TableSpec, parquet_spec: TableSpec, args: argparse.Namespace) -> dict[str, float]:
    """Each path's best time in seconds over ``args.repeats`` rounds, the paths taking turns."""
    spiral_data, parquet_data = TableMapDataset(spiral_spec), TableMapDataset(parquet_spec)
    paths: dict[str, Fetch] = {
        "Spiral `__getitems__`": batched(spiral_data),
        "Spiral `__getitem__` per row": one_at_a_time(spiral_data),
        "Parquet `__getitems__`": batched(parquet_data),
        "Parquet `__getitem__` per row": one_at_a_time(parquet_data),
        "pyarrow, one read per row group": pyarrow_row_groups(parquet_spec),
    }
    for dataset in (spiral_data, parquet_data):
        dataset.source()
        len(dataset)
    best = dict.fromkeys(paths, float("inf"))
    generator = np.random.default_rng(1)
    names = list(paths)
    for repeat in range(args.repeats):
        indices = generator.integers(0, args.rows, args.indices)
        for name in in_turns(names, repeat):
            began = time.perf_counter()
            ids = paths[name](indices)
            elapsed = time.perf_counter() - began
            if ids != indices.tolist():
                raise AssertionError(f"{name} returned other rows than it was asked for")
            best[name] = min(best[name], elapsed)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument(
        "--split-rows",
        type=int,
        nargs="+",
        default=[DEFAULT_SPLIT_ROWS, 250_000, 50_000, 20_000],
        help="rows per split, one table each; the first gets the full table",
    )
    parser.add_argument("--indices", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--root", type=Path, default=None, help="keep the tables here between runs")
    args = parser.parse_args()
    layouts: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as temporary:
        for split_rows in args.split_rows:
            layouts[split_rows] = best_times(*tables(args.root or Path(temporary), args.rows, split_rows), args)
    first = args.split_rows[0]
    best = layouts[first]
    reference = best["Spiral `__getitems__`"]
    print(
        f"{args.indices} random indices of {args.rows:,} rows in {-(-args.rows // first)} splits of {first:,} rows, "
        f"best of {args.repeats}\n"
    )
    print("| path | ms | rows/s | time / Spiral `__getitems__` |")
    print("| --- | ---: | ---: | ---: |")
    for name, seconds in best.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {args.indices / seconds:,.0f} | {seconds / reference:.1f}x |")
    print("\nOne row at a time over `__getitems__`, by rows per split (the same draws)\n")
    print(
        "| rows per split | splits | Spiral `__getitems__` ms "
        "| Spiral per row / `__getitems__` | Parquet per row / `__getitems__` |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |")
    for split_rows, times in sorted(layouts.items()):
        spiral_ratio = times["Spiral `__getitem__` per row"] / times["Spiral `__getitems__`"]
        parquet_ratio = times["Parquet `__getitem__` per row"] / times["Parquet `__getitems__`"]
        print(
            f"| {split_rows:,} | {-(-args.rows // split_rows)} | {times['Spiral `__getitems__`'] * 1e3:.1f} | "
            f"{spiral_ratio:.1f}x | {parquet_ratio:.1f}x |"
        )


if __name__ == "__main__":
    main()
