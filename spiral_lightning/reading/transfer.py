"""Handing a collated batch from a DataLoader worker to the main process in one block.

A worker sends each tensor storage of a batch through its own shared-memory block and file
descriptor; for batches of several small tensors that costs far more than the bytes themselves
(about 2 ms per batch of three 1024-row tensors here). A batch goes in one block of the worker's
pool (``blocks``), or in one new block when every pooled block is held; ``send_by_name`` makes a
worker name its new blocks rather than pass their descriptors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.multiprocessing
from torch.utils.data import get_worker_info

from spiral_lightning.reading.blocks import (
    joined_into,
    joined_layout,
    layout,
    pooled,
    pooled_group,
    pooled_joined,
    view,
)

#: torch's sharing strategy that names a shared-memory block instead of passing its descriptor.
_BY_NAME = "file_system"


def send_by_name(worker_id: int | None = None) -> None:
    """Make this process send its tensors by shared-memory name (torch's ``file_system``
    strategy) from now on; pass it as a DataLoader's ``worker_init_fn`` (``worker_id`` is not
    used) to make its workers do so.

    Under the default ``file_descriptor`` strategy every storage a worker sends makes the
    receiving process open a connection to the worker's resource-sharer thread to fetch its
    descriptor: about 0.8 ms per batch here, half of what the main process spends on a batch.
    By name it maps the block directly. The cost: each process that sends by name starts a
    ``torch_shm_manager`` (which frees the blocks of a process that dies before freeing them),
    and it lives as long as the receiving process, so use it with persistent workers, whose
    managers are started once, not once per epoch. Nothing turns it on by itself: a worker waits
    at most a second for its manager's answer to each block it names, and on a machine loaded past
    its cores that fails the epoch ("Shared memory manager connection has timed out", pytorch
    issue 129656; seen twice in this project's test runs at 3 processes per core).
    """
    # torch leaves both unannotated.
    if torch.multiprocessing.get_sharing_strategy() != _BY_NAME:  # type: ignore[no-untyped-call]
        torch.multiprocessing.set_sharing_strategy(_BY_NAME)  # type: ignore[no-untyped-call]


def handed_on(batch: Any) -> Any:
    """``batch`` as this process hands it on: from a DataLoader worker, in a block of the
    worker's pool (``blocks.pooled``) or, with every pooled block busy, in one new block; else as
    it is (a batch read in the main process never leaves it, and one that is no ``dict`` is
    handed on as the DataLoader would)."""
    if get_worker_info() is None or not isinstance(batch, dict):
        return batch
    found = _tensors(batch)
    return (pooled(batch, found.values()) if found else None) or one_block(batch)


def handed_on_group(batches: list[Any]) -> list[Any]:
    """``batches`` as a DataLoader worker hands them on together: in one block of its pool
    (``blocks.pooled_group``) when they are ``dict`` batches that fit one, else each as
    ``handed_on`` hands it on."""
    if get_worker_info() is not None and batches and all(isinstance(batch, dict) for batch in batches):
        found = [_tensors(batch).values() for batch in batches]
        group = pooled_group(batches, found) if any(found) else None
        if group is not None:
            return list(group)
    return [handed_on(batch) for batch in batches]


def handed_on_pieces(pieces: list[dict[str, Any]]) -> Any:
    """One batch of the rows of ``pieces`` laid end to end (batches of the same columns, see
    ``convert.group_pieces``), as a DataLoader worker hands it on: its tensors copied from the
    pieces straight into a block of the worker's pool (``blocks.pooled_joined``), else joined
    and handed on as ``handed_on`` hands a batch on."""
    batch = pooled_joined(pieces) if get_worker_info() is not None else None
    if batch is not None:
        return batch
    slots, size = joined_layout(pieces)
    return handed_on(joined_into(pieces, slots, np.empty(size, dtype=np.uint8)))


def tensor_bytes(batch: Any) -> int:
    """About the bytes a block would hold of ``batch``: those of the tensors of a ``dict`` batch,
    a tensor that appears twice counted twice; 0 for a batch that is no ``dict``."""
    if not isinstance(batch, dict):
        return 0
    return sum(item.nbytes for value in batch.values() for item in _items(value) if isinstance(item, torch.Tensor))


def one_block(batch: Any) -> Any:
    """``batch`` with its tensors copied into one new block of shared memory, as views of it.

    The tensors are a ``dict`` batch's values and the tensors inside its list values (per-row
    tensors of ragged columns). Each keeps its dtype, shape and values, made contiguous; a batch
    that is no ``dict``, or holds fewer than two tensors, is returned as it is. The block is
    allocated in shared memory, so the DataLoader sends it without another copy.
    """
    if not isinstance(batch, dict):
        return batch
    found = _tensors(batch)
    if len(found) < 2:
        return batch
    places, size = layout(list(found.values()))
    # torch's default_collate allocates its stacked batches in workers the same way.
    storage = torch.UntypedStorage._new_shared(size)  # type: ignore[no-untyped-call]
    block = torch.empty(0, dtype=torch.uint8).set_(storage)
    moved = {key: view(block, slot).copy_(tensor) for (key, tensor), slot in zip(found.items(), places, strict=True)}
    return {name: _replaced(value, moved) for name, value in batch.items()}


def _tensors(batch: dict[str, Any]) -> dict[int, torch.Tensor]:
    """The tensors a block can hold in ``batch``, by identity: one that appears twice is copied
    once and stays one tensor."""
    return {id(item): item for value in batch.values() for item in _items(value) if _movable(item)}


def _items(value: Any) -> list[Any]:
    """The values of a batch entry that may be tensors: itself, or a list's items."""
    return value if isinstance(value, list) else [value]


def _movable(value: Any) -> bool:
    """Whether ``value`` is a tensor the block can hold: on the CPU, outside autograd."""
    return isinstance(value, torch.Tensor) and value.device.type == "cpu" and not value.requires_grad


def _replaced(value: Any, moved: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return moved.get(id(value), value)
    if isinstance(value, list):
        return [moved.get(id(item), item) if isinstance(item, torch.Tensor) else item for item in value]
    return value
