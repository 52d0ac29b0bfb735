"""Reading ahead: a source's reads on threads of their own, a few read batches before the consumer.

Read in line, a pass alternates: the consumer waits while the source decodes a read batch, then
the source idles while the consumer frames it and trains on the frames. A reading thread keeps
the source decoding while the consumer works (backends release the GIL while they read), so a
pass takes about the longer of the two instead of their sum. Several reading threads, each
reading the next work item not yet taken, decode on several cores at once; the consumer still
takes the batches item by item, in the order of its work list.
"""

from __future__ import annotations

import atexit
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import NamedTuple, cast

from torch.utils.data import get_worker_info

from spiral_lightning.core.checks import check_positive
from spiral_lightning.core.plan import WorkItem
from spiral_lightning.sources import ReadBatch, Source

#: The most work items a consumer reads at once when not told: past a few, reads mostly contend.
MOST_READ_THREADS = 4

#: The bytes of read batches a pass may hold for each of its reading threads beyond their
#: ``depth`` batches a queue: a thread ahead of the consumer's item keeps decoding instead of
#: idling on a full queue, so threads read at once (a run of small rows is a few MB); wide rows
#: (images) stay at ``depth`` batches.
AHEAD_BYTES = 16 << 20

#: The fewest stored rows a reading thread takes in one read: each read call sets up a scan (a
#: few milliseconds), so short items (the blocks of a ``Shuffled`` policy) are read in runs.
RUN_ROWS = 65_536


def default_read_threads() -> int:
    """Reads at once in this process when not told: twice its share of the machine's cores beside
    the other DataLoader workers (all of them in the main process), 1 to ``MOST_READ_THREADS``. A
    read spends part of its time waiting (on storage, on setting up a scan), so one thread a core
    leaves cores idle: on 2 cores in process, Spiral read 1.5x faster with 4 threads than with 2."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    info = get_worker_info()
    return max(1, min(MOST_READ_THREADS, 2 * cores // (1 if info is None else info.num_workers)))


#: Seconds a reading thread waits for room in its queue before it looks again whether its pass
#: was stopped.
_POLL = 0.1


class _Failed(NamedTuple):
    """What a reading thread hands on when its read raised: the consumer raises it."""

    error: BaseException


#: What a reading thread hands on after the last read batch of its pass.
_END = object()

#: Seconds the interpreter's exit waits for each reading thread still alive to finish its read.
_EXIT_WAIT = 10.0

#: The reading threads of passes not yet ended, with the event that stops each.
_LIVE: dict[threading.Thread, threading.Event] = {}


class ReadAhead:
    """Reads of one opened table version on background threads, ahead of its consumer in each of
    ``threads`` work items read at once: each thread holds ``depth`` read batches, or more while
    the pass holds less than ``AHEAD_BYTES`` a thread.

    Each pass reads on threads of its own through ``source``, the consumer's own: a process opens
    a version once, and every backend's reads may run beside each other and beside its planning
    and counting. With one thread the pass reads its items in one ``source.read``; with more, each
    thread reads one *run* at a time (consecutive items of at least ``RUN_ROWS`` stored rows, fewer
    when the list holds less than that a thread, in one ``source.read``), taking the next run no
    thread has taken. Rows, order and the stored rows
    reported with each batch are those of ``source.read(items)`` either way.

        ahead = ReadAhead(source, depth=2, threads=4, opener=lambda: open_source(spec))
        for batch, index, next_row in ahead.read(items):
            ...
    """

    def __init__(
        self, source: Source, depth: int, threads: int = 1, opener: Callable[[], Source] | None = None
    ) -> None:
        if depth < 1:
            raise ValueError(f"a read-ahead depth is at least 1 read batch, not {depth}")
        check_positive("read_threads", threads)
        if threads > 1 and opener is None:
            raise ValueError("reading on several threads needs an opener for their sources")
        self.depth = depth
        self.threads = threads
        self.source = source
        self._opener = opener
        # Each reading thread reads through a source of its own: spiral-sdk's scans are not known
        # to serve two reads at once. Sources are opened as threads first need them and kept for
        # the passes after, the consumer's own among them.
        self._idle = [source]
        self._idle_lock = threading.Lock()

    def read(self, items: Sequence[WorkItem]) -> Iterator[ReadBatch]:
        """What the source's ``read(items)`` yields, read ahead; the threads start on the first
        ``next``, and once the iterator is exhausted, closed or collected they have ended: their
        reads are closed before the consumer goes on."""
        items = list(items)
        stop = threading.Event()
        # Runs of RUN_ROWS, or shorter ones where that leaves a thread without a run.
        stored = sum(item.end - item.start for item in items)
        held = _Held(self.depth, AHEAD_BYTES * self.threads)
        taken = _Taken(items, held, max(1, min(RUN_ROWS, -(-stored // self.threads))))
        if self.threads == 1 or len(taken.runs) < 2:
            batches = _Batches(held)
            fill = partial(_fill, self.source, items, batches, stop)
            return _drain(stop, [fill], lambda: iter((batches,)))
        workers = [partial(self._fill_runs, taken, stop) for _ in range(min(self.threads, len(taken.runs)))]
        return _drain(stop, workers, taken.in_order)

    def _fill_runs(self, taken: _Taken, stop: threading.Event) -> None:
        """Read the runs no thread has taken yet, one at a time, into their own queues, through a
        source no other thread reads."""
        with self._idle_lock:
            source = self._idle.pop() if self._idle else None
        try:
            while not stop.is_set() and (next_run := taken.take()) is not None:
                (first, end), batches = next_run
                try:
                    if source is None:
                        assert self._opener is not None
                        source = self._opener()
                    read = source.read(taken.items[first:end])
                    finished = all(
                        batches.put((batch, first + index, next_row), stop, batch.nbytes)
                        for batch, index, next_row in read
                    )
                except BaseException as error:  # every error belongs to the consumer
                    batches.put(_Failed(error), stop)
                    return
                if not finished or not batches.put(_END, stop):
                    return
        finally:
            if source is not None:
                with self._idle_lock:
                    self._idle.append(source)


class _Taken:
    """The items of a pass read by several threads, in runs (see ``runs``): the next run not yet
    taken, and each taken run's queue of read batches, handed to the consumer in list order."""

    def __init__(self, items: list[WorkItem], held: _Held, rows: int) -> None:
        self.items = items
        self.held = held
        self.runs = runs(items, rows)
        self.queues: dict[int, _Batches] = {}
        self.following = 0
        self.changed = threading.Condition()

    def take(self) -> tuple[tuple[int, int], _Batches] | None:
        """The next run (its first item and the item after it) and a new queue for its batches;
        ``None`` when all are taken."""
        with self.changed:
            index = self.following
            if index >= len(self.runs):
                return None
            self.following += 1
            batches = _Batches(self.held)
            self.queues[index] = batches
            self.changed.notify_all()
            return self.runs[index], batches

    def in_order(self) -> Iterator[_Batches]:
        """Each run's queue in turn, once a thread has taken the run."""
        for index in range(len(self.runs)):
            with self.changed:
                self.changed.wait_for(lambda index=index: index in self.queues)  # type: ignore[misc]
                batches = self.queues.pop(index)
            yield batches


def runs(items: Sequence[WorkItem], rows: int) -> list[tuple[int, int]]:
    """``items`` cut into runs of consecutive items, as (first, end) index pairs: each run closes
    once its items hold ``rows`` stored rows, the last holding what is left."""
    found: list[tuple[int, int]] = []
    first, held = 0, 0
    for index, item in enumerate(items):
        held += item.end - item.start
        if held >= rows:
            found.append((first, index + 1))
            first, held = index + 1, 0
    if first < len(items):
        found.append((first, len(items)))
    return found


class _Held:
    """What the queues of one pass hold together: a queue takes a read batch while it holds fewer
    than ``depth`` or the pass holds fewer than ``most_bytes`` bytes."""

    def __init__(self, depth: int, most_bytes: int) -> None:
        self.depth = depth
        self.most_bytes = most_bytes
        self.bytes = 0
        self.changed = threading.Condition()


class _Batches:
    """One reading thread's read batches (of a pass, or of one of its runs), in the order read."""

    def __init__(self, held: _Held) -> None:
        self._held = held
        self._values: deque[tuple[object, int]] = deque()

    def put(self, value: object, stop: threading.Event, size: int = 0) -> bool:
        """Put ``value`` (a read batch of ``size`` bytes, or what ends the queue) once there is
        room; ``False`` if the pass was stopped first."""
        held = self._held
        with held.changed:
            while not stop.is_set():
                if len(self._values) < held.depth or held.bytes < held.most_bytes:
                    self._values.append((value, size))
                    held.bytes += size
                    held.changed.notify_all()
                    return True
                # The stop event does not notify this condition: look again now and then.
                held.changed.wait(_POLL)
        return False

    def get(self) -> object:
        """The next value put, once there is one."""
        held = self._held
        with held.changed:
            held.changed.wait_for(lambda: self._values)
            value, size = self._values.popleft()
            held.bytes -= size
            held.changed.notify_all()
        return value


def _drain(
    stop: threading.Event, workers: Sequence[Callable[[], None]], queues: Callable[[], Iterator[_Batches]]
) -> Iterator[ReadBatch]:
    """Run ``workers`` on threads and yield what ``queues`` hold, each queue to its end."""
    threads = [threading.Thread(target=work, name="spiral-lightning-read-ahead", daemon=True) for work in workers]
    for thread in threads:
        _LIVE[thread] = stop
    try:
        for thread in threads:
            thread.start()
        for batches in queues():
            while (batch := batches.get()) is not _END:
                if isinstance(batch, _Failed):
                    raise batch.error
                yield cast(ReadBatch, batch)
    finally:
        stop.set()
        # A read left running is native code (Arrow's, spiral-sdk's) that the interpreter's
        # exit may tear down under it, which aborts the process. The garbage collector may
        # close this iterator on a reading thread itself, which then ends on its own.
        for thread in threads:
            if thread is not threading.current_thread() and thread.ident is not None:
                thread.join()
            _LIVE.pop(thread, None)


@atexit.register
def _stop_live_passes() -> None:
    """Stop the reads of passes still open when the interpreter exits (an iterator held in a
    global), for the reason ``read`` joins its thread."""
    for thread, stop in list(_LIVE.items()):
        stop.set()
        thread.join(_EXIT_WAIT)


def _fill(source: Source, items: list[WorkItem], batches: _Batches, stop: threading.Event) -> None:
    try:
        finished = _hand_on(source, items, batches, stop)
    except BaseException as error:  # every error belongs to the consumer
        batches.put(_Failed(error), stop)
        return
    if finished:
        batches.put(_END, stop)


def _hand_on(source: Source, items: list[WorkItem], batches: _Batches, stop: threading.Event) -> bool:
    """Put what ``source.read(items)`` yields into ``batches``; ``False`` if the pass was stopped
    first. The read ends with this call, so the source is free for another thread after it."""
    return all(batches.put(read, stop, read[0].nbytes) for read in source.read(items))
