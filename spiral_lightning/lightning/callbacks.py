"""The callbacks a SpiralDataModule adds to every fit."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

from spiral_lightning.lightning.checkpoint import CheckpointPosition
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
