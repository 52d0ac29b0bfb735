"""A DataLoader worker that stops answering: the loader gives it up after its ``timeout``, says
which worker it was (id, process, rank), what its process is doing and where it was reading, and
ends it.

Torch's own timeout says only ``DataLoader timed out after N seconds``, and does not even get to
say it when the silent worker is stopped: a batch's tensors travel as file descriptors that the
worker's own process hands over when the main process unpickles the batch, so the main thread
waits for a stopped worker inside the unpickling, past any timeout. Here a relay thread does the
unpickling, and the main thread waits on it with the timeout. The main process knows the worker
whose batch it waits for (batches come in order, each from a known worker), every worker's process
id and state, and the dataset state each worker last reported with a batch (torchdata keeps one
per worker), which holds its rank and cursor. What the worker did after its last batch lives only
in its own process, which does not answer: the position named is its cursor after that batch,
where it was to read next.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch.utils.data import _utils as torch_utils
from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL
from torchdata.stateful_dataloader import Stateful
from torchdata.stateful_dataloader.stateful_dataloader import (
    _INDEX_SAMPLER_STATE,
    _ITERABLEDATASET_LEN_CALLED,
    _SAMPLER_ITER_STATE,
    _SAMPLER_ITER_YIELDED,
    _SHARED_SEED,
    _StatefulMultiProcessingDataLoaderIter,
)

from spiral_lightning.core.plan import Shard
from spiral_lightning.core.secrets import masked
from spiral_lightning.datasets.pipes import PipeQueue
from spiral_lightning.reading.blocks import forget


class WorkerTimeout(RuntimeError):
    """A DataLoader worker sent no batch within the loader's ``timeout`` seconds: it is stopped,
    hung or slower than allowed. The message names the worker, its process, its rank, its
    process's state and the work item it was reading. The loader cannot go on after it."""


#: The state letters of ``/proc/<pid>/stat``, in words.
_PROCESS_STATES = {
    "R": "running",
    "S": "sleeping (waiting on a lock, a socket or a queue)",
    "D": "in uninterruptible I/O (a stuck disk or network filesystem)",
    "T": "stopped (SIGSTOP, SIGTSTP or a debugger)",
    "t": "stopped by a tracer",
    "Z": "dead, not yet reaped",
    "X": "dead",
}


def process_state(pid: int) -> str | None:
    """What process ``pid`` is doing, in words, where ``/proc`` tells (Linux); ``None`` elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            code = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return _PROCESS_STATES.get(code, f"in state {code!r}")


def _mappings_with(value: Any, key: str) -> Iterator[Mapping[str, Any]]:
    """Every mapping nested in ``value`` (a state: dicts and lists) that holds ``key``, outermost first."""
    if isinstance(value, Mapping):
        if key in value:
            yield value
        for inner in value.values():
            yield from _mappings_with(inner, key)
    elif isinstance(value, list | tuple):
        for inner in value:
            yield from _mappings_with(inner, key)


def _rank(state: Any, dataset: Any, sampler: Any) -> int | None:
    """The rank a worker reads for: its state's shard, else the dataset's or sampler's rank."""
    for found in _mappings_with(state, "shard"):
        shard = found["shard"]
        if isinstance(shard, list | tuple) and shard and isinstance(shard[0], int):
            return shard[0]
    for holder in (dataset, sampler):
        rank = getattr(holder, "rank", None)
        if isinstance(rank, int):
            return rank
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return None


def _item(dataset: Any, shard: Any, index: int) -> str:
    """Work item ``index`` of ``shard``'s list, as ``(split 7, stored rows 0..5000)``; "" when the
    dataset cannot say (its lists are not plain work items, or the lookup fails)."""
    work = getattr(dataset, "work", None)
    if work is None or not isinstance(shard, list | tuple) or len(shard) != 4:
        return ""
    try:
        items = work(Shard(*shard))
        item = items[index] if isinstance(items, list) and 0 <= index < len(items) else None
        return "" if item is None else f" (split {item.split}, stored rows {item.start}..{item.end})"
    except Exception:  # a description must never hide the timeout itself
        return ""


def position(state: Any, dataset: Any) -> str:
    """Where a worker's last reported dataset ``state`` says it reads next, in words."""
    cursors = list(_mappings_with(state, "cursor"))
    if not cursors:
        return (
            "the main process keeps no position for it (a map-style worker reads the indices it is sent)"
            if state is None
            else "its state names no cursor"
        )
    said = []
    for found in cursors[:3]:
        cursor, epoch = found["cursor"], found.get("epoch")
        in_epoch = f", epoch {epoch}" if isinstance(epoch, int) else ""
        if not isinstance(cursor, list | tuple) or len(cursor) < 2:
            said.append(f"the start of its work list{in_epoch} (no batch delivered yet)")
            continue
        item = _item(dataset, found.get("shard"), cursor[0]) if len(cursors) == 1 else ""
        skip = f", skip {cursor[2]}" if len(cursor) > 2 and cursor[2] else ""
        said.append(f"work item {cursor[0]} of its list{item} at stored row {cursor[1]}{skip}{in_epoch}")
    return "; ".join(said) + ("; ..." if len(cursors) > 3 else "")


#: The process states of a worker that will not answer by itself.
_FROZEN = ("stopped", "dead")


def silent_worker(iterator: Any) -> tuple[int | None, int | None]:
    """The worker to blame for a wait past the timeout, and the worker whose batch was awaited.
    They differ when the awaited worker is held up behind a stopped one: its batch queued after
    one of the stopped worker's, whose tensors that worker never hands over, or it waits on a lock
    the stopped worker holds. A stopped (or dead) worker is blamed before a merely slow one."""
    info = iterator._task_info.get(iterator._rcvd_idx)
    awaited = info[0] if info and isinstance(info[0], int) else None
    frozen = [
        worker
        for worker, process in enumerate(iterator._workers)
        if not process.is_alive() or (process_state(process.pid) or "").startswith(_FROZEN)
    ]
    if awaited in frozen or not frozen:
        return awaited, awaited
    return frozen[0], awaited


def describe(iterator: Any, timeout: float, worker: int | None, awaited: int | None) -> str:
    """The message of a ``WorkerTimeout``: the silent ``worker`` (see ``silent_worker``), its
    process, rank, process state and position."""
    if worker is None:
        return f"no DataLoader worker sent a batch for {timeout:g} s (the loader's timeout)"
    pid = iterator._workers[worker].pid
    snapshot = iterator._worker_snapshots.get(f"worker_{worker}")
    state = snapshot.get_state().get("dataset_state") if snapshot is not None else None
    # A wrapper that reads a dataset in groups (groups.Grouped) holds it as .dataset.
    dataset = getattr(iterator._dataset, "dataset", iterator._dataset)
    sampler = getattr(iterator, "_index_sampler", None)
    rank = _rank(state, dataset, getattr(sampler, "sampler", sampler))
    doing = process_state(pid)
    uri = getattr(getattr(dataset, "spec", None), "uri", None)
    table = f", in {masked(uri)!r}" if isinstance(uri, str) else ""
    behind = "" if awaited in (None, worker) else f" (the batch awaited, worker {awaited}'s, is held up behind it)"
    return (
        f"DataLoader worker {worker} (pid {pid}) of rank {'unknown' if rank is None else rank} sent no batch for "
        f"{timeout:g} s (the loader's timeout){behind}" + (f"; its process is {doing}" if doing else "") + ". "
        f"It was to read next{table}: {position(state, dataset)} (its cursor after its last batch). The loader "
        "gives a silent worker up instead of waiting forever, and ends it (SIGKILL): find why it stopped, or give "
        "the loader a longer timeout= (seconds; 0 waits forever) if its reads may take that long"
    )


class _Raised(NamedTuple):
    """An error the relay met reading a batch, for the main thread to raise as its own."""

    error: BaseException


class _Relayed(queue.Queue[Any]):
    """The relay's queue: what ``get`` returns, or the relay's error raised."""

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        item = super().get(block, timeout)
        if isinstance(item, _Raised):
            raise item.error
        return item


def _relay(source: Any, target: _Relayed, done: threading.Event, pids: list[int]) -> None:
    """Move the workers' results from ``source`` to ``target`` until ``done``. Reading one may
    block for good: a batch's tensors come by file descriptor from the worker that made them,
    which a stopped worker never sends; then only this thread waits, not the loader. After a
    few errors in a row (a queue that no longer reads) it stops: the loader has failed by then.
    Ending, it unmaps the blocks of the workers ``pids``: a batch it read as the loader shut
    down may have mapped one after the loader unmapped them."""
    try:
        _relayed(source, target, done)
    finally:
        forget(pids)


def _relayed(source: Any, target: _Relayed, done: threading.Event) -> None:
    errors = 0
    while not done.is_set() and errors < _RELAY_ERRORS:
        try:
            item = source.get(timeout=MP_STATUS_CHECK_INTERVAL)
            errors = 0
        except queue.Empty:
            continue
        except Exception as error:  # a batch whose worker died, or the queue closed at shut-down
            if done.is_set():
                return
            item, errors = _Raised(error), errors + 1
        target.put(item)


#: Errors in a row after which the relay stops reading a queue.
_RELAY_ERRORS = 8


class WatchedIterator(_StatefulMultiProcessingDataLoaderIter):  # type: ignore[misc]  # torchdata has no hints
    """torchdata's multi-process iterator, whose wait past ``timeout`` raises ``WorkerTimeout``
    naming the silent worker instead of torch's bare ``DataLoader timed out``, and ends that
    worker (SIGKILL: a stopped process ignores the SIGTERM of the loader's shut-down, and would
    stay stopped). It waits in steps of torch's status interval, so a worker that died
    (``exited unexpectedly``) is still found within seconds, as without a timeout. The workers'
    results are read by a relay thread (as the pin-memory thread does with ``pin_memory=True``):
    a batch's tensors arrive by file descriptor from the worker's own process, and from a stopped
    worker the main thread would wait for them forever, past any timeout."""

    _relay_done: threading.Event | None = None
    _relay_thread: threading.Thread | None = None
    #: The samplers last found not to be ``Stateful``.
    _stateless: tuple[Any, Any] | None = None

    def _get_main_state(self) -> dict[str, Any]:
        # torchdata asks whether each sampler is Stateful for every item it sends a worker: a
        # Protocol check of ~10 us on Python 3.11. The answer holds while the samplers are the same.
        samplers = (self._sampler_iter, self._index_sampler)
        stateless = self._stateless
        if stateless is None or stateless[0] is not samplers[0] or stateless[1] is not samplers[1]:
            if any(isinstance(sampler, Stateful) for sampler in samplers):
                return super()._get_main_state()  # type: ignore[no-any-return]
            self._stateless = samplers
        return {
            self._NUM_WORKERS: self._num_workers,
            _SAMPLER_ITER_STATE: None,
            _INDEX_SAMPLER_STATE: None,
            _SAMPLER_ITER_YIELDED: self._sampler_iter_yielded,
            _ITERABLEDATASET_LEN_CALLED: self._IterableDataset_len_called,
            _SHARED_SEED: self._shared_seed,
            self._BASE_SEED: self._base_seed,
        }

    def _try_get_data(self, timeout: float = MP_STATUS_CHECK_INTERVAL) -> Any:
        if self._relay_done is None and self._timeout > 0 and not self._pin_memory:
            # First called while the base class starts the workers; from then on only the relay
            # reads their queue. The thread holds no reference to the iterator, which is freed as usual.
            self._relay_done = threading.Event()
            relayed = _Relayed()
            pids = [worker.pid for worker in self._workers]
            arguments = (self._worker_result_queue, relayed, self._relay_done, pids)
            self._relay_thread = threading.Thread(
                target=_relay, args=arguments, name="spiral-lightning-relay", daemon=True
            )
            self._relay_thread.start()
            self._data_queue = relayed
        try:
            return super()._try_get_data(timeout)
        except RuntimeError:
            # A worker died (torch's "exited unexpectedly"): the epoch cannot go on. End the others
            # now, not whenever the traceback that holds this iterator goes.
            self._shutdown_workers()
            raise
        except (EOFError, OSError) as error:
            # A batch's descriptors come from its worker: one killed as it sends them fails the
            # read before its exit shows. Give the exit a moment, then name the worker as torch does.
            dead = self._dead_workers()
            if dead:
                self._shutdown_workers()
                raise RuntimeError(f"DataLoader worker (pid(s) {dead}) exited unexpectedly") from error
            raise

    def _dead_workers(self, wait: float = 2.0) -> str:
        """The pids of the workers that exited, waiting up to ``wait`` seconds for one to; each is
        marked unavailable, as torch marks the workers it finds dead."""
        deadline = time.monotonic() + wait
        while True:
            dead = [
                index
                for index, worker in enumerate(self._workers)
                if self._workers_status[index] and not worker.is_alive()
            ]
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        for index in dead:
            self._mark_worker_as_unavailable(index)
        return ", ".join(str(self._workers[index].pid) for index in dead)

    def _get_data(self) -> Any:
        if self._timeout <= 0:
            return super()._get_data()
        deadline = time.monotonic() + self._timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                worker, awaited = silent_worker(self)
                message = describe(self, self._timeout, worker, awaited)
                if worker is not None and self._workers[worker].is_alive():
                    self._workers[worker].kill()
                raise WorkerTimeout(message)
            if self._pin_memory and not self._pin_memory_thread.is_alive():
                raise RuntimeError("Pin memory thread exited unexpectedly")
            success, data = self._try_get_data(min(left, MP_STATUS_CHECK_INTERVAL))
            if success:
                return data

    def _shutdown_workers(self) -> None:
        results = getattr(self, "_worker_result_queue", None)
        for pipe in (results, *getattr(self, "_index_queues", ())):
            if isinstance(pipe, PipeQueue):
                # A worker killed mid-write holds the queue's write lock, and at the interpreter's
                # exit a pipe may be closed before its loader: the wake-up puts must not wait or fail.
                pipe.closing = True
        exiting = torch_utils.python_exit_status is not False  # torch's own test: Python is shutting down
        if self._relay_done is not None and exiting:
            self._relay_done.set()
        if self._relay_done is not None and not self._relay_done.is_set():
            # As torch ends its pin-memory thread: wake the relay, let it end, close its queue,
            # so that no thread, pipe or lock outlives the loader. A relay still held by a worker
            # that does not answer is left to end with it (a daemon thread blocks nothing).
            self._relay_done.set()
            with contextlib.suppress(Exception):
                self._worker_result_queue.put((None, None))
            if self._relay_thread is not None:
                self._relay_thread.join(timeout=MP_STATUS_CHECK_INTERVAL)
            if self._relay_thread is None or not self._relay_thread.is_alive():
                self._worker_result_queue.cancel_join_thread()
                self._worker_result_queue.close()
        super()._shutdown_workers()
        # The blocks their batches came in: unmapped here, not when the process next meets a new pool.
        forget(worker.pid for worker in getattr(self, "_workers", ()) if worker.pid is not None)
