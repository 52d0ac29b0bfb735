"""Reading ahead: a source's reads on a thread of their own, a few read batches before the consumer.

Read in line, a pass alternates: the consumer waits while the source decodes a read batch, then
the source idles while the consumer frames it and trains on the frames. A reading thread keeps
the source decoding while the consumer works (backends release the GIL while they read), so a
pass takes about the longer of the two instead of their sum.
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import NamedTuple, cast

from spiral_lightning.core.plan import WorkItem
from spiral_lightning.sources import ReadBatch, Source

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
    """Reads of one opened table version on background threads, each up to ``depth`` read batches
    ahead of its consumer.

    Each pass reads on a thread of its own through ``source``, the consumer's own: a process opens
    a version once, and every backend's reads may run beside its planning and counting on another
    thread. Rows, order and the stored rows reported with each batch are those of ``source.read``.
    """

    def __init__(self, source: Source, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"a read-ahead depth is at least 1 read batch, not {depth}")
        self.depth = depth
        self.source = source

    def read(self, items: Sequence[WorkItem]) -> Iterator[ReadBatch]:
        """What the source's ``read(items)`` yields, read ahead; the thread starts on the first
        ``next``, and once the iterator is exhausted, closed or collected it has ended: its read
        is closed before the consumer goes on."""
        batches: queue.Queue[object] = queue.Queue(self.depth)
        stop = threading.Event()
        args = (self.source, list(items), batches, stop)
        thread = threading.Thread(target=_fill, args=args, name="spiral-lightning-read-ahead", daemon=True)
        _LIVE[thread] = stop
        thread.start()
        try:
            while True:
                batch = batches.get()
                if batch is _END:
                    return
                if isinstance(batch, _Failed):
                    raise batch.error
                yield cast(ReadBatch, batch)
        finally:
            stop.set()
            # A read left running is native code (Arrow's, spiral-sdk's) that the interpreter's
            # exit may tear down under it, which aborts the process. The garbage collector may
            # close this iterator on the reading thread itself, which then ends on its own.
            if thread is not threading.current_thread():
                thread.join()
            _LIVE.pop(thread, None)


@atexit.register
def _stop_live_passes() -> None:
    """Stop the reads of passes still open when the interpreter exits (an iterator held in a
    global), for the reason ``read`` joins its thread."""
    for thread, stop in list(_LIVE.items()):
        stop.set()
        thread.join(_EXIT_WAIT)


def _fill(source: Source, items: list[WorkItem], batches: queue.Queue[object], stop: threading.Event) -> None:
    try:
        finished = _hand_on(source, items, batches, stop)
    except BaseException as error:  # every error belongs to the consumer
        _put(batches, _Failed(error), stop)
        return
    if finished:
        _put(batches, _END, stop)


def _hand_on(source: Source, items: list[WorkItem], batches: queue.Queue[object], stop: threading.Event) -> bool:
    """Put what ``source.read(items)`` yields into ``batches``; ``False`` if the pass was stopped
    first. The read ends with this call, so the source is free for another thread after it."""
    return all(_put(batches, batch, stop) for batch in source.read(items))


def _put(batches: queue.Queue[object], value: object, stop: threading.Event) -> bool:
    """Put ``value`` once there is room; ``False`` if the pass was stopped first."""
    while not stop.is_set():
        try:
            batches.put(value, timeout=_POLL)
        except queue.Full:
            continue
        return True
    return False
