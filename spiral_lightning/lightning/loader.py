"""SpiralLoader: the StatefulDataLoader a SpiralDataModule hands to Lightning.

It reports its length in batches, follows the Trainer's epoch, pads an evaluation rank up to
the batch count of the rank with the most, and keeps its position out of Lightning's own loop
state, which holds rank 0's loader state only and would give it to every rank on resume. The
DataModule saves and restores each rank's real position instead.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

from spiral_lightning.core.integrity import dataset_states
from spiral_lightning.datasets.groups import group_size
from spiral_lightning.datasets.loader import Loader, warm_for, without_set_vital_warning
from spiral_lightning.datasets.mapstyle import TableMapDataset
from spiral_lightning.datasets.mixture import Mixture
from spiral_lightning.datasets.record import StepRecord
from spiral_lightning.datasets.table import TableDataset
from spiral_lightning.datasets.token_batches import TokenBatchDataset
from spiral_lightning.datasets.windows import WindowDataset
from spiral_lightning.lightning.skips import StepSkips
from spiral_lightning.planning.elastic_map import ReplannedSampler

#: What the loader gives Lightning's fit loop in place of a position: a marker that names where
#: the real positions live, so a checkpoint never holds one rank's position as if it were all.
LOOP_STATE = {"spiral_lightning": "every rank's position is in the SpiralDataModule entry of this checkpoint"}


def consumer_states(loader_state: Mapping[str, Any], where: str = "") -> list[dict[str, Any]]:
    """Every consumer's ``TableDataset`` state inside a ``StatefulDataLoader`` state: the main
    process's when the loader read without workers, else each worker's in worker order;
    ``ValueError`` naming the worker (and ``where``, such as a rank) when one is missing."""
    return [dict(state) for state in dataset_states(loader_state, where)]


class Position(NamedTuple):
    """One rank's place in training: ``batches`` of epoch ``epoch`` delivered, and ``loader``,
    torchdata's loader state with every worker's cursor."""

    epoch: int
    batches: int
    loader: dict[str, Any]


class SpiralLoader(Loader):
    """A ``StatefulDataLoader(dataset, batch_size=None)`` over a ``TableDataset``, a ``Mixture`` or
    a ``WindowDataset``, or with a ``batch_size`` and a stateful sampler over a ``TableMapDataset``.

    ``len`` is ``batches``, the exact batches of this rank in the epoch, so Lightning counts the
    epoch, its progress bar and its limits in batches rather than rows. ``epoch`` (when given)
    returns the epoch to read; before each iteration the loader asks ``prepare`` to set the
    dataset up for that epoch, and ``prepare`` returns the epoch's batches, which must equal
    ``batches`` because Lightning fixed the epoch's length when it first asked.

    ``position`` / ``restore`` are this rank's real state (a ``Position``; ``continue_replanned``
    for an epoch re-planned under another topology), while
    ``state_dict`` / ``load_state_dict``, which Lightning's fit loop calls, only write and accept
    ``LOOP_STATE``. A restored position continues its epoch when the loader next reads that
    epoch. A finished one (saved after the epoch's last batch) makes the next read start the
    following epoch: Lightning resumes there, and reads it from the iterator it made while its
    epoch counter still named the finished epoch.

    ``pad`` (an evaluation loader's padding batch, see ``padding``) follows the dataset's own
    batches, a fresh copy each time, until the loader has yielded ``batches``: the count of the
    rank with the most, so that every rank of a DDP evaluation steps the same number of times.

    ``skips`` leaves out the batches of some training steps (see ``skips.StepSkips``): ``step``
    returns the step the next batch is trained in, and ``skipped`` counts the steps left out
    before this loader, so that the step a batch had in the rolled-back run is ``step() +
    skipped``. The batches left out are read and dropped, counted in the position, and not in
    ``len``, so every rank trains the same number of batches. ``recording`` makes the rank's
    ``StepRecord`` when the loader first reads (given the step of its first batch), which notes
    every batch's stored rows under that numbering, skipped ones marked.
    """

    def __init__(
        self,
        dataset: TableDataset | TableMapDataset | Mixture | WindowDataset | TokenBatchDataset,
        *,
        batches: int,
        epoch: Callable[[], int] | None = None,
        prepare: Callable[[int], int] | None = None,
        batch_size: int | None = None,
        pad: dict[str, Any] | None = None,
        skips: StepSkips | None = None,
        step: Callable[[], int] | None = None,
        skipped: int = 0,
        recording: Callable[[int], StepRecord] | None = None,
        **options: Any,
    ) -> None:
        if options.get("num_workers") and options.get("multiprocessing_context") == "forkserver":
            warm_for(dataset)
        group = group_size(dataset) if batch_size is None else 1
        with without_set_vital_warning():
            super().__init__(dataset, batch_size=batch_size, group=group, **options)
        self.table = dataset
        self.batches = batches
        self._pad = pad
        self._epoch = epoch
        self._prepare = prepare
        self._pending: Position | None = None
        self._reading: int | None = None
        self._yielded = 0
        self._replanned: Position | None = None
        self._skips, self._step, self.skipped = skips, step, skipped
        self._left_out: tuple[int, int, list[range]] | None = None
        self._recording = recording
        self.record: StepRecord | None = None

    def __len__(self) -> int:
        return self.batches - sum(len(left) for left in self._left_out_of(*self._next_epoch()))

    def _epoch_now(self) -> int:
        """The epoch the Trainer (or the dataset) is in."""
        if self._epoch is not None:
            return self._epoch()
        return self.table.epoch if isinstance(self.table, TableDataset) else 0

    def _next_epoch(self) -> tuple[int, int]:
        """The epoch the next read reads and the batches of it delivered before."""
        epoch = self._epoch_now()
        pending = self._pending
        if pending is None or pending.epoch != epoch:
            return epoch, 0
        return (epoch + 1, 0) if pending.batches >= self.batches else (epoch, pending.batches)

    def _left_out_of(self, epoch: int, done: int) -> list[range]:
        """The batch indexes of ``epoch``, of which ``done`` were delivered, whose steps are skipped."""
        return self._steps_of(epoch, done)[1]

    def _steps_of(self, epoch: int, done: int) -> tuple[int, list[range]]:
        """The step of ``epoch``'s batch ``done`` (those before it delivered) and the batch indexes
        whose steps are skipped: found once per epoch, before its next batch, while ``step()``
        is that batch's step."""
        if self._left_out is None or self._left_out[0] != epoch:
            # Only skips and records number steps: without them there may be no Trainer to ask.
            step = self._step if self._skips is not None or self._recording is not None else None
            first = 0 if step is None else step() + self.skipped
            left_out = [] if self._skips is None else self._skips.left_out(first, done, self.batches)
            self._left_out = (epoch, first - done, left_out)
        return self._left_out[1] + done, self._left_out[2]

    def __iter__(self) -> Iterator[Any]:
        # Setting up runs on the first next(), not here: Lightning creates every iterator before
        # its loop, and an error raised while it creates them is hidden behind its own clean-up
        # error ("Please call `iter(combined_loader)` first"); raised from next() it is not.
        return self._read()

    def _read(self) -> Iterator[Any]:
        epoch = self._epoch_now()
        pending, self._pending = self._pending, None
        if pending is not None and pending.epoch == epoch and pending.batches > self.batches and pending.loader:
            raise ValueError(
                f"the checkpoint's position says {pending.batches} batches of epoch {epoch} were delivered, but the "
                f"epoch has {self.batches} on this rank; it was edited or damaged, or saved under other settings"
            )
        if pending is not None and pending.epoch == epoch and pending.batches >= self.batches:
            epoch, pending = epoch + 1, None
        if self._prepare is not None:
            replanned = self._replanned
            batches = self._prepare(epoch) + (replanned.batches if replanned and replanned.epoch == epoch else 0)
            if batches != self.batches:
                raise ValueError(
                    f"epoch {epoch} has {batches} batches on this rank, but the loader reported "
                    f"{self.batches} when Lightning sized the epoch; the policy's shares change with the epoch, "
                    "so set Trainer(reload_dataloaders_every_n_epochs=1)"
                )
        self._yielded = 0
        if pending is not None and pending.epoch == epoch:
            if pending.loader:
                super().load_state_dict(pending.loader)
            self._yielded = pending.batches
        self._reading = epoch
        first, left_out = self._steps_of(epoch, self._yielded)
        # The step of batch index i of this epoch is i + shift, as the rolled-back run numbered it.
        shift = first - self._yielded
        if self._recording is not None and self.record is None:
            self.record = self._recording(first)
        if self.record is not None:
            restored = pending.loader if pending is not None and pending.epoch == epoch else {}
            self.record.begin(consumer_states(restored) if restored else [])
        for batch in super().__iter__():
            self._yielded += 1
            skip = any(self._yielded - 1 in left for left in left_out)
            if self.record is not None and isinstance(self.sampler, ReplannedSampler):
                # Map access: the batch's rows are the sampler's next ones, counted from a re-plan's start.
                start = self._replanned.batches if self._replanned and self._replanned.epoch == epoch else 0
                index, size = self._yielded - 1 - start, int(self.batch_size or 0)
                rows = self.table.ranges(self.sampler.drawn()[index * size : (index + 1) * size])
                self.record.note_rows(self._yielded - 1 + shift, epoch, rows, skip)
            elif self.record is not None:
                # In process the dataset's own state, unsealed: torchdata's sealed copy costs four times as much.
                own = self.num_workers == 0 and type(self.table) is TableDataset
                states = [self.table.state()] if own else consumer_states(super().state_dict())
                self.record.note(self._yielded - 1 + shift, states, skip)
            if skip:
                self.skipped += 1
                continue
            yield batch
        if self._pad is not None:
            while self._yielded < self.batches:
                self._yielded += 1
                # A copy each time: a step that changes its batch in place must not change the next.
                yield copy.deepcopy(self._pad)

    def position(self) -> Position | None:
        """Where this loader is: ``None`` before it first reads."""
        if self._pending is not None:
            return self._pending
        if self._reading is None:
            return None
        return Position(self._reading, self._yielded, super().state_dict())

    def restore(self, position: Position) -> None:
        """Continue from ``position`` when next reading (see the class)."""
        self._pending = position

    def continue_replanned(self, epoch: int, batches: int) -> None:
        """Continue epoch ``epoch``, of which ``batches`` were delivered before a stop, from the
        dataset's re-planned remainder (``TableDataset.load_elastic``): the loader's length is
        then those batches plus the remainder's, as Lightning counts the epoch. Refused with
        skips: a re-planned epoch's batches are not those the skipped steps read."""
        if self._skips is not None:
            raise ValueError(
                "skip_steps leaves out the batches the rolled-back run read at those steps, which only a resume "
                "under that run's world size, num_workers and batch_size reads again; resume under them, or "
                "without skip_steps"
            )
        self._replanned = Position(epoch, batches, {})
        self._pending = self._replanned

    def state_dict(self) -> dict[str, Any]:
        return dict(LOOP_STATE)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict != LOOP_STATE:
            raise ValueError(
                "this checkpoint's fit-loop loader state was not written by a SpiralDataModule, so it "
                "may hold rank 0's position only; resume from a checkpoint saved with SpiralDataModule"
            )
