"""How fast a table reads under each loader setting: what ``spiral-lightning bench`` measures.

A *setting* is a number of DataLoader workers (0 reads in the main process) and of reading
threads a process (``read_threads``). A setting's *rate* is its rows, bytes and batches over the
seconds it read, timed from each worker's first batch on, so that process start-up and the first
reads (opening the table, planning) are left out: what a long job sees after its first steps.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spiral_lightning.core.spec import TableSpec
from spiral_lightning.datasets.stall import rows_of
from spiral_lightning.datasets.table import TableDataset
from spiral_lightning.sources.cache import kept_entries

#: The most workers tried when none are given (``--workers`` tries others): each is a process
#: with its own memory and its own opened table.
MOST_WORKERS = 4
#: A setting this much slower than the fastest still counts as fast enough, and the one with the
#: fewest processes among those is recommended: each worker costs a process and its memory.
CLOSE = 0.05
#: Below this rate (10^6 bytes a second of tensors) even the best setting earns a hint on why.
SLOW_MB_PER_S = 100.0
#: Batches smaller than this (bytes of tensors, 1 MB) pay mostly per-batch costs.
SMALL_BATCH = 1_000_000


@dataclass(frozen=True)
class Setting:
    """One way of reading: ``workers`` DataLoader workers and ``read_threads`` reading threads in
    each process that reads (``None``: twice the process's share of the cores, see ``TableDataset``),
    reading the table or, with ``decoded``, the spec's decoded cache (filled beforehand)."""

    workers: int
    read_threads: int | None = None
    decoded: bool = False

    def __str__(self) -> str:
        threads = "auto" if self.read_threads is None else self.read_threads
        return f"num_workers={self.workers} read_threads={threads}" + (" decoded_cache" if self.decoded else "")


@dataclass(frozen=True)
class Measured:
    """What one setting read in ``seconds``: ``rows``, ``bytes`` (the tensors' ``nbytes``) and
    ``batches``, each worker's first batch left out."""

    setting: Setting
    rows: int
    bytes: int
    batches: int
    seconds: float

    @property
    def rows_per_s(self) -> float:
        """Rows a second."""
        return self.rows / self.seconds

    @property
    def mb_per_s(self) -> float:
        """Megabytes (10^6 bytes) of tensors a second."""
        return self.bytes / self.seconds / 1e6

    @property
    def batches_per_s(self) -> float:
        """Batches a second."""
        return self.batches / self.seconds


def default_workers() -> list[int]:
    """The worker counts tried when none are given: 0 (in process) and one a core, at most ``MOST_WORKERS``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return [0, min(MOST_WORKERS, cores)]


def measure(
    spec: TableSpec,
    setting: Setting,
    *,
    batch_size: int,
    seconds: float,
) -> Measured:
    """Read ``spec`` (a ``TableDataset`` of ``batch_size``, through its ``loader()``) under
    ``setting`` for ``seconds`` after each worker's first batch, in passes of epoch 0 for as long
    as that takes. ``ValueError`` when a pass yields no rows (a filter that keeps none), and
    whatever building the dataset raises (no such table, an unknown column)."""
    dataset = TableDataset(spec, batch_size=batch_size, read_threads=setting.read_threads)
    loader = dataset.loader(num_workers=setting.workers)
    # The batches before timing starts: one from each worker, since each starts on its own.
    warm_up = max(1, setting.workers)
    rows = size = batches = 0
    started = 0.0
    while True:
        passed = 0
        for batch in loader:
            passed += 1
            if warm_up:
                warm_up -= 1
                started = time.perf_counter()
                continue
            rows += rows_of(batch)
            size += tensor_bytes(batch)
            batches += 1
            spent = time.perf_counter() - started
            if spent >= seconds:
                return Measured(setting, rows, size, batches, spent)
        if not passed:
            raise ValueError(f"{spec.uri} has no rows to read" + ("" if spec.filter is None else " under its filter"))


def fill(spec: TableSpec, batch_size: int) -> tuple[float, int]:
    """Read ``spec`` once in process so that its decoded cache holds every work item of that
    pass; the seconds it took and the bytes the cache's folder holds after it."""
    assert spec.decoded_cache_dir is not None, "fill is for a spec with a decoded cache"
    began = time.perf_counter()
    for _ in TableDataset(spec, batch_size=batch_size):
        pass
    held = sum(path.stat().st_size for path in kept_entries(spec.decoded_cache_dir))
    return time.perf_counter() - began, held


def tensor_bytes(batch: Any) -> int:
    """The bytes of the tensors in ``batch``: a tensor, or a dict, list or tuple of them (nested);
    anything else (lists of strings) counts 0."""
    if isinstance(batch, torch.Tensor):
        return batch.nbytes
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, list | tuple) else ()
    return sum(tensor_bytes(item) for item in items)


def recommended(results: Sequence[Measured]) -> Measured:
    """The setting to read with: of those within ``CLOSE`` of the fastest, the one with the fewest
    workers (the fastest of them)."""
    best = max(result.rows_per_s for result in results)
    close = [result for result in results if result.rows_per_s >= best * (1 - CLOSE)]
    return min(close, key=lambda result: (result.setting.workers, -result.rows_per_s))


def report(results: Sequence[Measured], batch_size: int) -> str:
    """``results`` as a table, one line a setting with its rates and its ratio to the fastest,
    then the recommended setting and, when even the fastest is slow, a hint on why."""
    best = max(result.rows_per_s for result in results)
    width = max(len("setting"), *(len(str(result.setting)) for result in results))
    lines = [f"{'setting':<{width}}  {'rows/s':>12}  {'MB/s':>9}  {'batches/s':>10}  {'vs best':>7}"]
    for result in results:
        lines.append(
            f"{result.setting!s:<{width}}  {result.rows_per_s:>12,.0f}  {result.mb_per_s:>9.1f}  "
            f"{result.batches_per_s:>10.1f}  {result.rows_per_s / best:>6.2f}x"
        )
    lines.append("timed from each worker's first batch on: process start-up and the first reads are left out")
    chosen = recommended(results)
    why = "the fastest" if chosen.rows_per_s == best else f"within {CLOSE:.0%} of the fastest, in fewer processes"
    lines.append(f"recommended: {chosen.setting} batch_size={batch_size} ({why})")
    fastest = max(results, key=lambda result: result.rows_per_s)
    if fastest.mb_per_s < SLOW_MB_PER_S:
        lines.append(slow_hint(fastest, batch_size))
    return "\n".join(lines)


def slow_hint(fastest: Measured, batch_size: int) -> str:
    """Why even ``fastest`` reads under ``SLOW_MB_PER_S``, judged by the size of its batches."""
    each = fastest.bytes / max(1, fastest.batches)
    if each < SMALL_BATCH:
        return (
            f"hint: even the fastest reads {fastest.mb_per_s:.1f} MB/s in batches of {each / 1e3:.1f} kB: each "
            "batch costs about the same whatever its size (cutting, converting, and through workers a hand-off in "
            f"shared memory), so small batches are slow; a larger --batch-size than {batch_size} reads more a batch"
        )
    return (
        f"hint: even the fastest reads {fastest.mb_per_s:.1f} MB/s in batches of {each / 1e6:.1f} MB: reading is "
        "the limit, not batching; try more --read-threads for plain columns, more --workers for media to decode, "
        "and for an object store a machine near the data"
    )
