"""Queues between a loader and its DataLoader workers that write in the writer's own thread.

A ``multiprocessing.Queue`` hands each message to a feeder thread that pickles and writes it. For
a batch that is a few hundred bytes (``reading.blocks``), that thread costs more than the message:
the writer wakes it, and both then wait for the interpreter's lock (a worker spent about 40% of its
time in ``Queue.put`` on 256-row batches). A ``PipeQueue`` pickles and writes in ``put`` itself.
It never holds more than its pipe: a loader's queues carry at most the loader's prefetched batches
and indexes, and their readers (the loader, or its relay or pin-memory thread) read every message
that arrives, whichever worker sent it, so a writer waits only for a reader that is reading.
"""

from __future__ import annotations

import queue
from multiprocessing import context, queues
from multiprocessing.reduction import ForkingPickler
from typing import Any

#: Seconds a put into a closing queue waits for the write lock before it drops its message.
CLOSING_WAIT = 1.0


class PipeQueue(queues.SimpleQueue):  # type: ignore[type-arg]  # not generic at runtime before 3.12
    """A ``SimpleQueue`` with the ``Queue`` methods a DataLoader calls: ``get`` and ``put`` with a
    timeout (``queue.Empty`` / ``queue.Full`` past it), and the feeder thread's ``cancel_join_thread``
    and ``join_thread``, which have nothing to do.

    Its writers share one lock, and a worker killed while writing holds it forever. A loader that
    shuts down sets ``closing``: its own puts then wait at most ``CLOSING_WAIT`` and are dropped
    past it, harmlessly, since they only wake threads that also poll."""

    closing = False

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        wait = timeout if block else 0.0
        if not self._rlock.acquire(block, timeout):  # type: ignore[attr-defined]  # SimpleQueue's own
            raise queue.Empty
        try:
            if not self._poll(wait):  # type: ignore[attr-defined]
                raise queue.Empty
            data = self._reader.recv_bytes()  # type: ignore[attr-defined]
        finally:
            self._rlock.release()  # type: ignore[attr-defined]
        return ForkingPickler.loads(data)

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        data = ForkingPickler.dumps(obj)
        lock = self._wlock  # type: ignore[attr-defined]  # SimpleQueue's own
        if not lock.acquire(block, CLOSING_WAIT if self.closing else timeout):
            if self.closing:
                return
            raise queue.Full
        try:
            self._writer.send_bytes(data)  # type: ignore[attr-defined]
        except OSError:
            # A closing loader's pipe may be closed already (at the interpreter's exit) or its
            # reader gone (a dead worker): the message would only have woken it.
            if not self.closing:
                raise
        finally:
            lock.release()

    def cancel_join_thread(self) -> None:
        """Nothing: no feeder thread to leave behind."""

    def join_thread(self) -> None:
        """Nothing: no feeder thread to wait for."""


class Flag:
    """The loader's "workers done" event, without a lock: one byte of shared memory that the loader
    sets and its workers read. A ``multiprocessing.Event`` reads and sets its flag under a lock, and
    a worker killed while it read the flag holds that lock forever: the loader then waited forever
    as it marked the dead worker unavailable or shut the others down (seen once in the suite, a
    worker killed by a test). One writer needs no lock."""

    def __init__(self, ctx: context.BaseContext) -> None:
        self._value = ctx.RawValue("b", 0)

    def is_set(self) -> bool:
        return bool(self._value.value)

    def set(self) -> None:
        self._value.value = 1


class _PipeForkServer(context.ForkServerContext):
    """The ``forkserver`` context, whose queues are ``PipeQueue``s and whose events are ``Flag``s."""

    def Queue(self, maxsize: int = 0) -> PipeQueue:  # type: ignore[override]
        return PipeQueue(ctx=self)

    def Event(self) -> Flag:  # type: ignore[override]
        return Flag(self)


class _PipeSpawn(context.SpawnContext):
    """The ``spawn`` context, whose queues are ``PipeQueue``s and whose events are ``Flag``s."""

    def Queue(self, maxsize: int = 0) -> PipeQueue:  # type: ignore[override]
        return PipeQueue(ctx=self)

    def Event(self) -> Flag:  # type: ignore[override]
        return Flag(self)


#: The contexts a loader's workers start in, by start method, with queues that need no thread.
PIPE_CONTEXTS: dict[str, context.BaseContext] = {"forkserver": _PipeForkServer(), "spawn": _PipeSpawn()}


def piped(start: Any) -> Any:
    """The ``PIPE_CONTEXTS`` entry for ``start`` (a start method's name, or its context), or
    ``start`` as it is: a fork context, or one of the user's own."""
    if isinstance(start, str):
        return PIPE_CONTEXTS.get(start, start)
    if type(start) in (context.ForkServerContext, context.SpawnContext):
        return PIPE_CONTEXTS[start.get_start_method()]
    return start
