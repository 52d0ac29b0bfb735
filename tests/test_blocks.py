"""A worker's pool of shared-memory blocks: reused, never overwritten under a batch still held,
unmapped when its loader goes, and queues that need no feeder thread."""

from __future__ import annotations

import copy
import gc
import os
import queue
import signal
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from spiral_lightning import TableDataset, TableSpec
from spiral_lightning.datasets.pipes import PIPE_CONTEXTS, Flag, PipeQueue
from spiral_lightning.reading import blocks


def torch_mappings() -> int:
    """The shared-memory blocks this process maps (torch names each ``torch_<pid>_...``)."""
    gc.collect()
    with open("/proc/self/maps") as maps:
        return sum("/torch_" in line for line in maps)


def check_rows(batches: list[dict[str, torch.Tensor]], rows: int) -> None:
    """Every id once, and every row's values those of its id (x = id / 2, v = 4 * id ...)."""
    ids = torch.cat([batch["id"] for batch in batches])
    assert sorted(ids.tolist()) == list(range(rows))
    for batch in batches:
        assert torch.equal(batch["x"], batch["id"].to(torch.float32) / 2)
        assert torch.equal(batch["v"][:, 0], batch["id"].to(torch.float32) * 4)


@pytest.fixture
def own_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool and a table of received pools of this test's own, as a worker and a loader have."""
    monkeypatch.setattr(blocks, "_pool", None)
    monkeypatch.setattr(blocks, "_mapped", {})


def test_a_pooled_batch_pickles_small_and_rebuilds_the_same_tensors(own_pool: None) -> None:
    batch = {
        "id": torch.arange(300, dtype=torch.int64),
        "x": torch.linspace(0, 1, 300),
        "flag": torch.arange(300) % 3 == 0,
        "half": torch.ones(300, 2, dtype=torch.bfloat16),
        "ragged": [torch.ones(2, dtype=torch.uint8), None],
        "name": ["a"] * 300,
    }
    sent = blocks.pooled(batch, [batch["id"], batch["x"], batch["flag"], batch["half"], batch["ragged"][0]])
    assert sent is not None and dict(sent) == batch
    first = ForkingPickler.dumps(sent)
    received = ForkingPickler.loads(first)
    second = ForkingPickler.loads(ForkingPickler.dumps(sent))
    for got in (received, second):
        assert list(got) == list(batch)
        for name in ("id", "x", "flag", "half"):
            assert got[name].dtype == batch[name].dtype and torch.equal(got[name], batch[name])
        assert torch.equal(got["ragged"][0], batch["ragged"][0]) and got["ragged"][1] is None
        assert got["name"] == batch["name"]
    # Once the receiver holds the block, a batch is its slots, not its bytes (5 KB of tensors here).
    assert len(ForkingPickler.dumps(sent)) < 1000


def test_a_block_is_free_again_only_when_every_tensor_of_its_batch_is_gone(own_pool: None) -> None:
    batch = {"id": torch.arange(1000), "x": torch.zeros(1000)}
    sent = blocks.pooled(batch, batch.values())
    assert sent is not None
    pool, index = sent.lease.pool, sent.lease.index
    received = ForkingPickler.loads(ForkingPickler.dumps(sent))
    del sent
    gc.collect()
    kept = received["x"][10:20]
    del received
    gc.collect()
    # A view of one tensor still holds the whole batch's block.
    assert pool.flags[index] == 0
    del kept
    gc.collect()
    assert pool.flags[index] == 1
    # A batch collected without being sent, and its shallow copies, give their block back too.
    unsent = blocks.pooled(batch, batch.values())
    assert unsent is not None
    other = unsent.lease.index
    copied = copy.copy(unsent)
    assert isinstance(copied, blocks.Pooled) and copied.lease is unsent.lease
    del unsent
    gc.collect()
    assert pool.flags[other] == 0
    del copied
    gc.collect()
    assert pool.flags[other] == 1


def test_a_pool_of_large_batches_stops_growing_at_its_byte_budget(
    own_pool: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(blocks, "MAX_POOL_BYTES", 1 << 20)
    batch = {"x": torch.zeros(300_000, dtype=torch.uint8)}
    held = [blocks.pooled(batch, batch.values()) for _ in range(6)]
    # FEW_BLOCKS blocks whatever their size; past them, none that would take the pool over its budget.
    assert [sent is not None for sent in held] == [True] * blocks.FEW_BLOCKS + [False] * 2
    small = {"x": torch.zeros(1000, dtype=torch.uint8)}
    assert blocks.pooled(small, small.values()) is None
    freed = held.pop(0)
    assert freed is not None
    index = freed.lease.index
    del freed
    gc.collect()
    reused = blocks.pooled(small, small.values())
    assert reused is not None and reused.lease.index == index


@pytest.mark.slow
def test_a_worker_reuses_its_blocks_and_batches_kept_keep_their_values(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([1200, 800, 2000], seed=3, backend="parquet")
    dataset = TableDataset(spec, batch_size=50)
    # Groups of 2 batches: 20 groups a worker, more than a pool's blocks.
    loader = dataset.loader(num_workers=2, group=2)
    # Dropped at each step: each worker's few blocks carry all 80 batches.
    seen = []
    for batch in loader:
        seen.append({name: value.clone() for name, value in batch.items()})
        assert len(blocks._mapped) <= 2 and all(len(m.blocks) <= 8 for m in blocks._mapped.values())
    check_rows(seen, 4000)
    # Kept: more batches than a pool holds, so past MAX_BLOCKS each takes a block of its own; a
    # second epoch read meanwhile overwrites none of them.
    kept = list(loader)
    again = list(loader)
    check_rows(kept, 4000)
    check_rows(again, 4000)
    assert [batch["id"].tolist() for batch in kept] == [batch["id"].tolist() for batch in again]
    # Default groups: each worker's batches are views of one converted group; kept, they keep it.
    grouped = dataset.loader(num_workers=2)
    kept, again = list(grouped), list(grouped)
    check_rows(kept, 4000)
    assert [batch["id"].tolist() for batch in kept] == [batch["id"].tolist() for batch in again]


@pytest.mark.slow
def test_shared_memory_is_unmapped_when_the_loader_goes_or_a_worker_is_killed(
    make_table: Callable[..., TableSpec],
) -> None:
    spec = make_table([1200, 800, 2000], seed=3, backend="parquet")
    before = torch_mappings()
    loader = TableDataset(spec, batch_size=100).loader(num_workers=2)
    check_rows(list(loader), 4000)
    del loader
    assert torch_mappings() == before and not blocks._mapped
    # Batch by batch (group=1): in groups a worker may have sent its whole share before the kill.
    loader = TableDataset(spec, batch_size=100).loader(num_workers=2, group=1)
    iterator = iter(loader)
    next(iterator)
    # The workers read their "done" event without a lock: one killed while it read a locked event
    # held its lock, and the loader waited for it forever as it ended the others.
    assert isinstance(iterator._workers_done_event, Flag)
    os.kill(iterator._workers[0].pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="exited unexpectedly"):
        list(iterator)
    del iterator, loader
    assert torch_mappings() == before and not blocks._mapped


@pytest.mark.slow
def test_a_dataloader_that_batches_the_batches_again_gets_the_right_rows(make_table: Callable[..., TableSpec]) -> None:
    # Its collate copies each pooled batch's values into new tensors; the pooled copies die unsent.
    spec = make_table([400, 400], seed=1)
    loader = DataLoader(
        TableDataset(spec, batch_size=10), batch_size=4, num_workers=1, multiprocessing_context="forkserver"
    )
    stacked = list(loader)
    assert all(batch["id"].shape == (4, 10) for batch in stacked)
    assert sorted(torch.cat([batch["id"].reshape(-1) for batch in stacked]).tolist()) == list(range(800))


def test_a_pipe_queue_passes_messages_and_times_out_when_empty() -> None:
    pipe = PIPE_CONTEXTS["forkserver"].Queue()
    assert isinstance(pipe, PipeQueue)
    with pytest.raises(queue.Empty):
        pipe.get(timeout=0.01)
    with pytest.raises(queue.Empty):
        pipe.get(block=False)
    pipe.put((1, {"a": [1, 2]}))
    assert pipe.get(timeout=1) == (1, {"a": [1, 2]})
    pipe.cancel_join_thread()
    pipe.join_thread()
    pipe.close()
    # A put into a closed pipe fails, unless its loader is closing: at the interpreter's exit a
    # loader may shut its workers down after their pipes were closed.
    closed = PIPE_CONTEXTS["forkserver"].Queue()
    closed._writer.close()
    with pytest.raises(OSError):
        closed.put(None)
    closed.closing = True
    closed.put(None)


def test_a_loader_finalized_while_a_batch_is_received_forgets_its_workers_without_a_deadlock() -> None:
    # CI hung here once: `_received` held the lock, a collection finalized an older loader's
    # iterator, and its shutdown's `forget` waited for that lock on the same thread. Finalizers run
    # synchronously when the last reference goes, as this one does inside the lock.
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    blocks._mapped["dead-worker"] = blocks._Mapped(finished.pid, np.zeros(4, dtype=np.uint8))

    class Iterator:
        pass

    def receive() -> None:
        with blocks._mapped_lock:
            collected = Iterator()
            weakref.finalize(collected, blocks.forget, [finished.pid])
            del collected
            blocks._forget_dead()

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive(), "forget waited for a lock its own thread held"
    assert "dead-worker" not in blocks._mapped
