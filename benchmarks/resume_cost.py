"""Time to the first batch after a restore, early, midway and late in an epoch: TableDataset's
cursor (a seek) against StatefulDataLoader's default fast-forward on a plain iterable (a replay).

Run ``.venv/bin/python benchmarks/resume_cost.py`` (``--rows 500000`` for a quick look). The table
has ``id`` int64, ``x`` float32 and ``v`` float32[16], written twice from the same rows: as a local
Spiral table and as Parquet, both with splits (row groups) of ``--split-rows`` rows, a multiple of
the batch of 1024 so that every batch of every path holds the same rows.

A second table holds ``--one-split-rows`` rows in a single split, as a long recording or a large
row group is, where a seek itself costs more the further into the split it goes.

A *save point* is the state after ``fraction`` of the epoch's batches (5%, 50%, 95%), taken in one
pass per path. A *resume* is the time from handing a fresh dataset (or loader) its saved state to
holding the first batch after it, checked to start at the row after the save; it is the median of
``--repeats`` turns, in each of which every path resumes once at every point, each turn starting at
another path. Each path's iterator is closed after the clock stops: a resumed job goes on
reading, so stopping the reads ahead of a batch dropped at once (a join of up to a read) is no part
of its resume. The paths:

- ``TableDataset`` restored in process (``load_state_dict``, then ``next(iter(dataset))``), and
  through ``StatefulDataLoader(num_workers=0)``, on the Spiral table and on the Parquet files.
- *seek*: the storage's own seek, the floor of any resume: an already open source's ``read`` of
  the saved row's split from that row, its first 1024 rows made tensors.
- *replay*: an ``IterableDataset`` without ``state_dict`` that yields the same batches from a
  ``pyarrow.dataset`` scan of the Parquet files. ``StatefulDataLoader`` can only restore it by
  reading and dropping the batches delivered before the save, as its documentation says.

Ratios: each resume against the same path's 5% resume (target: TableDataset's 95% resume at most
1.5x its 5% resume, since a seek does not grow with the position), TableDataset's resume in
process against the seek on the same backend at 95% (target: at most 1.5x; a fresh dataset opens
its table once, planning and reading ahead through the same source), and the replay's resume
against TableDataset's on the same Parquet files.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import torch
from throughput import in_turns
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from spiral_lightning import TableDataset, TableSpec, WorkItem, to_torch, write_table
from spiral_lightning.sources import open_source

BATCH_SIZE = 1024
WIDTH = 16
FRACTIONS = (0.05, 0.5, 0.95)
#: The ratio of the late resume to the early one that a seek must stay under.
TARGET = 1.5


def rows_of(rows: int, split_rows: int) -> pa.RecordBatchReader:
    """``rows`` rows with ids 0..rows-1, generated one split at a time so memory stays flat."""
    schema = pa.schema([("id", pa.int64()), ("x", pa.float32()), ("v", pa.list_(pa.float32(), WIDTH))])
    generator = np.random.default_rng(7)

    def batches() -> Iterator[pa.RecordBatch]:
        for start in range(0, rows, split_rows):
            count = min(split_rows, rows - start)
            values = pa.array(generator.random(count * WIDTH, dtype=np.float32))
            yield pa.record_batch(
                [
                    pa.array(np.arange(start, start + count, dtype=np.int64)),
                    pa.array(generator.random(count, dtype=np.float32)),
                    pa.FixedSizeListArray.from_arrays(values, WIDTH),
                ],
                schema=schema,
            )

    return pa.RecordBatchReader.from_batches(schema, batches())


class PlainBatches(IterableDataset[dict[str, Any]]):
    """The Parquet files' rows in batches of 1024 from a ``pyarrow.dataset`` scan, as tensors.

    It has no ``state_dict``: the iterable a user writes in a few lines, which
    ``StatefulDataLoader`` resumes by replaying the batches it already delivered.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in ds.dataset(self.folder, format="parquet").to_batches(batch_size=BATCH_SIZE):
            yield to_torch(batch)


def first_id(batch: dict[str, Any]) -> int:
    ids: torch.Tensor = batch["id"]
    if len(ids) != BATCH_SIZE:
        raise AssertionError(f"a batch of {len(ids)} rows; every path must cut batches of {BATCH_SIZE}")
    return int(ids[0])


#: One resume: the first batch after the restore, and the iterator it came from, still open.
Resume = Callable[[], tuple[dict[str, Any], Iterator[Any]]]


def in_process(spec: TableSpec, saves: list[int]) -> dict[int, Resume]:
    """Restores of ``TableDataset`` itself at each save point, from one pass that saved them."""
    states: dict[int, dict[str, Any]] = {}
    dataset = TableDataset(spec, batch_size=BATCH_SIZE)
    for delivered, _ in enumerate(dataset, start=1):
        if delivered in saves:
            states[delivered] = dataset.state_dict()
        if delivered == saves[-1]:
            break

    def restore(state: dict[str, Any]) -> Resume:
        def first() -> tuple[dict[str, Any], Iterator[Any]]:
            fresh = TableDataset(spec, batch_size=BATCH_SIZE)
            fresh.load_state_dict(state)
            batches = iter(fresh)
            return next(batches), batches

        return first

    return {delivered: restore(state) for delivered, state in states.items()}


def seeks(spec: TableSpec, saves: list[int]) -> dict[int, Resume]:
    """The storage's own seek to each save point: an open source reads the saved row's split
    from that row, and its first ``BATCH_SIZE`` rows become tensors."""
    source = open_source(spec)
    splits = source.splits
    starts = np.cumsum([0] + [split.end - split.start for split in splits])

    def seek(row: int) -> Resume:
        index = int(np.searchsorted(starts, row, side="right")) - 1
        item = WorkItem(index, splits[index].start + row - int(starts[index]), splits[index].end)

        def first() -> tuple[dict[str, Any], Iterator[Any]]:
            reads = iter(source.read([item]))
            batch, _, _ = next(reads)
            return to_torch(batch.slice(0, BATCH_SIZE)), reads

        return first

    return {save: seek(save * BATCH_SIZE) for save in saves}


def through_loader(make: Callable[[], IterableDataset[Any]], saves: list[int]) -> dict[int, Resume]:
    """Restores of ``StatefulDataLoader(make(), num_workers=0)`` at each save point."""
    states: dict[int, dict[str, Any]] = {}
    loader = StatefulDataLoader(make(), batch_size=None, num_workers=0)
    for delivered, _ in enumerate(loader, start=1):
        if delivered in saves:
            states[delivered] = loader.state_dict()
        if delivered == saves[-1]:
            break

    def restore(state: dict[str, Any]) -> Resume:
        def first() -> tuple[dict[str, Any], Iterator[Any]]:
            fresh = StatefulDataLoader(make(), batch_size=None, num_workers=0)
            fresh.load_state_dict(state)
            batches = iter(fresh)
            return next(batches), batches

        return first

    return {delivered: restore(state) for delivered, state in states.items()}


def one_resume(first: Resume, expected_id: int) -> float:
    """Seconds of one resume, checked to start at ``expected_id``; its iterator is closed, and
    collected, after the clock stops."""
    began = time.perf_counter()
    batch, batches = first()
    seconds = time.perf_counter() - began
    if first_id(batch) != expected_id:
        raise AssertionError(f"resumed at id {first_id(batch)}, not {expected_id}")
    getattr(batches, "close", lambda: None)()
    del batch, batches
    gc.collect()
    return seconds


def median_resumes(paths: dict[str, dict[int, Resume]], saves: list[int], repeats: int) -> dict[str, list[float]]:
    """Each path's median seconds at each save point over ``repeats`` turns: in a turn every path
    resumes once at every point, each turn starting at another path, so that load from elsewhere
    falls on all of them alike."""
    names = list(paths)
    times: dict[str, dict[int, list[float]]] = {name: {save: [] for save in saves} for name in names}
    for turn in range(repeats):
        for name in in_turns(names, turn):
            for save in saves:
                times[name][save].append(one_resume(paths[name][save], save * BATCH_SIZE))
    return {name: [statistics.median(times[name][save]) for save in saves] for name in names}


def report(seconds: dict[str, list[float]], saves: list[int], rows: int, split_rows: int, repeats: int) -> str:
    """The resumes as a markdown table, the target of the layout checked below it: with many
    splits, the late resume against the early one; in one split, where a seek itself grows with
    the row it seeks to, the resume against the seek."""
    points = [f"{fraction:.0%} (batch {save:,})" for fraction, save in zip(FRACTIONS, saves, strict=True)]
    lines = [
        f"{rows:,} rows in splits of {split_rows:,}, batch {BATCH_SIZE}; time to the first batch after a restore, "
        f"median of {repeats}",
        "",
        "| path | " + " | ".join(points) + " | 95% / 5% | vs replay at 95% | vs seek at 95% |",
        "| --- |" + " ---: |" * (len(points) + 3),
    ]
    replay = seconds["replay: plain iterable, `StatefulDataLoader` fast-forward (Parquet)"][-1]
    for name, times in seconds.items():
        cells = " | ".join(f"{value * 1e3:.1f} ms" for value in times)
        backend = "Spiral" if "(Spiral)" in name else "Parquet"
        floor = times[-1] / seconds[f"seek: an open source's read from the row ({backend})"][-1]
        lines.append(f"| {name} | {cells} | {times[-1] / times[0]:.2f}x | {replay / times[-1]:.1f}x | {floor:.2f}x |")
    ours = {name: times[-1] / times[0] for name, times in seconds.items() if name.startswith("`TableDataset`")}
    worst = max(ours.values())
    over_seek = max(
        times[-1] / seconds[f"seek: an open source's read from the row ({backend})"][-1]
        for backend in ("Spiral", "Parquet")
        for name, times in seconds.items()
        if name == f"`TableDataset` in process ({backend})"
    )
    lines.append("")
    if split_rows < rows:
        lines.append(
            f"target TableDataset 95% resume <= {TARGET}x its 5% resume: worst {worst:.2f}x, "
            f"{'met' if worst <= TARGET else 'NOT met'}"
        )
    else:
        lines.append(
            f"target TableDataset 95% resume in process <= {TARGET}x the seek: worst {over_seek:.2f}x, "
            f"{'met' if over_seek <= TARGET else 'NOT met'}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2_048_000, help="rows in the table (default 2,048,000)")
    parser.add_argument("--split-rows", type=int, default=102_400, help="rows per split, a multiple of 1024")
    parser.add_argument(
        "--one-split-rows",
        type=int,
        default=3_072_000,
        help="rows of a second table in one split, for the resume against the seek (default 3,072,000; 0 skips it)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="resumes per point; the median counts (default 3)")
    parser.add_argument("--root", type=Path, help="folder that keeps the tables between runs (default: a temp folder)")
    options = parser.parse_args()
    if options.split_rows % BATCH_SIZE or options.rows < 20 * BATCH_SIZE or options.repeats < 1:
        parser.error(f"--split-rows must be a multiple of {BATCH_SIZE}, --rows at least {20 * BATCH_SIZE}")
    if options.one_split_rows and options.one_split_rows < 20 * BATCH_SIZE:
        parser.error(f"--one-split-rows must be 0 or at least {20 * BATCH_SIZE}")
    with tempfile.TemporaryDirectory(prefix="spiral-lightning-resume-") as temp:
        parent = options.root or Path(temp)
        print(measure(parent, options.rows, options.split_rows, options.repeats))
        if options.one_split_rows:
            print()
            print(measure(parent, options.one_split_rows, options.one_split_rows, options.repeats))


def measure(parent: Path, rows: int, split_rows: int, repeats: int) -> str:
    """The report of every path's resumes on tables of ``rows`` rows in splits of ``split_rows``,
    written under ``parent`` when missing."""
    spiral_root = parent / f"resume-spiral-{rows}-{split_rows}"
    parquet_root = parent / f"resume-parquet-{rows}-{split_rows}"
    for uri, root in ((f"spiral:{spiral_root}", spiral_root), (f"parquet:{parquet_root}", parquet_root)):
        if not root.exists():
            write_table(uri, rows_of(rows, split_rows), split_rows=split_rows)
    on_spiral = TableSpec(f"spiral:{spiral_root}").resolve()
    on_parquet = TableSpec(f"parquet:{parquet_root}").resolve()
    batches = rows // BATCH_SIZE
    saves = [max(1, round(fraction * batches)) for fraction in FRACTIONS]
    paths = {
        "seek: an open source's read from the row (Spiral)": seeks(on_spiral, saves),
        "seek: an open source's read from the row (Parquet)": seeks(on_parquet, saves),
        "`TableDataset` in process (Spiral)": in_process(on_spiral, saves),
        "`TableDataset` via `StatefulDataLoader` (Spiral)": through_loader(
            lambda: TableDataset(on_spiral, batch_size=BATCH_SIZE), saves
        ),
        "`TableDataset` in process (Parquet)": in_process(on_parquet, saves),
        "`TableDataset` via `StatefulDataLoader` (Parquet)": through_loader(
            lambda: TableDataset(on_parquet, batch_size=BATCH_SIZE), saves
        ),
        "replay: plain iterable, `StatefulDataLoader` fast-forward (Parquet)": through_loader(
            lambda: PlainBatches(parquet_root), saves
        ),
    }
    return report(median_resumes(paths, saves, repeats), saves, rows, split_rows, repeats)


if __name__ == "__main__":
    main()
