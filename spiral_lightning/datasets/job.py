"""What the ranks of one job do together, the same under Lightning and Ray Train: read the version
rank 0 pins, give every consumer the same quota each epoch so ranks take equal steps, and tell a
saved position that needs a re-plan from one that restores as it is."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch.distributed

from spiral_lightning.core.spec import TableSpec

#: Sends rank 0's value to every rank and returns it (``trainer.strategy.broadcast``, or
#: ``torch_broadcast``); each other rank passes ``None``.
Broadcast = Callable[[TableSpec | None], TableSpec | None]


def torch_broadcast(value: TableSpec | None) -> TableSpec | None:
    """Rank 0's ``value`` on every rank of the initialized ``torch.distributed`` group."""
    shared = [value]
    torch.distributed.broadcast_object_list(shared, src=0)
    return shared[0]


def distributed() -> bool:
    """Whether this process is a rank of an initialized ``torch.distributed`` group."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def grouped(rank: int, world_size: int) -> bool:
    """Whether the default ``torch.distributed`` group is the ranks of a dataset on ``rank`` of
    ``world_size``, so that they can share counts."""
    return distributed() and (torch.distributed.get_rank(), torch.distributed.get_world_size()) == (rank, world_size)


def pinned(spec: TableSpec, rank: int, broadcast: Broadcast | None) -> TableSpec:
    """``spec`` pinned to the version rank 0 resolves now, so that no rank reads a newer one
    (resolved here when there is no ``broadcast``: a single process). Only the pin travels, not
    the storage options: a Parquet version lives in its files as well as its uri."""
    if broadcast is None:
        return spec.resolve()
    shared = broadcast(spec.resolve() if rank == 0 else None)
    if shared is None:
        raise RuntimeError("rank 0 sent no table version")
    return dataclasses.replace(spec, uri=shared.uri, files=shared.files)


class Layout(NamedTuple):
    """How a job reads: its ranks, each rank's DataLoader workers (0 in process) and the rows of
    a batch. A position saved under one layout continues under another through a re-plan."""

    world_size: int
    workers: int
    batch_size: int | None


class EvenDataset(Protocol):
    """A dataset whose epochs even batches can size (``TableDataset``, ``PackedDataset``)."""

    world_size: int

    @property
    def epoch(self) -> int: ...

    def count_shared(self, workers: int) -> None: ...

    def even_rows(self, workers: int) -> tuple[int, int]: ...

    def set_rows_per_consumer(self, rows: int | None) -> None: ...


class EvenEpoch(NamedTuple):
    """One epoch under even batches: every consumer's ``quota``, the rows it leaves out, and the
    line rank 0 logs about it, with whether it is worth a warning."""

    quota: int
    left_out: int
    note: str
    warn: bool


def even_epoch(dataset: EvenDataset, workers: int, batch_size: int | None, limit: int | None = None) -> EvenEpoch:
    """Give every consumer of ``dataset``'s epoch the fewest rows any consumer of any rank gets
    (at most ``limit``), so that the ranks take equal steps. Every rank calls it at the same point
    of each epoch: the counts are shared between them (``count_shared``)."""
    dataset.count_shared(workers)
    quota, left_out = dataset.even_rows(workers)
    if limit is not None:
        quota = min(quota, limit)
    dataset.set_rows_per_consumer(quota)
    note, warn = even_note(dataset.epoch, dataset.world_size * max(1, workers), quota, left_out, batch_size)
    return EvenEpoch(quota, left_out, note, warn)


def even_note(epoch: int, consumers: int, quota: int, left_out: int, batch_size: int | None) -> tuple[str, bool]:
    """What even batches do to an epoch, in one line to log on rank 0, and whether it is worth a
    warning: more rows left out than one batch per consumer (a policy that shares rows unevenly,
    such as ``stripe`` on splits of unequal size, or a filter that keeps unevenly)."""
    note = (
        f"even batches in epoch {epoch}: each of the {consumers} consumers reads {quota} rows, "
        f"leaving out {left_out} rows of this epoch"
    )
    if left_out <= consumers * (batch_size or 1):
        return note, False
    return (
        f"{note}, more than a batch per consumer; the policy 'balanced' shares stored rows equally, "
        "and even_batches=False reads every row in batch counts that may differ between ranks",
        True,
    )


def needs_replan(saved: Layout, now: Layout, *, inside_replan: bool) -> bool:
    """Whether positions saved under ``saved`` restore only through an elastic re-plan: another
    world size, worker count or batch size now, or saved inside an epoch re-planned before (whose
    consumers' lists exist only as a share of its remainder)."""
    return tuple(saved) != tuple(now) or inside_replan


class CountedDataset(Protocol):
    """A dataset that counts its epoch's batches ahead without even rows (``Mixture``,
    ``WindowDataset``): its ranks are kept in step by reading the same number of batches."""

    @property
    def epoch(self) -> int: ...

    def batches(self, workers: int) -> int: ...


def fewest_batches(dataset: CountedDataset, workers: int, even: bool) -> tuple[int, str | None]:
    """This rank's batches in ``dataset``'s epoch and, under ``even`` batches with more than one
    rank, the note rank 0 logs: every rank reads the fewest batches any rank has (a collective,
    called by every rank at the same point of each epoch), the rest of each rank left out."""
    batches = dataset.batches(workers)
    if not even or not distributed():
        return batches, None
    counts: list[int | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(counts, batches)
    found = [int(count or 0) for count in counts]
    fewest = min(found)
    note = (
        f"even batches in epoch {dataset.epoch}: each of the {len(found)} ranks reads {fewest} batches "
        f"(ranks have {found}), leaving out {sum(found) - fewest * len(found)} batches of this epoch"
    )
    return fewest, note
