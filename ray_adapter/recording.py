"""The step record of a Ray Train loop: ``train_loader(..., record=folder)`` notes the stored rows
of each batch a rank reads (see ``spiral_lightning.record``), numbering the rank's batches since the
run began as its steps; ``save_loader_state`` and each epoch's end write what was noted, and the
rank's state file keeps the step."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from spiral_lightning.core.storage import StorageOptions
from spiral_lightning.datasets.record import StepRecord, check_recordable
from spiral_lightning.datasets.table import TableDataset
from spiral_lightning.lightning.loader import consumer_states


class Recording:
    """What one rank's loader records: into ``folder`` (a path or an object-store uri reached with
    ``options``) for ``dataset`` of rank ``rank``, ``step`` the step of its next batch, and the
    consumer states a restored position continues from.

        recording = Recording("runs/record", dataset, rank=0)
        batches = recording.noted(loader, iter(loader))
    """

    def __init__(self, folder: str, dataset: Any, rank: int, options: StorageOptions | None = None) -> None:
        check_recordable(dataset, folder, options)
        self.folder, self.dataset, self.rank, self.options = folder, dataset, rank, options
        self.step = 0
        self.record: StepRecord | None = None
        self._restored: list[dict[str, Any]] = []

    def restore(self, step: int, states: Sequence[Mapping[str, Any]]) -> None:
        """Continue at ``step``, the loader's consumers at ``states`` (none after a re-plan)."""
        self.step, self._restored = step, [dict(state) for state in states]
        self.record = None

    def noted(self, loader: Any, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches`` (an iteration of ``loader``), each noted at its step as it is handed on."""
        if self.record is None:
            self.record = StepRecord(self.folder, self.dataset, self.rank, self.step, self.options)
        self.record.begin(self._restored)
        self._restored = []
        # In process the dataset's own state, unsealed, as the DataModule's loader notes it.
        own = loader.num_workers == 0 and type(self.dataset) is TableDataset
        for batch in batches:
            states = [self.dataset.state_of(self.dataset.shard())] if own else consumer_states(loader.state_dict())
            self.record.note(self.step, states)
            self.step += 1
            yield batch
        # An epoch read to its end: its notes are written even if the loop saves no state after it.
        self.flush()

    def flush(self) -> None:
        """Write what was noted since the last write."""
        if self.record is not None:
            self.record.flush()
