"""A DataLoader worker that stops answering (SIGSTOP) fails the loader after its ``timeout``,
naming the worker, its process, its rank and where it was reading, instead of hanging the run; a
worker that dies is still found within seconds under a long timeout."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import queue
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from spiral_lightning import (
    Mixture,
    SpiralDataModule,
    TableDataset,
    TableMapDataset,
    TableSpec,
    WindowDataset,
    Windows,
)
from spiral_lightning.datasets.loader import WORKER_TIMEOUT, Loader, loader_options
from spiral_lightning.datasets.pipes import piped
from spiral_lightning.datasets.stuck import WorkerTimeout, position, process_state

#: Eight row groups of 500 rows: each of two workers reads 40 batches of 50.
SIZES = [500] * 8
#: The timeout the tests give: a stopped worker must fail the loader this soon after its last batch.
TIMEOUT = 3.0


def worker_pids(iterator: Any) -> list[int]:
    return [worker.pid for worker in iterator._workers]


def stopped(pid: int) -> bool:
    return (process_state(pid) or "").startswith("stopped")


def drain(iterator: Iterator[Any]) -> int:
    return sum(1 for _ in iterator)


@contextlib.contextmanager
def stopped_worker(iterator: Any, worker: int) -> Iterator[list[int]]:
    """Worker ``worker`` of a loader's ``iterator`` stopped (SIGSTOP) for the block, which gets every worker's
    pid; on leaving, each worker is woken (SIGCONT: a stopped process cannot act on the shut-down) and shut
    down, and, when the block passed, none is found still stopped."""
    pids = worker_pids(iterator)
    os.kill(pids[worker], signal.SIGSTOP)
    try:
        yield pids
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        iterator._shutdown_workers()
    assert not [pid for pid in pids if stopped(pid)]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_stopped_worker_fails_the_loader_naming_the_worker_its_rank_and_its_work_item(
    make_table: Callable[..., TableSpec], rank: int
) -> None:
    spec = make_table(SIZES, backend="parquet", columns=["id"])
    dataset = TableDataset(spec, batch_size=50, rank=rank, world_size=2)
    # Batch by batch (group=1): in groups a worker would have sent its whole list before the stop.
    loader = dataset.loader(num_workers=2, timeout=TIMEOUT, group=1)
    assert isinstance(loader, Loader) and loader.timeout == TIMEOUT
    iterator = iter(loader)
    for _ in range(5):  # mid-epoch: both workers started and delivered
        next(iterator)
    with stopped_worker(iterator, 1) as pids:
        started = time.monotonic()
        with pytest.raises(WorkerTimeout) as caught:
            drain(iterator)
        waited = time.monotonic() - started
    message = str(caught.value)
    assert f"DataLoader worker 1 (pid {pids[1]}) of rank {rank} sent no batch for 3 s" in message, message
    assert "its process is stopped (SIGSTOP" in message, message
    assert f"It was to read next, in {spec.uri!r}: work item " in message
    assert re.search(
        r"work item \d+ of its list \(split \d+, stored rows \d+\.\.\d+\) at stored row \d+(, skip \d+)?, epoch 0 ",
        message,
    ), message
    assert "timeout=" in message
    # The batches already in flight come first; then the wait is the timeout, not forever.
    assert TIMEOUT - 0.5 <= waited < TIMEOUT + 20, waited


def test_a_stopped_map_style_worker_is_named_with_the_samplers_rank(make_table: Callable[..., TableSpec]) -> None:
    # TableMapDataset.loader builds a plain StatefulDataLoader today; built as a Loader, as it will be:
    dataset = TableMapDataset(make_table(SIZES, backend="parquet"), columns=["id"])
    sampler = StatefulDistributedSampler(dataset, num_replicas=2, rank=1, shuffle=False)
    settings = loader_options(2, {"timeout": TIMEOUT}, dataset)
    iterator = iter(Loader(dataset, batch_size=50, sampler=sampler, **settings))
    for _ in range(5):
        next(iterator)
    with stopped_worker(iterator, 0) as pids, pytest.raises(WorkerTimeout) as caught:
        drain(iterator)
    message = str(caught.value)
    assert f"DataLoader worker 0 (pid {pids[0]}) of rank 1 sent no batch for 3 s" in message, message
    assert "the main process keeps no position for it (a map-style worker" in message


def test_a_worker_that_dies_is_found_within_seconds_under_the_default_timeout(
    make_table: Callable[..., TableSpec],
) -> None:
    spec = make_table(SIZES, backend="parquet", columns=["id"])
    # Batch by batch (group=1): in groups a worker would have sent its whole share before the kill.
    loader = TableDataset(spec, batch_size=50).loader(num_workers=2, group=1)
    assert loader.timeout == WORKER_TIMEOUT == 300
    iterator = iter(loader)
    pids = worker_pids(iterator)
    try:
        next(iterator)
        os.kill(pids[0], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"DataLoader worker \(pid\(s\) {pids[0]}\) exited unexpectedly"):
            drain(iterator)
        assert time.monotonic() - started < 30
    finally:
        iterator._shutdown_workers()


def test_the_relay_thread_and_its_queue_end_with_the_loader(make_table: Callable[..., TableSpec]) -> None:
    dataset = TableDataset(make_table([200, 200], backend="parquet", columns=["id"]), batch_size=50)

    def read_and_drop() -> int:
        loader = dataset.loader(num_workers=2)
        assert drain(iter(loader)) == 8
        del loader
        gc.collect()
        return len(os.listdir("/proc/self/fd"))

    first = read_and_drop()  # the first may start the forkserver, which stays
    # A loader that leaves a descriptor behind makes the count grow from one loader to the next;
    # descriptors of earlier tests in this process may still close meanwhile, so it may shrink.
    counts = [first, *(read_and_drop() for _ in range(3))]
    assert all(later <= earlier for earlier, later in itertools.pairwise(counts)), counts
    assert not [thread for thread in threading.enumerate() if thread.name == "spiral-lightning-relay"]


def test_every_loader_the_datasets_build_times_out_and_none_without_workers(
    make_table: Callable[..., TableSpec],
) -> None:
    spec = make_table([200, 200], backend="parquet", columns=["id", "x"])
    built = [
        TableDataset(spec, batch_size=50).loader(num_workers=1),
        Mixture([(spec, 1.0), (spec, 1.0)], batch_size=50).loader(num_workers=1),
        WindowDataset(spec, windows=Windows(4), batch_size=8).loader(num_workers=1),
    ]
    for loader in built:
        assert isinstance(loader, Loader) and loader.timeout == WORKER_TIMEOUT
    assert TableDataset(spec, batch_size=50).loader(num_workers=1, timeout=0).timeout == 0
    # Without workers torch refuses any timeout; one given for workers is left out, and the loader reads.
    alone = TableDataset(spec, batch_size=50).loader(num_workers=0, timeout=TIMEOUT)
    assert alone.timeout == 0 and drain(iter(alone)) == 8


def test_the_position_named_is_the_workers_last_reported_cursor() -> None:
    state = {"shard": [1, 2, 0, 2], "epoch": 3, "cursor": [4, 120, 0, 0, 0]}
    assert position(state, None) == "work item 4 of its list at stored row 120, epoch 3"
    assert (
        position({"epoch": 0, "cursor": None}, None) == "the start of its work list, epoch 0 (no batch delivered yet)"
    )
    mixture = {"tables": [{"state": {"epoch": 0, "cursor": [0, 5]}}, {"state": {"epoch": 0, "cursor": [2, 7, 3]}}]}
    assert (
        position(mixture, None)
        == "work item 0 of its list at stored row 5, epoch 0; work item 2 of its list at stored row 7, skip 3, epoch 0"
    )
    assert "map-style" in position(None, None)


def test_every_loader_the_package_makes_gives_workers_up_after_its_timeout(
    make_table: Callable[..., TableSpec],
) -> None:
    spec = make_table([100, 100], columns=["id"])
    assert TableDataset(spec, batch_size=10).loader(num_workers=1).timeout == WORKER_TIMEOUT
    assert TableMapDataset(spec).loader(batch_size=10, num_workers=1, timeout=9).timeout == 9
    assert Mixture([(spec, 1.0)], batch_size=10).loader(num_workers=1).timeout == WORKER_TIMEOUT
    data = SpiralDataModule(train=spec, batch_size=10, num_workers=1, timeout=7)
    data.setup("fit")
    assert data.train_dataloader().timeout == 7
    assert isinstance(data.train_dataloader(), Loader)


def test_a_writer_that_died_holding_the_queue_lock_does_not_hang_the_shutdown() -> None:
    results = piped("forkserver").Queue()
    # As a worker killed in the middle of a put leaves it: the writers' lock held, never released.
    assert results._wlock.acquire(timeout=1)
    with pytest.raises(queue.Full):
        results.put((None, None), timeout=0.2)
    results.closing = True
    started = time.monotonic()
    results.put((None, None))  # the loader's wake-up message on shut-down: dropped, not waited on
    assert time.monotonic() - started < 5
