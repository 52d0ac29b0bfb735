"""TableMapDataset: random access by row number over an exact table version, for samplers."""

from __future__ import annotations

import copy
import operator
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.distributed
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from spiral_lightning.core.media import Where, left_to_decode
from spiral_lightning.core.plan import Shard
from spiral_lightning.core.sequences import TooLong
from spiral_lightning.core.spec import TableSpec, as_spec, with_selection
from spiral_lightning.datasets.consumer import check_read_threads
from spiral_lightning.datasets.loader import Loader, loader_options, without_set_vital_warning, workers_for
from spiral_lightning.planning.policies import stripe
from spiral_lightning.reading.ahead import default_read_threads
from spiral_lightning.reading.tensors import NullError, Nulls, check_nulls, to_torch
from spiral_lightning.sources import Source, Take, open_source

#: One row as ``TableMapDataset`` returns it: each column's value by column name.
Row = dict[str, Any]


class TableMapDataset(Dataset[Any]):
    """The rows of one table version after the filter, numbered ``0 .. len - 1`` in stored order.

        rows = TableMapDataset("parquet:data/events", columns=["x", "label"])
        rows[12], rows.__getitems__([3, 7, 9])  # a row as a dict of tensors; several at once
        loader = rows.loader(batch_size=64, num_workers=2, shuffle=True)  # {"x": [64, 16], ...}

    A row number (an index) counts the rows the scan returns, split after split, so index ``i``
    is the ``i``-th row a full scan of the same spec reads. ``dataset[i]`` is a row: a dict with
    one value per column, a tensor (``[]`` for a scalar column, ``[4]`` for a ``float32[4]``
    column) or a Python value for strings, binary and ragged lists (``None`` for a null), as
    ``to_torch`` makes them with the spec's ``null_fill`` and ``null_mask`` (a ``[]`` bool
    ``<column>_valid``), so torch's default collate stacks every numeric column; an unhandled null
    raises naming its index. Tensors are copies that belong to the row, so ``transform(row)`` may modify them in
    place. The spec's media projections decode their columns as in ``TableDataset``, one image
    or clip per row (``[3, H, W]`` for ``Image(layout="CHW")``); a value that does not decode
    raises ``DecodeError`` naming its index. ``on_error="skip"`` is refused: every index must
    give its row.

    ``__getitems__(indices)`` (which ``DataLoader`` calls with a whole batch of indices) and
    ``_getitems`` (which Grain calls) return the rows of ``indices`` as a list, in request order,
    repeats included, the same rows ``[dataset[i] for i in indices]`` gives. They make one
    positional read for all the indices, which reads each split they fall in once. Returning rows
    rather than a collated batch keeps the contract of every sampler and collate function:
    ``DataLoader(batch_size=B)`` with the default collate stacks them into ``[B, ...]`` tensors.

    ``read_threads`` is how many threads read one call's splits at once, each through its own
    source, the splits cut into consecutive groups of about equal rows. By default each process
    that reads (the main one, or each DataLoader worker) gets twice its share of the cores, 1 to
    ``MOST_READ_THREADS`` (see ``default_read_threads``).

    ``columns`` and ``filter`` select what is read, as the ``TableSpec`` settings of those names do.

    The spec is pinned to one version when the dataset is built, and the rows each split returns
    are counted once, reading only the filter's columns. Only the spec, the transform and those
    counts are pickled; the source opens in the process that reads, again after a fork or spawn,
    so one instance serves DataLoader workers (``multiprocessing_context="forkserver"`` or
    ``"spawn"`` once the parent has read a table) and DDP ranks alike.
    """

    def __init__(
        self,
        spec: TableSpec | str,
        *,
        transform: Callable[[Row], Any] | None = None,
        read_threads: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        columns: Sequence[str] | None = None,
        filter: Any = None,
    ) -> None:
        check_read_threads(read_threads)
        self.spec = with_selection(as_spec(spec, storage_options), columns, filter).resolve()
        #: The exact version ``spec`` names.
        self.version = self.spec.version
        if self.spec.media and self.spec.on_error != "raise":
            raise ValueError(
                f"on_error={self.spec.on_error!r} drops rows that do not decode, but a TableMapDataset must "
                f"return a row for every index of {self.spec.uri!r}; use on_error='raise' and remove the bad "
                "rows, or read the table with TableDataset, which can skip them"
            )
        self.transform = transform
        self.read_threads = read_threads
        self._ends: np.ndarray | None = None
        self._opened = threading.local()
        self._pool: tuple[int, int, ThreadPoolExecutor] | None = None
        # Opened here, in the process that builds the dataset, so an unknown column, media column
        # or filter fails now rather than later inside a DataLoader worker.
        self.source()
        check_nulls(
            Nulls(self.spec.null_fill, self.spec.null_mask), self.source().schema, self.spec.uri, self.spec.padded
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_opened"]
        state["_pool"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._opened = threading.local()

    def loader(
        self, batch_size: int, num_workers: int | None = None, *, shuffle: bool = False, seed: int = 0, **options: Any
    ) -> StatefulDataLoader:
        """A ``StatefulDataLoader`` of ``batch_size`` rows per batch (stacked by torch's default
        collate), this rank's share of the indices drawn by torchdata's
        ``StatefulDistributedSampler`` (rank and world size from ``torch.distributed`` when it is
        initialized; a new order each epoch with ``shuffle``, set by ``loader.sampler.set_epoch``),
        read by ``num_workers`` workers started by ``forkserver`` (by default ``loader.workers_for``'s),
        persistent. ``options`` go to the loader and override these."""
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        sampler = StatefulDistributedSampler(
            self,
            num_replicas=torch.distributed.get_world_size() if distributed else 1,
            rank=torch.distributed.get_rank() if distributed else 0,
            shuffle=shuffle,
            seed=seed,
        )
        settings = loader_options(workers_for(self, num_workers), options, self)
        with without_set_vital_warning():
            loader: StatefulDataLoader = Loader(self, batch_size=batch_size, sampler=sampler, **settings)
        return loader

    def source(self) -> Source:
        """The table version opened in this thread of this process (opened on first use).

        Grain calls ``__getitem__`` from a pool of threads, and an open Parquet file (like other
        readers) must not serve two threads at once, so each thread reads through its own source;
        the process id is checked too because a forked child inherits the forking thread's source.
        """
        opened: tuple[int, Source] | None = getattr(self._opened, "source", None)
        pid = os.getpid()
        if opened is None or opened[0] != pid:
            opened = (pid, open_source(self.spec))
            self._opened.source = opened
        return opened[1]

    def _split_ends(self) -> np.ndarray:
        """The index after the last row of each split: the running total of exact split counts."""
        if self._ends is None:
            source = self.source()
            # One consumer's stripe is every split whole, in stored order.
            counts = source.count(stripe(source.splits, Shard()))
            self._ends = np.cumsum(np.asarray(counts, dtype=np.int64))
        return self._ends

    def ranges(self, indices: Sequence[int]) -> np.ndarray:
        """The stored rows of ``indices`` (row numbers of the table) as ``[split, start, end]``
        ranges in index order, consecutive rows of a split in one range; under a filter, the
        stored rows it kept that the numbers name (found once per split, reading the filter's
        columns)."""
        wanted = np.asarray(indices, dtype=np.int64)
        if not wanted.size:
            return np.zeros((0, 3), dtype=np.int64)
        split, row = self._located(wanted)
        if self.spec.filter is not None:
            row = row.copy()
            for number in np.unique(split).tolist():
                mine = split == number
                row[mine] = self.source().kept(number)[row[mine]]
        breaks = np.flatnonzero((np.diff(split) != 0) | (np.diff(row) != 1)) + 1
        starts = np.concatenate(([0], breaks)).astype(np.int64)
        lengths = np.diff(np.concatenate((starts, [wanted.size])))
        return np.stack([split[starts], row[starts], row[starts] + lengths], axis=1)

    def _located(self, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The split that holds each of the row numbers ``wanted``, and its row there."""
        ends = self._split_ends()
        # The vectorized bisect: the first split whose end lies past the index holds it.
        split = np.searchsorted(ends, wanted, side="right")
        return split, wanted - np.concatenate(([0], ends))[split]

    def __len__(self) -> int:
        ends = self._split_ends()
        return int(ends[-1]) if ends.size else 0

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        rows = self._rows(indices)
        if self.transform is None:
            return rows
        return [self.transform(row) for row in rows]

    _getitems = __getitems__

    def _rows(self, indices: Sequence[int]) -> list[Row]:
        """The rows of ``indices`` in request order, each split read once."""
        wanted = self._checked(indices)
        if not wanted.size:
            return []
        source = self.source()
        held_by, positions = self._located(wanted)
        order = np.argsort(held_by, kind="stable")
        first_of_run = np.flatnonzero(np.diff(held_by[order], prepend=-1))
        takes = [
            Take(source.splits[int(held_by[run[0]])].id, positions[run].tolist())
            for run in np.split(order, first_of_run[1:])
        ]
        batch = self._take(takes).combine_chunks().to_batches()[0]
        # Row k of the batch answers request order[k]; reading it back through the inverse
        # permutation restores request order, and torch's gather copies tensors out of Arrow.
        back = np.empty_like(order)
        back[order] = np.arange(order.size)
        try:
            converted = to_torch(batch, Nulls(self.spec.null_fill, self.spec.null_mask), self.spec.padded)
        except (NullError, TooLong) as error:
            # Row k of the batch answers index wanted[order[k]].
            index = int(wanted[order[error.position]])
            raise error.located(f"{self.spec.uri}, index {index}") from None
        media = left_to_decode(self.spec.media, source.decoded)
        if media:
            # Imported here: PyAV and Pillow load only for a table with media to decode.
            from spiral_lightning.media.decode import project

            # Decoded together, as one batch converts cheaper than rows one by one; a row that
            # does not decode is named by the index it answers.
            where = Where(self.spec.uri, indices=tuple(wanted[order].tolist()))
            converted = project(converted, media, where).batch
        columns = {name: _reordered(values, back) for name, values in converted.items()}
        return [{name: values[k] for name, values in columns.items()} for k in range(wanted.size)]

    def _take(self, takes: list[Take]) -> pa.Table:
        """The rows of ``takes`` in order, their splits read on up to ``read_threads`` threads."""
        threads = self.read_threads or default_read_threads()
        groups = _groups(takes, threads)
        if len(groups) == 1:
            return self.source().take(takes)
        return pa.concat_tables(self._executor(threads).map(lambda group: self.source().take(group), groups))

    def _executor(self, threads: int) -> ThreadPoolExecutor:
        """This process's ``threads`` read threads; a forked child starts its own, as it has none
        of them, and a changed ``read_threads`` replaces them."""
        pool = self._pool
        if pool is None or pool[0] != os.getpid() or pool[1] != threads:
            if pool is not None and pool[0] == os.getpid():
                pool[2].shutdown(wait=False)
            pool = (os.getpid(), threads, ThreadPoolExecutor(threads, thread_name_prefix="spiral-lightning-take"))
            self._pool = pool
        return pool[2]

    def _checked(self, indices: Sequence[int]) -> np.ndarray:
        """``indices`` as int64, or ``IndexError`` naming the length for any outside it."""
        wanted = np.fromiter((operator.index(index) for index in indices), dtype=np.int64, count=len(indices))
        length = len(self)
        outside = (wanted < 0) | (wanted >= length)
        if outside.any():
            raise IndexError(
                f"index {int(wanted[outside][0])} is out of range for a TableMapDataset of {length} rows "
                f"(valid indices are 0..{length - 1}; negative indices are not accepted)"
            )
        return wanted


def _groups(takes: list[Take], count: int) -> list[list[Take]]:
    """``takes`` cut into at most ``count`` consecutive groups of about equal positions."""
    total = sum(len(take.positions) for take in takes)
    groups: list[list[Take]] = [[]]
    held = 0
    for take in takes:
        if groups[-1] and len(groups) < count and held >= total * len(groups) / count:
            groups.append([])
        groups[-1].append(take)
        held += len(take.positions)
    return groups


def _reordered(values: torch.Tensor | list[Any], order: np.ndarray) -> Sequence[Any]:
    """``values`` in ``order``: a tensor as one gathered copy split into per-row views, a list
    item by item, copied where ``order`` repeats it so that no two rows share a tensor or list."""
    if isinstance(values, torch.Tensor):
        return values[torch.from_numpy(order)].unbind(0)
    reordered = []
    seen: set[int] = set()
    for k in order.tolist():
        reordered.append(copy.deepcopy(values[k]) if k in seen else values[k])
        seen.add(k)
    return reordered
