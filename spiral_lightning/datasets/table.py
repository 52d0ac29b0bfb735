"""TableDataset: a torch IterableDataset over an exact table version, sharded and resumable."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch.distributed
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from spiral_lightning.core.checks import check_positive
from spiral_lightning.core.media import Where, left_to_decode
from spiral_lightning.core.plan import Plan, Policy, Shard, WorkItem, as_plan, fingerprint
from spiral_lightning.core.spec import TableSpec
from spiral_lightning.core.state import Cursor, State
from spiral_lightning.datasets.consumer import DEFAULT_READ_AHEAD, SKIPPED, Consumer
from spiral_lightning.datasets.job import grouped
from spiral_lightning.datasets.loader import TableLoader, loader_options, workers_for
from spiral_lightning.planning.lists import Units, consumer_rows, every_shard, stored_rows, unit_key, units
from spiral_lightning.planning.policies import Shuffled, balanced, policy_name, window_key
from spiral_lightning.reading.convert import Converter, frame_converter
from spiral_lightning.reading.frames import LAST_MODES, Frame, Last, cut, read_frames, start_of
from spiral_lightning.reading.shuffle import shuffled_chunks
from spiral_lightning.reading.tensors import Nulls, check_nulls, to_torch
from spiral_lightning.reading.transfer import handed_on
from spiral_lightning.sources import Reader

#: Work items counted in one call of ``Source.count``: bounds the lists a count builds at once.
_COUNT_CALL = 65_536


class TableDataset(Consumer, IterableDataset[Any]):
    """The rows of one table version, each consumer reading only its own work list.

        dataset = TableDataset("parquet:data/events", batch_size=256, columns=["x", "label"], shuffle=True)
        for batch in dataset.loader(num_workers=2):  # {"x": float32 [256, 16], "label": int64 [256]}
            ...  # dataset.loader().state_dict() is a cursor a new loader resumes from

    A consumer is a DataLoader worker on one rank; ``policy`` (a function or its name, see
    ``as_policy``) gives its work list, by default ``balanced`` (equal shares in stored order);
    ``shuffle=True`` reads a new order every epoch from ``seed`` instead, in blocks and windows
    sized for the table (see ``shuffle_for``). Each consumer cuts its rows into frames of
    ``batch_size`` rows (read batches as they come when ``None``); ``last`` decides the rows after
    its last full frame. ``collate`` turns each frame into what the dataset yields: tensors by
    default, the Arrow batch when ``None``. The spec's media projections then decode their
    columns; rows dropped by ``on_error="skip"`` make their batch shorter and are counted in
    ``skipped`` and the state. ``rows_per_consumer`` is a quota: each consumer stops after that
    many rows of its work list. Read it through ``loader()``, or a ``DataLoader(batch_size=None)``
    whose workers start by ``"forkserver"`` or ``"spawn"``: a process that opened a table (the
    dataset opens it when built, so a bad column, filter or policy fails there) cannot fork.

    ``set_epoch`` and ``set_rows_per_consumer`` reach running (persistent) DataLoader workers
    through a small shared-memory tensor, which a worker reads as each epoch's pass starts.

    At least ``read_ahead`` read batches are read ahead of the consumer on a thread (0 reads in
    line; more while they are small, see ``reading.ahead``), and ``read_threads`` work items at
    once, each on its own thread (``None``: twice the cores this process gets beside the other
    DataLoader workers, at most 4). Neither changes a row, order or state.

    ``storage_options`` reach a Parquet table in an object store, and ``columns`` and ``filter``
    (a string such as ``"label < 2"`` or a spiral expression) select what is read, as the
    ``TableSpec`` settings of those names do (see ``TableSpec``); a spec that selects its own
    columns or filter cannot be given others.

    ``transform`` is called on each batch after collating and decoding, in the process that reads
    (a DataLoader worker), and what it returns is yielded: per-batch augmentation or tokenizing,
    run in parallel by the workers. It must pickle (a module-level function or class).

    Rank and world size come from the arguments, else from ``torch.distributed`` when it is
    initialized, else 0 and 1. The spec is pinned to one version when the dataset is built. The
    source opens in the process that iterates, and only the spec and the settings are pickled.

    ``state_dict`` / ``load_state_dict`` follow torchdata's ``StatefulDataLoader``: the state is
    a cursor into the consumer's work list, and a restored dataset opens its item at the cursor's
    stored row, skipping only rows inside that read, so a resume costs the same anywhere in the
    epoch. A restored dataset continues the epoch it was saved in.
    """

    def __init__(
        self,
        spec: TableSpec | str,
        *,
        batch_size: int | None = None,
        last: Last = "keep_partial",
        policy: Policy | str | None = None,
        shuffle: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        collate: Callable[[pa.RecordBatch], Any] | None = to_torch,
        rows_per_consumer: int | None = None,
        read_ahead: int = DEFAULT_READ_AHEAD,
        read_threads: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        transform: Callable[[Any], Any] | None = None,
        columns: Sequence[str] | None = None,
        filter: Any = None,
    ) -> None:
        if batch_size is not None:
            check_positive("batch_size", batch_size, "or None")
        if last not in LAST_MODES:
            raise ValueError(f"last must be one of {LAST_MODES}, not {last!r}")
        self.batch_size = batch_size
        self.last: Last = last
        super().__init__(
            spec,
            policy=policy,
            shuffle=shuffle,
            seed=seed,
            rank=rank,
            world_size=world_size,
            read_ahead=read_ahead,
            read_threads=read_threads,
            storage_options=storage_options,
            columns=columns,
            filter=filter,
        )
        if self.spec.media and collate is None:
            raise ValueError("media projections decode into tensors, so they need a collate such as to_torch, not None")
        self.collate = collate
        self.transform = transform
        self._resume: State | None = None
        self._cursor: Cursor | None = None
        self._work: str | None = None
        self._delivered = 0
        self._counts: dict[str, int] = {}
        self._unit_rows: dict[str, np.ndarray] = {}
        self._rows_of: tuple[Plan, str, int, int, np.ndarray] | None = None
        self.set_rows_per_consumer(rows_per_consumer)
        check_nulls(
            Nulls(self.spec.null_fill, self.spec.null_mask), self.source().schema, self.spec.uri, self.spec.padded
        )

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        # Counts are the main process's business, and may be large.
        state["_unit_rows"] = {}
        state["_rows_of"] = None
        return state

    def _on_new_epoch(self) -> None:
        # A position belongs to its epoch. A re-planned remainder stays for its epoch (replanned):
        # a Mixture moves a table from pass to pass and may iterate the re-planned pass again.
        self._cursor = None
        self._work = None
        self._delivered = 0

    @property
    def skipped(self) -> int:
        """The rows of this epoch dropped by ``on_error="skip"``: a DataLoader worker's own, or in
        the main process those of every consumer of this rank, whatever the worker count."""
        return self.tally(SKIPPED)

    def _check_quota(self, rows: int) -> None:
        if self.last == "require_full" and self.batch_size is not None and rows % self.batch_size:
            raise ValueError(
                f"rows_per_consumer {rows} is not a multiple of batch_size {self.batch_size}, "
                "so last='require_full' would fail on every consumer; round the quota down to a multiple"
            )

    def loader(self, num_workers: int | None = None, **options: Any) -> StatefulDataLoader:
        """A ``StatefulDataLoader`` that reads this dataset as it must be read: its own batches as
        they are (``batch_size=None``), ``num_workers`` persistent workers started by ``forkserver``
        (by default ``loader.workers_for``'s), ``len`` in batches; ``options`` override these."""
        self.check_shares(num_workers := workers_for(self, num_workers))
        loader: StatefulDataLoader = TableLoader(self, **loader_options(num_workers, options, self))
        return loader

    def load_elastic(
        self,
        states: Sequence[Mapping[str, Any]],
        lineage: Mapping[str, Any] | None = None,
        *,
        finished: Collection[Shard] = (),
        keep: bool = False,
    ) -> None:
        """Share the rows that every saved consumer of another topology (``states``, their
        ``state_dict``s) had not delivered among this dataset's consumers, each once; later epochs
        plan as usual. ``lineage``: the ``lineage()`` saved beside states of a re-planned epoch.
        ``finished``: saved consumers done with their list whatever their state says, ``keep``:
        keep other epochs' re-plans (both for a ``Mixture``'s tables). ``ValueError`` unless the
        states are one epoch of one version and policy."""
        self.replan_saved([State.from_dict(state) for state in states], lineage, keep=keep, finished=finished)
        self._resume = None

    def __len__(self) -> int:
        """The exact rows this rank reads over all its workers (a rank's rows do not depend on its
        worker count), reading only the filter's columns, once per job (see ``count_shared``).
        With a quota the count is the rank's rows read by one worker; ``batches`` counts for any
        worker count."""
        # A built-in policy gives a rank the same rows for any worker count: reuse the one counted last.
        planned_at_once = self._lists(1)[2] is not None
        workers = self._rows_of[3] if planned_at_once and self._rows_of is not None else 1
        return self._capped(int(self._rows(workers, self.rank).sum()))

    def batches(self, workers: int) -> int:
        """The exact batches this rank yields in this epoch through a DataLoader with ``workers``
        workers (0 reads in the main process): each consumer's rows, after the quota, in frames of
        ``batch_size``, the shorter tail counted with ``last="keep_partial"``."""
        if self.batch_size is None:
            raise ValueError("a dataset without a batch_size yields read batches, which cannot be counted ahead")
        size, partial = self.batch_size, self.last == "keep_partial"
        return sum(math.ceil(rows / size) if partial else rows // size for rows in self.consumer_rows(workers))

    def consumer_rows(self, workers: int, epoch: int | None = None) -> list[int]:
        """The rows each of this rank's consumers (by worker) reads in ``epoch`` (this one when
        ``None``), after the quota; a count only: the dataset stays in its epoch and position."""
        now, self._settings[0] = self.epoch, self.epoch if epoch is None else epoch
        try:
            return [self._capped(rows) for rows in self._rows(max(1, workers), self.rank).tolist()]
        finally:
            self._settings[0] = now

    def even_rows(self, workers: int) -> tuple[int, int]:
        """The rows every consumer of every rank reads in this epoch for equal batches when each
        rank has ``workers`` DataLoader workers (0 reads in the main process), and the rows that
        leaves out of the epoch.

        The quota is the fewest rows any consumer's work list returns, rounded down to whole
        batches with ``last="require_full"``; give it to ``set_rows_per_consumer``. Every rank
        counts every consumer's list the same way, so all agree without talking.
        """
        rows = self._rows(max(1, workers))
        quota = int(rows.min())
        if self.last == "require_full" and self.batch_size is not None:
            quota -= quota % self.batch_size
        return quota, int(rows.sum()) - quota * rows.size

    def count_shared(self, workers: int) -> None:
        """Count the rows that pass the filter for this epoch's lists with ``workers`` workers a
        rank, each rank a ``1/world_size`` share, and exchange the counts over the default
        ``torch.distributed`` process group: the table's filter columns are then read once per
        job, not once per rank. A collective: every rank calls it, in the same order (the
        DataModule and Ray's ``train_loader`` do before each epoch). Without a filter, a process
        group of this dataset's ranks or a built-in policy it does nothing, and counts are made
        by each rank alone when asked."""
        if self.spec.filter is None or not grouped(self.rank, self.world_size):
            return
        plan, policy, key = self._lists(max(1, workers))
        if key is None or key in self._unit_rows:
            return
        found = units(policy, plan, self.world_size, max(1, workers))
        mine = np.arange(self.rank, found.split.size, self.world_size)
        parts: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(parts, self._count_items(found, mine))
        counted = np.empty(found.split.size, dtype=np.int64)
        for rank, part in enumerate(parts):
            counted[rank :: self.world_size] = part
        self._unit_rows[key] = counted

    def _lists(self, workers: int) -> tuple[Plan, Policy, str | None]:
        """What this epoch's work lists are cut from when each rank has ``workers`` consumers:
        the plan and the policy (or a re-planned remainder shared with ``balanced``), and what
        names their units (``None`` for a policy planned one consumer at a time)."""
        remainder = self.replanned()
        digest = self.lineage_digest()
        if remainder is not None and digest is not None:
            return remainder, balanced, f"{unit_key(balanced, self.world_size, workers)} of {digest}"
        key = unit_key(self.policy, self.world_size, workers)
        return as_plan(self.source().splits), self.policy, None if key is None else f"{key} of the plan"

    def _rows(self, workers: int, rank: int | None = None) -> np.ndarray:
        """The rows each consumer's work list returns after the filter in this epoch when every
        rank has ``workers`` consumers, by ``rank * workers + worker``, or those of ``rank``'s
        consumers alone. For a built-in policy (or a remainder) every consumer is planned at
        once, in O(plan), from the rows of its units (see ``spiral_lightning.lists``), and the
        last answer is kept, since an epoch asks several times (even batches, ``batches``,
        ``len``); any other policy's lists are counted in turn, those asked for only."""
        plan, policy, key = self._lists(workers)
        ranks = range(self.world_size) if rank is None else range(rank, rank + 1)
        if key is None:
            shards = every_shard(self.world_size, workers, ranks)
            return np.array([self._count(policy(plan, shard, self.epoch)) for shard in shards], dtype=np.int64)
        epoch = self.epoch if isinstance(policy, Shuffled) else 0
        asked = (policy_name(policy), epoch, workers)
        if self._rows_of is None or self._rows_of[0] is not plan or self._rows_of[1:4] != asked:
            if key not in self._unit_rows and self.spec.filter is None:
                self._unit_rows[key] = stored_rows(policy, plan, self.world_size, workers)
            elif key not in self._unit_rows:
                found = units(policy, plan, self.world_size, workers)
                self._unit_rows[key] = self._count_items(found, np.arange(found.split.size))
            rows = consumer_rows(policy, plan, self._unit_rows[key], self.world_size, workers, self.epoch)
            self._rows_of = (plan, *asked, rows)
        return self._rows_of[4][ranks.start * workers : ranks.stop * workers]

    def _count_items(self, found: Units, index: np.ndarray) -> np.ndarray:
        """The rows after the filter of the units of ``index``, counted in calls of bounded size."""
        counted = [
            self.source().count(found.items(index[start : start + _COUNT_CALL]))
            for start in range(0, index.size, _COUNT_CALL)
        ]
        return np.array([rows for part in counted for rows in part], dtype=np.int64)

    def _count(self, items: list[WorkItem]) -> int:
        """The rows ``items`` return after the filter: their stored rows without one (no source
        is asked), else counted once per work list: the version never changes, so an epoch with
        the same lists counts nothing again."""
        if self.spec.filter is None:
            return sum(item.end - item.start for item in items)
        key = fingerprint(items)
        if key not in self._counts:
            self._counts[key] = sum(self.source().count(items))
        return self._counts[key]

    def _capped(self, rows: int) -> int:
        return rows if self.rows_per_consumer is None else min(rows, self.rows_per_consumer)

    def state_of(self, shard: Shard) -> State:
        """The state of consumer ``shard`` as this dataset stands: its cursor and the settings it
        is valid for (a kind built on this one, such as ``PackedDataset``, replaces the cursor)."""
        return State(
            version=self.version,
            shard=shard,
            batch_size=self.batch_size,
            epoch=self.epoch,
            policy=policy_name(self.policy),
            work=self._work,
            cursor=self._cursor,
            rows_per_consumer=self.rows_per_consumer,
            delivered=self._delivered,
            skipped=self.own_tally(SKIPPED),
            remainder=self.lineage_digest(),
        )

    def state(self) -> State:
        """This consumer's cursor and the settings it is valid for; ``state_dict`` is its plain values."""
        return self.state_of(self.shard()) if self._resume is None else self._resume

    def state_dict(self) -> dict[str, Any]:
        return self.state().to_dict()

    def sliced(self) -> bool:
        """Whether each batch is ``to_torch`` of one frame (``frames``) and nothing more, so that a
        worker's group may convert its frames at once (``groups.Grouped``)."""
        plain = self.collate is to_torch and self.transform is None and not (self.spec.media or self.spec.padded)
        return plain and type(self).__iter__ is TableDataset.__iter__

    def mark(self) -> tuple[Cursor | None, int]:
        """The cursor and the rows delivered: all a state after one frame of a pass differs in
        from the state after another (``groups.Marks``)."""
        return self._cursor, self._delivered

    def state_now(self) -> State | dict[str, Any]:
        """The state as cheaply as it can be taken, for a worker's group to carry: ``state()``
        where ``state_dict`` is its plain values, else (a kind that says more) ``state_dict()``."""
        return self.state() if type(self).state_dict is TableDataset.state_dict else self.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state saved over the same version, consumer, batch size, policy and
        quota, its cursor in range and intact; ``ValueError`` naming the field otherwise."""
        saved = State.from_dict(state, check_digest=False)
        saved.check_matches(self.state_of(self.shard()))
        self.check_lineage("TableDataset", saved)
        self._settings[0] = saved.epoch
        if saved.remainder is None:
            self.drop_replan()
        self.check_loaded("TableDataset", saved, self.work(), windows=True, rows=True)
        self._resume = saved

    def __iter__(self) -> Iterator[Any]:
        convert = self.converter()
        for frame, first_row in self.frames():
            batch = convert(frame, first_row)
            if self.transform is not None:
                batch = self.transform(batch)
            yield batch if self.collate is None or not self.hands_on else handed_on(batch)

    def frames(self) -> Iterator[tuple[Frame, int]]:
        """This pass's frames as they are cut, each with the row of the consumer's stream it
        starts at; ``state()`` after each is the state after that frame (``converter`` makes each
        what the dataset yields)."""
        shard, items, work = self.begin()
        resume, self._resume = self._resume, None
        cursor = start_of(items)
        delivered = skipped = 0
        if resume is not None and resume.cursor is not None:
            self.check_resume("TableDataset", resume, shard, work, items)
            cursor, delivered, skipped = resume.cursor, resume.delivered, resume.skipped
        self._work = work
        self._cursor = cursor
        self._delivered = delivered
        self.set_tally(SKIPPED, skipped)
        frames = self._frames(self.reader(), items, cursor, shard)
        if self.rows_per_consumer is not None:
            frames = _within(frames, self.rows_per_consumer - delivered, Cursor(len(items), 0))
        for frame, after in frames:
            self._cursor = after
            first_row = self._delivered
            self._delivered += frame.num_rows
            yield frame, first_row

    def converter(self) -> Converter:
        """What this pass makes of a frame: its record batch without a ``collate``, else what the
        collate makes of it with the spec's media decoded; a null that the spec's ``null_fill``
        and ``null_mask`` leave raises naming the table, consumer and row."""
        shard = self.shard()
        if self.collate is None:
            return lambda frame, first_row: frame.rows()
        table = f"{self.spec.uri} (rank {shard.rank}, worker {shard.worker})"
        nulls = Nulls(self.spec.null_fill, self.spec.null_mask)
        convert = frame_converter(self.collate, nulls, self.spec.padded, table)
        if not self.spec.media:
            return convert
        return lambda frame, first_row: self._decode(convert(frame, first_row), shard, first_row)

    def _frames(
        self, reader: Reader, items: list[WorkItem], cursor: Cursor, shard: Shard
    ) -> Iterator[tuple[Frame, Cursor]]:
        """The consumer's frames from ``cursor``, shuffled within windows when the policy asks."""
        policy = self.policy
        if not isinstance(policy, Shuffled) or not policy.buffer_rows:
            return read_frames(reader, items, cursor, self.batch_size, self.last)
        chunks = shuffled_chunks(reader, items, cursor, policy.buffer_rows, window_key(policy.seed, self.epoch, shard))
        return cut(chunks, self.batch_size, self.last, Cursor(len(items), 0))

    def _decode(self, batch: dict[str, Any], shard: Shard, first_row: int) -> dict[str, Any]:
        """``batch`` with the spec's media decoded; rows skipped for bad media are counted."""
        where = Where(f"{self.spec.uri} (rank {shard.rank}, worker {shard.worker})", first_row)
        media = left_to_decode(self.spec.media, self.source().decoded)
        # Imported here: PyAV and Pillow load only for a table with media to decode.
        from spiral_lightning.media.decode import project

        projected = project(batch, media, where, on_error=self.spec.on_error)
        self.set_tally(SKIPPED, self.own_tally(SKIPPED) + len(projected.skipped))
        return projected.batch


def _within(frames: Iterator[tuple[Frame, Cursor]], rows: int, done: Cursor) -> Iterator[tuple[Frame, Cursor]]:
    """The first ``rows`` rows of ``frames``; the frame that reaches the quota ends at ``done``,
    the cursor of a finished consumer, so a resume after it reads nothing more."""
    left = rows
    if left <= 0:
        return
    for frame, after in frames:
        if frame.num_rows >= left:
            yield frame.head(left), done
            return
        left -= frame.num_rows
        yield frame, after
