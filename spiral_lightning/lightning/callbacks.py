"""The callbacks a SpiralDataModule adds to every fit."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl

from spiral_lightning.lightning.checkpoint import CHECKPOINT_KEY, ENTRY_KIND, find_entry, mid_epoch
from spiral_lightning.lightning.stall import DataStallMeter


def add_fit_callbacks(trainer: Any, stall_meter: bool) -> None:
    """Add to ``trainer`` what a SpiralDataModule's fit needs, unless given: a ``DataStallMeter``
    (with ``stall_meter``) and the ``CheckpointPosition`` that finds this DataModule's position in
    a checkpoint whatever its class is called."""
    callbacks: list[pl.Callback] = trainer.callbacks
    if stall_meter and not any(isinstance(callback, DataStallMeter) for callback in callbacks):
        callbacks.append(DataStallMeter())
    if not any(isinstance(callback, CheckpointPosition) for callback in callbacks):
        callbacks.append(CheckpointPosition())


class CheckpointPosition(pl.Callback):
    """Files the SpiralDataModule entry under ``CHECKPOINT_KEY`` too, and on resume restores it
    when Lightning did not (a checkpoint saved by a DataModule class of another name); refuses a
    fit that resumes mid-epoch with no entry (see ``missing_position``)."""

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        running: Any = trainer  # Lightning sets the DataModule on the Trainer at run time.
        entry = checkpoint.get(type(running.datamodule).__qualname__)
        if isinstance(entry, Mapping) and entry.get("kind") == ENTRY_KIND:
            checkpoint[CHECKPOINT_KEY] = entry

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        running: Any = trainer
        datamodule = running.datamodule
        # Lightning restored the entry filed under the class's own name before calling this.
        if trainer.state.fn != "fit" or not hasattr(datamodule, "missing_position") or datamodule.position_loaded:
            return
        entry = find_entry(checkpoint)
        if entry is not None:
            datamodule.load_state_dict(entry)
            return
        stopped = mid_epoch(checkpoint)
        if stopped is None or datamodule.missing_position == "restart_epoch":
            return
        epoch, batches = stopped
        raise ValueError(
            f"the checkpoint resumes training inside epoch {epoch}, after {batches} batches, but holds no "
            f"SpiralDataModule position (its entries: {sorted(str(key) for key in checkpoint)}): the data would "
            "start the epoch again while the model continues it, training rows twice and others never. Resume "
            f"from a checkpoint the SpiralDataModule saved a position in (under its class name or {CHECKPOINT_KEY!r}), "
            "or, to read the epoch from its start on purpose, pass SpiralDataModule(missing_position='restart_epoch')"
        )
