"""DataStallMeter: a Lightning callback that logs how long each training step waited for its
batch, with any loader, and warns once when the model keeps idling on data."""

from __future__ import annotations

import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch

from spiral_lightning.datasets.stall import STALL_SHARE, STALL_STEPS, StallMeter, loader_settings, rows_of


class DataStallMeter(pl.Callback):
    """Logs, per rank and per training step, ``data/wait_ms`` (the time from the end of one
    step to the start of the next: the wait for the batch), ``data/wait_share`` (that wait over
    the whole step) and ``data/rows_per_s``; warns once, naming the loader's settings, when
    ``steps`` steps in a row each waited more than ``share`` of their time.

        trainer = lightning.Trainer(callbacks=[DataStallMeter()])
        trainer.fit(model, datamodule=data)
        print(trainer.callback_metrics["data/wait_share"])

    ``SpiralDataModule`` adds one by itself (``stall_meter=True``). Validation between two steps
    is not counted as waiting; a checkpoint saved between them is, as the model idles through it.
    Each rank logs its own values (loggers write rank 0's, as for any metric not synced).
    """

    def __init__(self, share: float = STALL_SHARE, steps: int = STALL_STEPS) -> None:
        self.meter = StallMeter(share, steps)
        self._asked = 0.0
        self._got = 0.0
        self._steps = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._asked = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._asked = time.perf_counter()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._got = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        self.meter.record(self._got - self._asked, now - self._asked, rows_of(batch))
        self._steps += 1
        every: int = trainer.log_every_n_steps  # type: ignore[attr-defined]  # set by Lightning at run time
        written = bool(every) and self._steps % every == 0
        if trainer.is_last_batch or written:
            self._log(trainer, written)
        if self.meter.stalled:
            data = trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning at run time
            source = data if hasattr(data, "read_threads") else trainer.train_dataloader
            warnings.warn(self.meter.advice(loader_settings(source), f"rank {trainer.global_rank}: "), stacklevel=2)
        # The next step's wait starts after this one's logging, which the loop would do anyway.
        self._asked = time.perf_counter()

    def _log(self, trainer: pl.Trainer, written: bool) -> None:
        """The means since the last call into ``trainer.callback_metrics``, and when ``written``
        into the loggers at the step Lightning's own metrics take. Not ``LightningModule.log``: it
        builds a metric object for each new key of an epoch (a millisecond or more each, measured
        by benchmarks/lightning_overhead.py), which is what ``LearningRateMonitor`` avoids too."""
        metrics = self.meter.metrics()
        trainer.callback_metrics.update({name: torch.tensor(value) for name, value in metrics.items()})
        if written:
            step = trainer.fit_loop.epoch_loop._batches_that_stepped
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)
