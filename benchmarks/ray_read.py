"""Rows per second into torch through Ray Data: our datasource against ``ray.data.read_parquet``.

Run ``.venv/bin/python benchmarks/ray_read.py`` (``--rows 200000 --repeats 1`` for a quick look).
One table (``id`` int64, ``x`` float32, ``features`` float32[16]) is written twice into a
temporary folder: as Parquet files and as a local Spiral table, both with splits (row groups) of
``--split-rows`` rows. Each path runs one pass of ``Dataset.iter_torch_batches`` over the whole
table, summing ``x`` of every batch so each batch is really delivered as tensors:

- ``ray.data.read_parquet`` on the Parquet folder (the baseline),
- ``ray_adapter.read_table`` on the same Parquet folder,
- ``ray_adapter.read_table`` on the Spiral table.

A *rate* is the table's rows divided by the time from planning the dataset to its last batch; each
path takes the best of ``--repeats`` passes, the paths taking turns so load from other processes
falls on all of them. The local Ray gets ``--cpus`` CPUs. Target: ``read_table`` on Parquet at
least 1.0x ``read_parquet``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray
import ray.data
from throughput import in_turns

from ray_adapter import read_table
from spiral_lightning import TableSpec, write_table


def make_data(rows: int) -> pa.Table:
    generator = np.random.default_rng(0)
    features = generator.standard_normal((rows, 16)).astype(np.float32)
    return pa.table(
        {
            "id": pa.array(np.arange(rows, dtype=np.int64)),
            "x": pa.array(generator.standard_normal(rows).astype(np.float32)),
            "features": pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1)), 16),
        }
    )


def write_parquet(folder: Path, data: pa.Table, split_rows: int) -> None:
    folder.mkdir(parents=True)
    half = data.num_rows // 2
    for number, part in enumerate((data.slice(0, half), data.slice(half))):
        pq.write_table(part, folder / f"part-{number}.parquet", row_group_size=split_rows)


def one_pass(dataset: Callable[[], ray.data.Dataset], batch_size: int) -> tuple[int, float]:
    """Rows delivered and seconds taken by one pass over the dataset ``dataset`` plans."""
    started = time.perf_counter()
    rows = 0
    total = 0.0
    for batch in dataset().iter_torch_batches(batch_size=batch_size):
        total += float(batch["x"].sum())
        rows += len(batch["id"])
    return rows, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--split-rows", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpus", type=int, default=2)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="ray-read-"))
    data = make_data(args.rows)
    write_parquet(root / "parquet", data, args.split_rows)
    spiral_spec = write_table(f"spiral:{root / 'spiral'}", data, split_rows=args.split_rows)
    parquet_spec = TableSpec(f"parquet:{root / 'parquet'}").resolve()

    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    paths: dict[str, Callable[[], ray.data.Dataset]] = {
        "ray.data.read_parquet (Parquet)": lambda: ray.data.read_parquet(str(root / "parquet")),
        "read_table (Parquet)": lambda: read_table(parquet_spec),
        "read_table (Spiral)": lambda: read_table(spiral_spec),
    }
    best: dict[str, tuple[int, float]] = {}
    names = list(paths)
    for round_number in range(args.repeats):
        for name in in_turns(names, round_number):
            rows, seconds = one_pass(paths[name], args.batch_size)
            if rows != args.rows:
                raise RuntimeError(f"{name} delivered {rows} rows, not {args.rows}")
            if name not in best or seconds < best[name][1]:
                best[name] = (rows, seconds)
    ray.shutdown()

    baseline = args.rows / best[names[0]][1]
    print(
        f"\n{args.rows:,} rows, splits of {args.split_rows:,}, batches of {args.batch_size}, "
        f"{args.cpus} Ray CPUs, best of {args.repeats}\n"
    )
    print("| path | seconds | rows/s | vs read_parquet |\n| --- | ---: | ---: | ---: |")
    for name, (rows, seconds) in best.items():
        rate = rows / seconds
        print(f"| {name} | {seconds:.3f} | {rate:,.0f} | {rate / baseline:.2f}x |")
    print("\ntarget: read_table (Parquet) at least 1.00x ray.data.read_parquet")


if __name__ == "__main__":
    main()
