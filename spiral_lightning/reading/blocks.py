"""Shared-memory blocks that a DataLoader worker reuses to hand its batches to the main process.

A batch copied into a new block pays for the block twice: the worker creates and maps it, and the
main process fetches its file descriptor from the worker's resource-sharer thread, which waits for
the worker's lock on the interpreter (up to 5 ms when the worker is busy reading). A pool keeps a
worker's blocks: the main process receives each block's descriptor once, keeps it mapped, and
afterwards a batch is a few hundred bytes naming its block and where its tensors lie.

A block is busy from the moment the worker fills it until the main process has dropped the last
tensor of that batch: the batch's tensors are views of one object whose collection marks the block
free in a small shared array (the *flags*). Tensors a user keeps therefore stay valid; a worker
whose blocks are all busy makes another, up to ``MAX_BLOCKS``, and past that sends a new block per
batch as before.
"""

from __future__ import annotations

import math
import os
import secrets
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

#: Blocks a worker keeps at most. A worker's batches in flight are the loader's prefetch (2 a
#: worker) and the few the trainer holds; more are batches a user keeps, each of which then holds a
#: block of its own.
MAX_BLOCKS = 16
#: Bytes a worker's blocks hold at most once it has ``FEW_BLOCKS``: a pool lives as long as its
#: worker, so batches of images a user once kept must not pin gigabytes for the rest of a run.
MAX_POOL_BYTES = 512 << 20
#: Blocks a pool may make whatever their size: the prefetched batches and those the trainer holds.
FEW_BLOCKS = 4
#: Where each tensor starts in a block: a multiple of every dtype's size and of a cache line.
ALIGN = 64
#: Flag values, one byte per block: set by the main process, read by the worker.
_BUSY, _FREE = 0, 1


class _Slot(NamedTuple):
    """Where one tensor of a batch lies in its block: byte offset and length, dtype and shape."""

    start: int
    length: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class _Pool:
    """One worker's blocks and flags. ``flags[k]`` says whether block ``k`` is free;
    ``flags[MAX_BLOCKS + k]`` whether the main process holds block ``k`` (its descriptor is sent
    until it does)."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(8)
        self.pid = os.getpid()
        # Shared like a batch's storage, so its descriptor travels the same way.
        self.flag_storage = torch.UntypedStorage._new_shared(2 * MAX_BLOCKS)  # type: ignore[no-untyped-call]
        self.flags = _bytes(self.flag_storage)
        self.flags[:] = _BUSY
        self.storages: list[torch.UntypedStorage | None] = []
        self.blocks: list[np.ndarray[Any, Any]] = []

    def block_for(self, size: int) -> int | None:
        """The index of a free block of at least ``size`` bytes, now busy; a new or larger block
        when none is free and the pool may grow (``FEW_BLOCKS``, then ``MAX_BLOCKS`` within
        ``MAX_POOL_BYTES``); ``None`` when it may not (the batch then goes in a block of its own)."""
        free = [index for index in range(len(self.blocks)) if self.flags[index] == _FREE]
        fitting = [index for index in free if len(self.blocks[index]) >= size]
        held = sum(len(block) for block in self.blocks)
        if fitting:
            index = min(fitting, key=lambda index: len(self.blocks[index]))
        elif len(self.blocks) < FEW_BLOCKS or (len(self.blocks) < MAX_BLOCKS and held + size <= MAX_POOL_BYTES):
            index = len(self.blocks)
            self.storages.append(None)
            self.blocks.append(np.empty(0, dtype=np.uint8))
        elif free and held - len(self.blocks[free[0]]) + size <= max(MAX_POOL_BYTES, size * FEW_BLOCKS):
            index = free[0]
        else:
            return None
        if len(self.blocks[index]) < size:
            # A quarter more than asked, so that slowly growing batches do not replace it each time.
            storage = torch.UntypedStorage._new_shared(size + size // 4)  # type: ignore[no-untyped-call]
            self.storages[index] = storage
            self.blocks[index] = _bytes(storage)
            self.flags[MAX_BLOCKS + index] = 0
        self.flags[index] = _BUSY
        return index


def _bytes(storage: torch.UntypedStorage) -> np.ndarray[Any, Any]:
    """``storage``'s bytes as a numpy array over the same memory."""
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy()


_pool: _Pool | None = None


def _this_pool() -> _Pool:
    """This process's pool, made at its first use (a forked process makes its own)."""
    global _pool
    if _pool is None or _pool.pid != os.getpid():
        _pool = _Pool()
    return _pool


def pooled(batch: dict[str, Any], tensors: Iterable[torch.Tensor]) -> Pooled | None:
    """``batch`` with ``tensors`` (its tensors, each once) copied into a free block of this
    process's pool, as a dict that pickles to a small message naming the block; ``None`` when
    the pool has no block for it."""
    group = pooled_group([batch], [tensors])
    return None if group is None else group[0]


def pooled_group(batches: list[dict[str, Any]], tensors: Sequence[Iterable[torch.Tensor]]) -> list[Pooled] | None:
    """``pooled`` for several batches at once, in one block: the block is free again once every
    batch of the group is gone from the receiving process. ``tensors[i]`` are batch ``i``'s."""
    pool = _this_pool()
    found = [tensor for each in tensors for tensor in each]
    places, size = layout(found)
    index = pool.block_for(size)
    if index is None:
        return None
    block = pool.blocks[index]
    for tensor, slot in zip(found, places, strict=True):
        _put(block, slot.start, tensor)
    slots = {id(tensor): (tensor, slot) for tensor, slot in zip(found, places, strict=True)}
    lease = _Lease(pool, index, size, slots)
    sent = [Pooled(batch) for batch in batches]
    for part, each in enumerate(sent):
        each.lease, each.part, each.parts = lease, part, len(sent)
    return sent


def pooled_joined(pieces: Sequence[dict[str, Any]]) -> Pooled | None:
    """One batch of the rows of ``pieces`` laid end to end (see ``joined_into``), each tensor column
    copied from the pieces straight into a free block of this process's pool: one copy, where
    joining them first would add another. ``None`` when the pool has no block for it."""
    pool = _this_pool()
    slots, size = joined_layout(pieces)
    index = pool.block_for(size)
    if index is None:
        return None
    batch = Pooled(joined_into(pieces, slots, pool.blocks[index]))
    batch.lease = _Lease(pool, index, size, {id(batch[name]): (batch[name], slot) for name, slot in slots.items()})
    return batch


def joined_layout(pieces: Sequence[dict[str, Any]]) -> tuple[dict[str, _Slot], int]:
    """Where each tensor column of ``pieces`` (batches of the same columns, each tensor column of
    one dtype and row shape) lies in one block once their rows are laid end to end, and the
    block's size in bytes."""
    first = pieces[0]
    names = [name for name, value in first.items() if isinstance(value, torch.Tensor)]
    rows = [sum(int(piece[name].shape[0]) for piece in pieces) for name in names]
    shapes = [(first[name].dtype, (count, *first[name].shape[1:])) for name, count in zip(names, rows, strict=True)]
    places, size = _places(shapes)
    return dict(zip(names, places, strict=True)), size


def joined_into(
    pieces: Sequence[dict[str, Any]], slots: dict[str, _Slot], block: np.ndarray[Any, Any]
) -> dict[str, Any]:
    """The batch of the rows of ``pieces`` laid end to end: each tensor column of ``slots``
    (``joined_layout``) copied piece after piece into ``block`` and viewed there, each other column
    (a list of row values) joined into one list."""
    whole = torch.from_numpy(block)
    batch: dict[str, Any] = {}
    for name in pieces[0]:
        slot = slots.get(name)
        if slot is None:
            batch[name] = [value for piece in pieces for value in piece[name]]
            continue
        start = slot.start
        for piece in pieces:
            start += _put(block, start, piece[name])
        batch[name] = view(whole, slot)
    return batch


def _put(block: np.ndarray[Any, Any], start: int, tensor: torch.Tensor) -> int:
    """Copy ``tensor``'s values in C order into ``block`` from byte ``start``; their bytes."""
    length = tensor.numel() * tensor.element_size()
    # numpy copies with a few hundred nanoseconds of overhead, a torch view and copy_ with ten times that.
    if tensor.dtype in _NUMPY_DTYPES:
        block[start : start + length] = tensor.numpy().reshape(-1).view(np.uint8)
    else:
        torch.from_numpy(block[start : start + length]).view(tensor.dtype).view(tensor.shape).copy_(tensor)
    return length


def layout(tensors: Sequence[torch.Tensor]) -> tuple[list[_Slot], int]:
    """Where each of ``tensors`` lies in one block (each start a multiple of ``ALIGN``), and the
    block's size in bytes."""
    return _places([(tensor.dtype, tuple(tensor.shape)) for tensor in tensors])


def _places(shapes: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> tuple[list[_Slot], int]:
    """``layout`` of tensors of these dtypes and shapes."""
    places = []
    size = 0
    for dtype, shape in shapes:
        length = math.prod(shape) * dtype.itemsize
        places.append(_Slot(size, length, dtype, shape))
        size += -(-length // ALIGN) * ALIGN
    return places, size


def view(block: torch.Tensor, slot: _Slot) -> torch.Tensor:
    """The tensor ``slot`` describes, as a view of ``block``'s bytes."""
    return block[slot.start : slot.start + slot.length].view(slot.dtype).view(slot.shape)


#: The dtypes numpy holds, whose tensors are copied into a block through numpy.
_NUMPY_DTYPES = frozenset(
    {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}
    | {torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128}
)


class _Lease:
    """A filled block's tie to the batch that holds it (and the batch's shallow copies) in the
    worker: the batch's tensors by identity, held so that no other tensor takes one's ``id``. A
    batch collected without being sent (a DataLoader that collates batches again, a loader closed
    with batches queued) frees its block."""

    def __init__(self, pool: _Pool, index: int, size: int, slots: dict[int, tuple[torch.Tensor, _Slot]]) -> None:
        self.pool, self.index, self.size, self.slots = pool, index, size, slots
        self.sent = [False]
        weakref.finalize(self, _unsent, pool.flags, index, self.sent)


def _unsent(flags: np.ndarray[Any, Any], index: int, sent: list[bool]) -> None:
    if not sent[0]:
        flags[index] = _FREE


class Pooled(dict[str, Any]):
    """A batch whose tensors lie in a block of its worker's pool. It is a ``dict`` like any
    batch; pickled, it becomes the block's index and its tensors' places, and the receiving
    process rebuilds the same ``dict`` over its mapping of the block."""

    lease: _Lease
    #: This batch's place in a group sent in one block (``pooled_group``): part ``part`` of ``parts``.
    part: int = 0
    parts: int = 1

    def __reduce__(self) -> tuple[Any, ...]:
        lease = self.lease
        pool = lease.pool
        lease.sent[0] = True
        items = {name: _encoded(value, lease.slots) for name, value in self.items()}
        known = bool(pool.flags[MAX_BLOCKS + lease.index])
        storage = None if known else pool.storages[lease.index]
        flags = None if known else pool.flag_storage
        where = (pool.token, pool.pid, lease.index, storage, flags, lease.size)
        return (_received, (*where, items, self.part, self.parts))

    def __copy__(self) -> Pooled:
        # The DataLoader's default_convert copies every batch it hands on (copy.copy, then update).
        copied = Pooled(self)
        copied.lease, copied.part, copied.parts = self.lease, self.part, self.parts
        return copied

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        import copy

        return copy.deepcopy(dict(self), memo)


class _InBlock(NamedTuple):
    """A tensor that lies in the batch's block, by its slot."""

    slot: _Slot


def _encoded(value: Any, slots: dict[int, tuple[torch.Tensor, _Slot]]) -> Any:
    view, slot = slots.get(id(value), (None, None))
    if view is value and slot is not None:
        return _InBlock(slot)
    if isinstance(value, list):
        return [_encoded(item, slots) for item in value]
    return value


class _Mapped:
    """The main process's side of one worker's pool: its flags and the blocks it has mapped."""

    def __init__(self, pid: int, flags: np.ndarray[Any, Any]) -> None:
        self.pid, self.flags = pid, flags
        self.blocks: dict[int, np.ndarray[Any, Any]] = {}


_mapped: dict[str, _Mapped] = {}
# Reentrant: a loader's iterator the garbage collector finalizes while this thread holds the lock
# (any allocation in `_received` may run a collection) shuts its workers down through `forget`.
_mapped_lock = threading.RLock()
#: The array of a group's block while its batches are unpickled, by pool token and block.
_group_leases: dict[tuple[str, int], np.ndarray[Any, Any]] = {}


def _received(
    token: str,
    pid: int,
    index: int,
    storage: torch.UntypedStorage | None,
    flags: torch.UntypedStorage | None,
    size: int,
    items: dict[str, Any],
    part: int = 0,
    parts: int = 1,
) -> dict[str, Any]:
    """The batch a ``Pooled`` was, rebuilt in the receiving process as views of one array whose
    collection gives the block back; the batches of one group (``part`` of ``parts``, unpickled
    in order from one message) share that array."""
    if parts > 1 and part > 0:
        lease = _group_leases[(token, index)]
        if part == parts - 1:
            del _group_leases[(token, index)]
        whole = torch.from_numpy(lease)
        return {name: _decoded(value, whole) for name, value in items.items()}
    with _mapped_lock:
        mapped = _mapped.get(token)
        if mapped is None and flags is not None:
            _forget_dead()
            mapped = _mapped[token] = _Mapped(pid, _bytes(flags))
        if mapped is None or (storage is None and index not in mapped.blocks):
            raise RuntimeError(
                f"a batch of DataLoader worker pid {pid} names shared-memory block {index} of a pool this process "
                "never received: the batch that carried it was lost. Start the loader again"
            )
        if storage is not None:
            mapped.blocks[index] = _bytes(storage)
            mapped.flags[MAX_BLOCKS + index] = 1
        lease = mapped.blocks[index][:size]
    weakref.finalize(lease, _give_back, mapped.flags, index)
    if parts > 1:
        _group_leases[(token, index)] = lease
    whole = torch.from_numpy(lease)
    return {name: _decoded(value, whole) for name, value in items.items()}


def _decoded(value: Any, block: torch.Tensor) -> Any:
    if isinstance(value, _InBlock):
        return view(block, value.slot)
    if isinstance(value, list):
        return [_decoded(item, block) for item in value]
    return value


def _give_back(flags: np.ndarray[Any, Any], index: int) -> None:
    flags[index] = _FREE


def forget(pids: Iterable[int]) -> None:
    """Unmap the blocks of the workers ``pids`` (a loader shutting its workers down); the batches
    a user still holds keep theirs."""
    gone = set(pids)
    with _mapped_lock:
        for token in [token for token, mapped in _mapped.items() if mapped.pid in gone]:
            _mapped.pop(token, None)
        _forget_dead()


def _forget_dead() -> None:
    """Unmap the blocks of workers that exited (killed, or their loader not ours to watch)."""
    for token, mapped in list(_mapped.items()):
        try:
            os.kill(mapped.pid, 0)
        except ProcessLookupError:
            _mapped.pop(token, None)  # a finalizer run meanwhile may have forgotten it first
        except PermissionError:
            pass
