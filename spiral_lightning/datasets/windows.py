"""WindowDataset: samples of consecutive rows of one group (say the frames of one episode),
batched as ``[B, size, ...]`` and resumable at any batch (the windows themselves are
``spiral_lightning.reading.windows``'s). A table whose episodes span splits should be written so
that they do not, or read with a policy whose items keep them whole.

An elastic re-plan (``load_elastic``) shares the windows no saved consumer delivered among the
consumers of another topology. It deals the remainder in whole pieces (``stripe``): a cut inside
a piece would end a run there and lose the windows across it. A saved consumer's first piece
begins at its anchor and carries its lead, so its windows start where they would have.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import pyarrow as pa
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from spiral_lightning.core import integrity
from spiral_lightning.core.checks import check_count, check_positive
from spiral_lightning.core.plan import Policy, Shard, WorkItem, fingerprint
from spiral_lightning.core.spec import TableSpec, as_spec, with_selection
from spiral_lightning.core.state import State, check_same_topology, check_saved
from spiral_lightning.datasets.consumer import DEFAULT_READ_AHEAD
from spiral_lightning.datasets.loader import batch_loader, workers_for
from spiral_lightning.datasets.table import TableDataset
from spiral_lightning.planning.elastic import replan, share_of
from spiral_lightning.planning.lineage import Remainder, RowLineage, check_lineage
from spiral_lightning.planning.policies import policy_name, stripe
from spiral_lightning.reading.frames import LAST_MODES, Last, start_of
from spiral_lightning.reading.tensors import Nulls, to_torch
from spiral_lightning.reading.transfer import handed_on
from spiral_lightning.reading.windows import (
    WindowPlaces,
    WindowPosition,
    Windows,
    count_windows,
    read_windows,
    stack,
    window_places,
)
from spiral_lightning.sources import Source, open_source

#: Moved to ``spiral_lightning.reading.windows``; importable from here as before.
__all__ = ["WINDOWS_FORMAT", "WindowDataset", "WindowPosition", "Windows", "read_windows", "stack"]

#: The version of the dictionary ``WindowDataset.state_dict`` writes.
WINDOWS_FORMAT = 1


class WindowDataset(IterableDataset[Any]):
    """Batches of ``batch_size`` windows of one table version, each consumer windowing its own
    work list.

        frames = WindowDataset("spiral:data/episodes", windows=Windows(8, stride=4, group_by="episode"), batch_size=16)
        batch = next(iter(frames.loader(num_workers=2)))
        batch["image"]  # [16, 8, ...]: 16 windows of 8 consecutive frames, never across episodes

    Consumers, ``policy``, ranks, ``read_ahead``, ``storage_options``, ``columns``, ``filter`` and
    the pinned version work as in ``TableDataset``, but the default policy is ``stripe``, whose work
    items are whole splits: ``balanced`` and ``Shuffled`` cut splits, and a window never crosses a
    cut. ``collate`` turns each batch's rows into columns (tensors by default) and each column is
    then grouped by window into ``[batch_size, size, ...]`` (lists of lists for columns that stay
    lists); with ``collate=None`` a batch is the Arrow rows, window after window. ``last`` decides
    the windows after the consumer's last full batch.

    ``state_dict`` / ``load_state_dict`` follow torchdata's ``StatefulDataLoader``: the state is
    a ``TableDataset`` state whose cursor is the anchor of the next window, plus the lead and the
    windows it is valid for, so a resume re-reads at most one window's rows. ``load_elastic``
    continues an epoch saved under other ranks or workers, every window exactly once.
    """

    def __init__(
        self,
        spec: TableSpec | str,
        *,
        windows: Windows,
        batch_size: int,
        last: Last = "keep_partial",
        policy: Policy | str = stripe,
        rank: int | None = None,
        world_size: int | None = None,
        collate: Callable[[pa.RecordBatch], Any] | None = to_torch,
        read_ahead: int = DEFAULT_READ_AHEAD,
        storage_options: Mapping[str, Any] | None = None,
        columns: Sequence[str] | None = None,
        filter: Any = None,
    ) -> None:
        if not isinstance(windows, Windows):
            raise TypeError(f"windows must be a Windows value, not {windows!r}")
        check_positive("batch_size", batch_size)
        if last not in LAST_MODES:
            raise ValueError(f"last must be one of {LAST_MODES}, not {last!r}")
        table_spec = with_selection(as_spec(spec, storage_options), columns, filter)
        if table_spec.media:
            raise ValueError("WindowDataset does not decode media projections; window a table of decoded columns")
        group_by = windows.group_by
        if group_by is not None and table_spec.columns is not None and group_by not in table_spec.columns:
            raise ValueError(
                f"the group column {group_by!r} is not among the columns {list(table_spec.columns)} of "
                f"{table_spec.uri!r}; select it too"
            )
        # The table dataset pins the version and gives the consumer, its work list, the opened
        # source and the reader (read ahead or not); its own iteration is not used.
        self.table = TableDataset(
            table_spec, policy=policy, rank=rank, world_size=world_size, collate=None, read_ahead=read_ahead
        )
        self.windows = windows
        self.batch_size = batch_size
        self.last: Last = last
        self.collate = collate
        self._work: str | None = None
        self._position: WindowPosition | None = None
        self._resume: tuple[State, int] | None = None
        self._remainder: Remainder | None = None
        self._remainder_epoch = 0
        self._lineage: RowLineage | None = None

    @property
    def epoch(self) -> int:
        """The epoch whose work lists are read."""
        return self.table.epoch

    def loader(self, num_workers: int | None = None, **options: Any) -> StatefulDataLoader:
        """A ``StatefulDataLoader`` that reads this dataset as it must be read: its own batches
        as they are (``batch_size=None``), ``num_workers`` workers started by ``forkserver`` and
        persistent, as ``TableDataset.loader`` makes them; ``options`` go to the loader and
        override these."""
        self.table.check_shares(num_workers := workers_for(self, num_workers))
        return batch_loader(self, num_workers, options)

    def set_epoch(self, epoch: int) -> None:
        """Read ``epoch``'s work lists from now on."""
        self.table.set_epoch(epoch)

    def shard(self) -> Shard:
        """This process's consumer: this rank, and the DataLoader worker when in one."""
        return self.table.shard()

    def __len__(self) -> int:
        raise TypeError(
            "a WindowDataset has no length in windows without reading its rows' runs; batches(num_workers) "
            "counts its batches"
        )

    def batches(self, workers: int) -> int:
        """The exact batches this rank yields in this epoch through a DataLoader with ``workers``
        workers (0 reads in the main process): each consumer's windows, counted from its items'
        kept rows, or by reading the group column alone (``reading.windows.count_windows``)."""
        source = self._runs_source()
        consumers, total = max(1, workers), 0
        for worker in range(consumers):
            items, leads = self.work(Shard(self.table.rank, self.table.world_size, worker, consumers))
            found = count_windows(source, items, leads, self.windows)
            total += -(-found // self.batch_size) if self.last == "keep_partial" else found // self.batch_size
        return total

    def _runs_source(self) -> Source:
        """What a consumer's runs are found through: the table's source, or one of the group column alone."""
        group_by = self.windows.group_by
        return self.table.source() if group_by is None else open_source(replace(self.table.spec, columns=(group_by,)))

    def places(self, shard: Shard) -> WindowPlaces:
        """Where consumer ``shard``'s windows lie in its stream this epoch, found from its items'
        kept rows or its group column's runs (a step record's rows)."""
        items, leads = self.work(shard)
        return window_places(self._runs_source(), items, leads, self.windows)

    def work(self, shard: Shard | None = None) -> tuple[list[WorkItem], list[int]]:
        """The work list of ``shard`` (this process's consumer) in this epoch and each item's lead:
        the policy's (no leads), or its whole pieces of a remainder ``load_elastic`` re-planned."""
        shard = shard or self.shard()
        remainder = self._replanned()
        if remainder is None:
            return self.table.work(shard), []
        return share_of(remainder, stripe, shard)

    def _replanned(self) -> Remainder | None:
        """The remainder ``load_elastic`` re-planned, while its epoch lasts."""
        return self._remainder if self._remainder_epoch == self.epoch else None

    def load_elastic(self, states: Sequence[Mapping[str, Any]], lineage: Mapping[str, Any] | None = None) -> None:
        """Continue an epoch saved by every consumer of another topology (other world size or
        worker count): the windows none of them delivered are shared among this dataset's
        consumers in whole pieces, each exactly once, and later epochs plan as usual. ``states``
        holds every saved consumer's ``state_dict``; when they continue an epoch re-planned
        before, ``lineage`` is the ``lineage()`` saved beside them. ``ValueError`` when they are
        not one epoch of one version, policy and windows."""
        parsed = [self._parsed(state) for state in states]
        saved = [table for table, _ in parsed]
        version = self.table.spec.version
        if saved and saved[0].version != version:
            raise ValueError(f"the states were saved reading version {saved[0].version}, not {version}")
        earlier = None if lineage is None else RowLineage.from_dict(lineage)
        found, remainder = replan(
            self.table.source(),
            self.table.policy,
            saved,
            earlier,
            filtered=self.table.spec.filter is not None,
            share=stripe,
            leads=[lead for _, lead in parsed],
        )
        self.table.set_epoch(saved[0].epoch)
        self._remainder = remainder
        self._remainder_epoch = saved[0].epoch
        self._lineage = found
        # The re-planned list is unread: a state saved before the next pass is at its start.
        self._resume = self._position = self._work = None

    def lineage(self) -> dict[str, Any] | None:
        """While this epoch continues a re-plan, what makes its remainder again (see
        ``spiral_lightning.elastic``), as plain values: save it once beside every consumer's
        ``state_dict`` and give both to ``load_elastic``. ``None`` in an epoch planned as usual."""
        if self._replanned() is None or self._lineage is None:
            return None
        return self._lineage.to_dict()

    def _state(self, shard: Shard) -> State:
        return State(
            version=self.table.version,
            shard=shard,
            batch_size=self.batch_size,
            epoch=self.epoch,
            policy=policy_name(self.table.policy),
            work=self._work,
            cursor=None if self._position is None else self._position.cursor,
            remainder=None if self._replanned() is None or self._lineage is None else self._lineage.digest,
        )

    def state_dict(self) -> dict[str, Any]:
        """This consumer's next window and the settings it is valid for, as plain values."""
        if self._resume is not None:
            table, lead = self._resume
        else:
            table, lead = self._state(self.shard()), 0 if self._position is None else self._position.lead
        return integrity.sealed(
            {"format": WINDOWS_FORMAT, "table": table.to_dict(), "windows": self.windows.settings(), "lead": lead}
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state saved by a dataset over the same version, consumer, batch size,
        policy and windows; ``ValueError`` naming what differs otherwise (another topology is
        ``load_elastic``'s)."""
        saved, lead = self._parsed(state, check_digest=False)
        check_same_topology("WindowDataset", saved.shard, self.shard())
        saved.check_matches(self._state(self.shard()))
        check_lineage("WindowDataset", saved, self._lineage, self._remainder_epoch)
        self.table.set_epoch(saved.epoch)
        self.table.check_loaded("WindowDataset", saved, self.work()[0], windows=False, rows=False, paired=False)
        integrity.check_digest(state, "WindowDataset", saved.where())
        self._resume = (saved, lead)

    def _parsed(self, state: Mapping[str, Any], check_digest: bool = True) -> tuple[State, int]:
        """The table state and lead of a ``state_dict``; ``ValueError``, ``TypeError`` or
        ``KeyError`` naming the field when it is not one of these windows, and ``ValueError`` for
        one edited or damaged (``check_digest=False`` leaves the digests to the caller)."""
        check_saved(state, "WindowDataset", WINDOWS_FORMAT, ("table", "windows", "lead"))
        if check_digest:
            integrity.check_digest(state, "WindowDataset")
        saved_windows = state["windows"]
        if saved_windows != self.windows.settings():
            if not integrity.intact(state):
                raise integrity.damaged("WindowDataset", found=f"windows: saved {saved_windows!r}")
            raise ValueError(
                f"the WindowDataset state's windows: saved {saved_windows!r}, now {self.windows.settings()!r}; "
                "restore it into a dataset with the same windows"
            )
        lead = check_count("the WindowDataset state's lead", state["lead"])
        return State.from_dict(state["table"], check_digest=check_digest), lead

    def __iter__(self) -> Iterator[Any]:
        source = self.table.source()
        group_by = self.windows.group_by
        if group_by is not None and group_by not in source.schema.names:
            raise ValueError(f"the group column {group_by!r} is not a column of {self.table.spec.uri!r}")
        shard = self.shard()
        items, leads = self.work(shard)
        work = fingerprint(items)
        resume, self._resume = self._resume, None
        position = WindowPosition(start_of(items), leads[0] if leads else 0)
        self._position = None
        saved, lead = resume if resume is not None else (None, 0)
        if saved is not None and saved.cursor is not None:
            self.table.check_resume("WindowDataset", saved, shard, work, items)
            position = self._position = WindowPosition(saved.cursor, lead)
        self._work = work
        # The spec's nulls decide what its numeric columns' nulls become, as in TableDataset.
        spec = self.table.spec
        filled = partial(to_torch, nulls=Nulls(spec.null_fill, spec.null_mask), padded=spec.padded)
        collate = filled if self.collate is to_torch else self.collate
        for batch, after in read_windows(
            self.table.reader(), items, position, self.windows, self.batch_size, self.last, leads
        ):
            self._position = after
            yield batch if collate is None else handed_on(stack(collate(batch), self.windows.size))
