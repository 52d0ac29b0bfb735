"""Mixture: several table versions interleaved by weight into one resumable stream of batches.

Each output batch comes from one table, chosen by ``planning.mixing.next_table``: the table
furthest behind its weight's share, so the row proportions track the weights within about one
batch per table at every point of the epoch (a seeded random draw would match them only on
average); the seed sets where in the cycle each consumer starts. A consumer's state is a
``MixtureState``; ``load_elastic`` re-plans a saved epoch for other ranks or workers
(``planning.elastic_mixture``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, Literal

import pyarrow as pa
import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from spiral_lightning.core.checks import check_count, check_positive
from spiral_lightning.core.mixture_state import MixtureState, Progress, ended, pass_epoch
from spiral_lightning.core.plan import Policy, Shard
from spiral_lightning.core.schedule import Weights, WeightSchedule, normalized
from spiral_lightning.core.spec import TableSpec, as_spec, narrowed
from spiral_lightning.core.state import check_same_topology
from spiral_lightning.datasets.consumer import DEFAULT_READ_AHEAD
from spiral_lightning.datasets.loader import batch_loader, workers_for
from spiral_lightning.datasets.stall import rows_of
from spiral_lightning.datasets.table import TableDataset
from spiral_lightning.planning.elastic_mixture import MixtureLineage, MixtureStart, TableOf, table_passes
from spiral_lightning.planning.lineage import RowLineage
from spiral_lightning.planning.mixing import Chooser, count_batches, phases_of
from spiral_lightning.planning.policies import policy_name
from spiral_lightning.reading.tensors import to_torch

#: What ends a mixture's epoch on each consumer: the first table that runs out, or every table
#: read through at least once, restarting the ones that run out before that.
Stop = Literal["first_exhausted", "cycle"]
STOP_MODES: tuple[Stop, ...] = ("first_exhausted", "cycle")


class Mixture(IterableDataset[Any]):
    """Batches from several table versions, interleaved by weight, each batch from one table.

        mixture = Mixture([("spiral:data/web", 0.7), ("spiral:data/books", 0.3)], batch_size=32, table_key="table")
        for batch in mixture.loader(num_workers=2):  # {..., "table": 0 or 1}, 70% of rows from web
            ...

    ``tables`` pairs each table (a spec or a uri; versions, backends and schemas may differ) with
    a positive weight, its share of the rows delivered. ``columns`` selects the columns every
    table must have and the batches hold (each table's own spec columns when ``None``); a table
    whose spec selects other columns is a ``ValueError`` naming the table and the column.

    Every consumer (a DataLoader worker on one rank) reads its own work list of every table, as
    ``TableDataset`` does with ``policy`` (``balanced`` by default) or ``shuffle=True`` (each
    table shuffled for its size, from ``seed``), in frames of ``batch_size`` rows, and picks the next
    table by deficit (``planning.mixing.next_table``), from phases drawn from ``(seed, epoch,
    consumer)``, so consumers start their cycles at different tables.

    A table runs out when it is chosen and has no rows left. ``stop="first_exhausted"`` ends the
    consumer's epoch there: every row is delivered at most once, and the table that ran out
    exactly once. ``stop="cycle"`` starts that table's next pass (read in ``pass_epoch(epoch,
    pass)``) and ends the epoch when every table has been read to its end at least once; a pass
    that gives the consumer no rows drops the table for the rest of the epoch.

    ``schedule`` changes the weights with the rank's step in the epoch (``core.schedule``): a
    list of ``(step, weights)`` points, each in force from its step on, or a picklable function
    of the step that returns the weights; a change shapes only the rows after it.

    ``collate`` turns each frame into a batch (tensors by default; a batch's rows are its ``len``,
    or its first column's). With ``table_key`` set, each batch (a mapping) also holds the index
    of its table under that key. Each table reads ``read_ahead`` read batches ahead.
    ``state_dict`` / ``load_state_dict`` follow torchdata's ``StatefulDataLoader``: every table's
    ``TableDataset`` state plus each table's passes and delivered rows; ``load_elastic``
    continues an epoch saved under other ranks, workers or weights.
    """

    def __init__(
        self,
        tables: Sequence[tuple[TableSpec | str, float]],
        *,
        batch_size: int,
        seed: int = 0,
        columns: Sequence[str] | None = None,
        stop: Stop = "first_exhausted",
        policy: Policy | str | None = None,
        shuffle: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        collate: Callable[[pa.RecordBatch], Any] | None = to_torch,
        table_key: str | None = None,
        read_ahead: int = DEFAULT_READ_AHEAD,
        schedule: Sequence[tuple[int, Sequence[float]]] | Callable[[int], Sequence[float]] | None = None,
    ) -> None:
        if not tables:
            raise ValueError("a Mixture needs at least one (table, weight) pair")
        check_positive("batch_size", batch_size)
        check_count("seed", seed)
        if stop not in STOP_MODES:
            raise ValueError(f"stop must be one of {STOP_MODES}, not {stop!r}")
        if table_key is not None and collate is None:
            raise ValueError("table_key adds an entry to each batch, so it needs a collate that makes mappings")
        if columns is not None and (isinstance(columns, str) or not columns):
            raise ValueError(f"columns must be a non-empty list of column names, not {columns!r}")
        specs: list[TableSpec] = []
        for index, pair in enumerate(tables):
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise TypeError(f"table {index} of the mixture must be a (table, weight) pair, not {pair!r}")
            specs.append(narrowed(as_spec(pair[0]), columns, f"table {index} of the mixture"))
        self.weights = normalized([weight for _, weight in tables], len(tables))
        self.schedule = None if schedule is None else WeightSchedule.of(schedule, len(tables))
        self.batch_size = batch_size
        self.seed = seed
        self.stop: Stop = stop
        self.table_key = table_key
        # The epoch, shared with the copies pickled for workers like TableDataset's settings, so
        # set_epoch reaches persistent workers.
        self._epoch = torch.zeros(1, dtype=torch.int64)
        opened: list[TableDataset] = []
        for index, spec in enumerate(specs):
            try:
                opened.append(
                    TableDataset(
                        spec,
                        batch_size=batch_size,
                        policy=policy,
                        shuffle=shuffle,
                        seed=seed,
                        rank=rank,
                        world_size=world_size,
                        collate=collate,
                        read_ahead=read_ahead,
                    )
                )
            except ValueError as error:
                raise ValueError(f"table {index} of the mixture ({spec.uri}): {error}") from error
        self.tables = tuple(opened)
        for dataset in self.tables:
            # Each consumer moves its own tables through their passes, so a worker's tables must
            # not share their epochs with the other workers' (as a TableDataset pickled alone does).
            dataset.keep_settings_private()
        self._progress = [Progress()] * len(self.tables)
        # Whether each table's TableDataset state describes its current pass: a table not yet
        # read this epoch still holds the cursor of an earlier one.
        self._live = [False] * len(self.tables)
        # The epoch whose iteration _progress and _live describe: before a consumer's first batch of
        # an epoch its state is where the epoch starts, not where the last one ended.
        self._begun: int | None = None
        self._resume: MixtureState | None = None
        self._start: MixtureStart | None = None
        self._lineage: MixtureLineage | None = None
        # The weights in force, their rows since and the step, while an epoch is read; whether a
        # re-plan starts the weights anew.
        self._chooser = self._first_chooser(Shard())
        self._restart = False

    def __getstate__(self) -> dict[str, Any]:
        self._epoch.share_memory_()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return self.__dict__.copy()

    def shard(self) -> Shard:
        """This process's consumer: this rank, and the DataLoader worker when in one."""
        return self.tables[0].shard()

    @property
    def epoch(self) -> int:
        """The mixture epoch read (see ``set_epoch``)."""
        return int(self._epoch[0])

    def loader(self, num_workers: int | None = None, **options: Any) -> StatefulDataLoader:
        """A ``StatefulDataLoader`` that reads this dataset as it must be read: its own batches
        as they are (``batch_size=None``), ``num_workers`` workers started by ``forkserver`` and
        persistent, as ``TableDataset.loader`` makes them; ``options`` go to the loader and
        override these."""
        num_workers = workers_for(self, num_workers)
        for table in self.tables:
            table.check_shares(num_workers)
        return batch_loader(self, num_workers, options)

    def set_epoch(self, epoch: int) -> None:
        """Read ``epoch`` from now on: its table epochs (``pass_epoch``) and its phases. It reaches
        DataLoader workers that are already running (``persistent_workers=True``)."""
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, not {epoch}")
        self._epoch[0] = epoch

    def __len__(self) -> int:
        raise TypeError(
            "a Mixture has no length in rows: where its stop rule ends each consumer's epoch depends on every "
            "table's share and on the worker count; batches(num_workers) counts its batches"
        )

    @property
    def version(self) -> str:
        """The pinned versions of the tables, in order, as one name."""
        return " + ".join(table.spec.version for table in self.tables)

    def batches(self, workers: int) -> int:
        """The exact batches this rank yields in this epoch through a DataLoader with ``workers``
        workers (0 reads in the main process): each consumer's, from the rows every pass of every
        table gives it (``planning.mixing.count_batches``), without reading a row."""
        consumers = max(1, workers)
        rows: dict[tuple[int, int], list[int]] = {}

        def pass_rows(worker: int, table: int, passes: int) -> int:
            if (table, passes) not in rows:
                rows[table, passes] = self.tables[table].consumer_rows(workers, pass_epoch(self.epoch, passes))
            return rows[table, passes][worker]

        first = self.tables[0]
        total = 0
        for worker in range(consumers):
            shard = Shard(first.rank, first.world_size, worker, consumers)
            phases = phases_of(self.seed, self.epoch, shard, len(self.tables))
            start, chooser = self._first_progress(shard), self._first_chooser(shard)
            total += count_batches(start, partial(pass_rows, worker), phases, chooser, self.batch_size, self.stop)
        return total

    def _state(self) -> MixtureState:
        shard = self.shard()
        begun = self._begun == self.epoch
        live = self._live if begun else [False] * len(self.tables)
        chooser = self._chooser if begun else self._first_chooser(shard)
        return MixtureState(
            seed=self.seed,
            stop=self.stop,
            weights=chooser.weights,
            batch_size=self.batch_size,
            shard=shard,
            epoch=self.epoch,
            tables=tuple(self._progress if begun else self._first_progress(shard)),
            states=tuple(table.state_dict() if on else None for table, on in zip(self.tables, live, strict=True)),
            remainder=None if self._replanned() is None or self._lineage is None else self._lineage.digest,
            since=tuple(chooser.since),
            step=chooser.step,
        )

    def _first_progress(self, shard: Shard) -> list[Progress]:
        """Where consumer ``shard`` starts this epoch: at the start, or where a re-plan puts it."""
        start = self._replanned()
        return start.progress(shard) if start is not None else [Progress()] * len(self.tables)

    def reweighted(self, state: Mapping[str, Any]) -> bool:
        """Whether a consumer ``state`` was saved under other weights than this mixture's at its step."""
        saved = MixtureState.from_dict(state, check_digest=False).widened(len(self.tables))
        return saved.weights != self._weights_at(saved.next_step)

    def _weights_at(self, step: int) -> Weights:
        return self.weights if self.schedule is None else self.schedule.at(step, self.weights)

    def _first_chooser(self, shard: Shard) -> Chooser:
        """How consumer ``shard`` chooses from the start of this epoch, or of a re-plan of it: the
        weights at its first step, in force since the start or since the re-plan changed them."""
        start = self._replanned()
        step = shard.worker + (0 if start is None else start.step)
        since = [table.rows for table in start.progress(shard)] if start is not None and self._restart else []
        return Chooser(self._weights_at, self._weights_at(step), since, step, shard.workers)

    def _replanned(self) -> MixtureStart | None:
        """Where ``load_elastic`` starts every consumer, while its epoch lasts."""
        return self._start if self._start is not None and self._start.epoch == self.epoch else None

    def state_dict(self) -> dict[str, Any]:
        """This consumer's position in the mixture and the settings it is valid for, as plain values."""
        if self._resume is not None:
            return self._resume.to_dict()
        return self._state().to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state saved by a mixture with the same tables, seed, stop rule, batch
        size and consumer; ``ValueError`` naming what differs otherwise. Under other weights (or
        schedule) the rows from the saved position on follow them; no row of a table's pass comes
        twice. Tables added after the saved ones start at their first pass."""
        saved = MixtureState.from_dict(state, check_digest=False).widened(len(self.tables))
        check_same_topology("Mixture", saved.shard, self.shard())
        saved.check_matches(self._state())
        if saved.remainder is not None and (self._lineage is None or self._lineage.digest != saved.remainder):
            raise ValueError(
                f"the Mixture state continues epoch {saved.epoch} re-planned from another topology (lineage "
                f"{saved.remainder}), which this mixture has not re-planned; restore it with "
                "load_elastic(every consumer's state, lineage=the lineage() saved beside them), or, under the "
                "saved ranks and workers, call load_lineage(that lineage) before load_state_dict"
            )
        for index, (table, progress, table_state) in enumerate(
            zip(self.tables, saved.tables, saved.states, strict=True)
        ):
            if table_state is None:
                continue
            expected = pass_epoch(saved.epoch, progress.passes)
            if table_state.get("epoch") != expected:
                raise ValueError(
                    f"the Mixture state's tables[{index}].state is for table epoch {table_state.get('epoch')!r}, "
                    f"but pass {progress.passes} of epoch {saved.epoch} reads table epoch {expected}"
                )
            table.load_state_dict(table_state)
        saved.check_intact()
        self._resume = saved
        self._epoch[0] = saved.epoch

    def load_elastic(self, states: Sequence[Mapping[str, Any]], lineage: Mapping[str, Any] | None = None) -> None:
        """Continue an epoch saved by every consumer under another world size, worker count, batch
        size or weights: each table's rows of its passes in progress that none of them delivered
        are shared among this mixture's consumers, each exactly once, and later epochs plan as
        usual (see ``planning.elastic_mixture``). ``states`` holds every saved consumer's
        ``state_dict``; when they continue an epoch re-planned before, ``lineage`` is the
        ``lineage()`` saved beside them. ``ValueError`` when they differ in settings or epoch."""
        saved = [MixtureState.from_dict(state).widened(len(self.tables)) for state in states]
        # New weights (or ones that changed inside the saved epoch) shape the rows from the re-plan on.
        current = self._state()
        for state in saved:
            state.check_matches(current, ("seed", "stop"))
        tables = [TableOf(table.spec.version, policy_name(table.policy)) for table in self.tables]
        passes, start = table_passes(saved, lineage, tables)
        self._restart = any(state.weights != self._weights_at(start.step) or any(state.since) for state in saved)
        firsts, later = [], []
        for index, (table, shared) in enumerate(zip(self.tables, passes, strict=True)):
            made = []
            for number, found in enumerate(shared):
                try:
                    table.load_elastic(found.states, found.lineage, finished=found.finished, keep=number > 0)
                except ValueError as error:
                    raise ValueError(f"table {index} of the mixture ({table.spec.uri}): {error}") from error
                made.append(RowLineage.from_dict(table.lineage() or {}))
            firsts.append(made[0])
            later.append(tuple(made[1:]))
        self._start = start
        self._begun = None
        self._lineage = MixtureLineage(start, tuple(firsts), tuple(later) if any(later) else ())
        self._resume = None
        self._epoch[0] = start.epoch

    def load_lineage(self, lineage: Mapping[str, Any]) -> None:
        """Read, in its epoch, the remainders ``lineage`` (a ``lineage()``) describes, as the
        consumers of its re-plan do, so that their states, which name it, restore with
        ``load_state_dict`` under the same topology."""
        found = MixtureLineage.from_dict(lineage)
        if len(found.tables) != len(self.tables):
            raise ValueError(
                f"the Mixture re-plan lineage holds {len(found.tables)} tables, but the mixture has "
                f"{len(self.tables)}; it belongs to another mixture"
            )
        for index, table in enumerate(self.tables):
            for number, made in enumerate(found.passes_of(index)):
                try:
                    table.load_lineage(made.to_dict(), keep=number > 0)
                except ValueError as error:
                    raise ValueError(f"table {index} of the mixture ({table.spec.uri}): {error}") from error
        self._start = found.start
        self._begun = None
        self._lineage = found
        self._epoch[0] = found.start.epoch

    def lineage(self) -> dict[str, Any] | None:
        """While this epoch continues a re-plan, what makes its remainders again (see
        ``spiral_lightning.elastic_mixture``), as plain values: save it once beside every
        consumer's ``state_dict`` and give both to ``load_elastic``. ``None`` in an epoch planned
        as usual."""
        if self._replanned() is None or self._lineage is None:
            return None
        return self._lineage.to_dict()

    def __iter__(self) -> Iterator[Any]:
        resume, self._resume = self._resume, None
        if resume is not None and resume.epoch != self.epoch:
            raise ValueError(
                f"the Mixture state was saved in epoch {resume.epoch}, but the mixture is now set to epoch "
                f"{self.epoch}; load the state again, or set the epoch before loading it"
            )
        shard = self.shard()
        self._begun = self.epoch
        self._progress = list(resume.tables) if resume is not None else self._first_progress(shard)
        if resume is None:
            self._chooser = self._first_chooser(shard)
        else:
            step = resume.next_step
            weights = self._weights_at(step)
            since = [t.rows for t in resume.tables] if resume.weights != weights else list(resume.since)
            self._chooser = Chooser(self._weights_at, weights, since, step, shard.workers)
        self._live = (
            [state is not None for state in resume.states] if resume is not None else [False] * len(self.tables)
        )
        if ended(self.stop, self._progress):
            # A state saved after the consumer's last batch: its epoch is over.
            return
        for number, table in enumerate(self.tables):
            if not self._live[number]:
                table.set_epoch(pass_epoch(self.epoch, self._progress[number].passes))
            try:
                table.source()
            except ValueError as error:
                raise ValueError(f"table {number} of the mixture ({table.spec.uri}): {error}") from error
        phases = phases_of(self.seed, self.epoch, shard, len(self.tables))
        streams: list[Iterator[Any] | None] = [None] * len(self.tables)
        while (index := self._chooser.choose(self._progress, phases, self.batch_size)) is not None:
            batch = self._next(index, streams)
            if batch is _END:
                return
            if batch is _AGAIN:
                continue
            progress = self._progress[index]
            self._progress[index] = progress._replace(rows=progress.rows + rows_of(batch))
            self._chooser.took()
            yield self._tag(batch, index)

    def _next(self, index: int, streams: list[Iterator[Any] | None]) -> Any:
        """The next batch of table ``index``; ``_END`` when the epoch ends, ``_AGAIN`` when the
        table turned out empty for this consumer and another must be chosen."""
        table = self.tables[index]
        stream = streams[index]
        if stream is None:
            stream = streams[index] = iter(table)
            self._live[index] = True
        batch = next(stream, _END)
        if batch is not _END:
            return batch
        progress = self._progress[index]
        self._progress[index] = progress = progress._replace(passes=progress.passes + 1)
        # The table's state is for its current pass, which has not begun.
        self._live[index] = False
        if ended(self.stop, self._progress):
            return _END
        table.set_epoch(pass_epoch(self.epoch, progress.passes))
        stream = streams[index] = iter(table)
        self._live[index] = True
        batch = next(stream, _END)
        if batch is _END:
            self._progress[index] = progress._replace(empty=True)
            return _AGAIN
        return batch

    def _tag(self, batch: Any, index: int) -> Any:
        if self.table_key is None:
            return batch
        if not isinstance(batch, Mapping):
            raise TypeError(f"table_key needs batches that are mappings, but collate made a {type(batch).__name__}")
        if self.table_key in batch:
            raise ValueError(f"table_key {self.table_key!r} is also a column of table {index}; pick another key")
        return {**batch, self.table_key: index}


#: Markers ``Mixture._next`` returns instead of a batch.
_END = object()
_AGAIN = object()
