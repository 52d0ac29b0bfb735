"""Whether the default loader is the fast one: ``dataset.loader()`` with no worker setting against
every worker count it could have chosen, on the three workloads of the other benchmarks.

Run ``.venv/bin/python benchmarks/defaults.py`` (``--rows 200000 --images 300 --tokens 2000000``
for a quick look). Workloads, each a table written once (``--root`` keeps them between runs):

- *plain columns*: ``--rows`` rows of ``id`` int64, ``x`` float32 and ``v`` float32[16] in 20
  Spiral splits (``benchmarks/throughput.py``'s table), batch 1024;
- *images*: ``--images`` JPEGs of about 256x256 (``benchmarks/media.py``'s) ingested into a Spiral
  table, decoded by an ``Image`` projection to float32 3x64x64, batch 64;
- *packed tokens*: about ``--tokens`` tokens of documents of 1-2,000 tokens
  (``benchmarks/packing.py``'s corpus) in a Spiral table, ``PackedDataset`` blocks of 2,048 tokens,
  8 a batch.

Each workload is read through ``loader(num_workers=n)`` for n = 0, 1 and 2, persistent
``forkserver`` workers, and the count ``loader()`` chooses without one (``num_workers=None``, which
``datasets.loader.workers_for`` resolves by what the dataset runs) is read off the loader it
returns: the default *is* one of those counts, so it is not timed twice (two timings of one
setting differed by up to 15% on this machine, which the ratio would count as the default's). A
setting's first epoch starts its workers and is not timed; its rate is the median of ``--samples``
samples after it (a sample: whole epochs of at least ``--sample-seconds``), the settings taking
turns, each epoch checked to deliver the workload's rows (a packed stream: its tokens but the tail
shorter than a block each consumer drops). The median, not the best: where two settings read at
one rate (plain columns, in process and through 2 workers, each decoding on both cores), the best
sample picks whichever spreads wider, and worker passes spread wider (2026-12-03, 8 samples each:
in process median 3.39 M rows/s, best 3.77 M; 2 workers median 3.37 M, best 4.21 M). The last
column divides the default count's rate by the best count's; the target (issue 27): at least 0.9x
on every workload.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from media import PRELOAD, make_images
from packing import documents
from throughput import benchmark_table, in_turns

from spiral_lightning import Image, PackedDataset, TableDataset, TableSpec, write_table
from spiral_lightning.media.ingest import ingest_images

WORKER_COUNTS = (0, 1, 2)
TARGET = 0.9
BLOCK = 2048


def timed(batches: Iterable[dict[str, Any]], count: Callable[[dict[str, Any]], int]) -> tuple[float, int]:
    """Seconds of one epoch of ``batches`` and the units ``count`` found in it."""
    began = time.perf_counter()
    units = sum(count(batch) for batch in batches)
    return time.perf_counter() - began, units


def shown(rate: float) -> str:
    return f"{rate / 1e6:.2f} M" if rate >= 1e5 else f"{rate:,.0f}"


class Workload:
    """A dataset to read, what a batch counts (rows, images or tokens), an epoch's total read in
    process, and the units each further consumer may leave out (a packed stream's tail shorter
    than a block, dropped by each consumer)."""

    def __init__(
        self, name: str, unit: str, make: Callable[[], Any], count: Callable[[dict[str, Any]], int], tail: int = 0
    ) -> None:
        self.name, self.unit, self.make, self.count, self.tail = name, unit, make, count, tail
        self.units = sum(count(batch) for batch in make())


def rates(loaders: dict[int, Any], workload: Workload, samples: int, sample_seconds: float) -> dict[int, float]:
    """Units per second of each loader: the median of ``samples`` samples after an untimed first
    epoch, the loaders taking turns (each round starting at another one) so that load from
    elsewhere falls on all of them alike. A sample is whole epochs of at least ``sample_seconds``
    (a packed epoch takes tens of milliseconds)."""
    names = list(loaders)
    sampled: dict[int, list[float]] = {name: [] for name in names}
    for sample in range(samples + 1):
        for name in in_turns(names, sample):
            spent = seen = 0.0
            while True:
                seconds, units = timed(loaders[name], workload.count)
                consumers = max(1, loaders[name].num_workers)
                if not workload.units - workload.tail * consumers <= units <= workload.units:
                    raise AssertionError(f"an epoch of num_workers={name} delivered {units} units of {workload.units}")
                spent, seen = spent + seconds, seen + units
                if not sample or spent >= sample_seconds:
                    break
            if sample:
                sampled[name].append(seen / spent)
    return {name: statistics.median(found) for name, found in sampled.items()}


def rows_of(column: str) -> Callable[[dict[str, Any]], int]:
    return lambda batch: int(batch[column].shape[0])


def workloads(root: Path, rows: int, images: int, tokens: int) -> list[Workload]:
    """The three workloads, their tables written under ``root`` when missing."""
    plain = benchmark_table(root, rows)
    image_table = root / f"images-{images}"
    if not image_table.exists():
        make_images(root / f"image-files-{images}", images, 10)
        ingest_images(root / f"image-files-{images}", f"spiral:{image_table}", split_rows=max(1, images // 8))
    image = Image("image", size=(64, 64), layout="CHW", dtype="float32", normalize="unit")
    corpus = root / f"tokens-{tokens}"
    if not corpus.exists():
        write_table(f"spiral:{corpus}", documents(tokens, 2_000), split_rows=2_000)
    return [
        Workload(
            "plain columns (`id`, `x`, `v[16]`), batch 1024",
            "rows",
            lambda: TableDataset(plain, batch_size=1024),
            rows_of("id"),
        ),
        Workload(
            "JPEGs to float32 3x64x64, batch 64",
            "images",
            lambda: TableDataset(TableSpec(f"spiral:{image_table}", columns=["image"], media=[image]), batch_size=64),
            rows_of("image"),
        ),
        Workload(
            f"packed tokens, blocks of {BLOCK}, 8 a batch",
            "tokens",
            lambda: PackedDataset(f"spiral:{corpus}", column="tokens", length=BLOCK, batch_size=8),
            lambda batch: int(batch["tokens"].numel()),
            tail=BLOCK,
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the plain table (default 1,000,000)")
    parser.add_argument("--images", type=int, default=1_000, help="JPEGs of the image table (default 1,000)")
    parser.add_argument("--tokens", type=int, default=10_000_000, help="tokens of the corpus (default 10,000,000)")
    parser.add_argument("--samples", type=int, default=5, help="timed samples a setting; the median counts (default 5)")
    parser.add_argument(
        "--sample-seconds", type=float, default=0.5, help="least seconds of whole epochs a sample takes (default 0.5)"
    )
    parser.add_argument("--root", type=Path, help="folder that keeps the tables between runs (default: a temp one)")
    options = parser.parse_args()
    if min(options.rows, options.images, options.tokens, options.samples) < 1:
        parser.error("--rows, --images, --tokens and --samples must be at least 1")
    multiprocessing.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="spiral-lightning-defaults-") as temp:
        root = options.root or Path(temp)
        root.mkdir(parents=True, exist_ok=True)
        lines = [
            "| workload | default (`loader()`) | "
            + " | ".join(f"`num_workers={n}`" for n in WORKER_COUNTS)
            + " | default / best |",
            "| --- | --- | " + " | ".join("---:" for _ in WORKER_COUNTS) + " | ---: |",
        ]
        ratios = []
        for workload in workloads(root, options.rows, options.images, options.tokens):
            # A loader's workers start at its first batch: made and dropped, it only says its count.
            chosen = workload.make().loader().num_workers
            loaders = {workers: workload.make().loader(num_workers=workers) for workers in WORKER_COUNTS}
            measured = rates(loaders, workload, options.samples, options.sample_seconds)
            del loaders
            ratios.append(measured[chosen] / max(measured.values()))
            cells = " | ".join(shown(measured[n]) for n in WORKER_COUNTS)
            lines.append(
                f"| {workload.name} ({workload.unit}/s) | `num_workers={chosen}` | {cells} | {ratios[-1]:.2f}x |"
            )
    print(
        f"Persistent forkserver workers; a rate is the median of {options.samples} samples of whole epochs, each at "
        f"least {options.sample_seconds} s, after an untimed first epoch (worker start-up excluded)"
    )
    print()
    print("\n".join(lines))
    print()
    worst = min(ratios)
    print(
        f"target the default >= {TARGET:.1f}x the best worker count on every workload: {worst:.2f}x, "
        f"{'met' if worst >= TARGET else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
