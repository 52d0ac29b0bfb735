"""The data-stall meter: a loop whose steps are slow shows a share near 0, a loop whose batches
are slow a share near 1 and one warning, through ``StallMeter.metered`` and through the
Lightning callback a SpiralDataModule adds."""

from __future__ import annotations

import csv
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from spiral_lightning import DataStallMeter, SpiralDataModule, StallMeter, TableDataset, TableSpec
from spiral_lightning.datasets.stall import StepWait, loader_settings, rows_of
from tests.test_datamodule import trainer

#: How long the slow part of a step sleeps: far above what a step of these tiny batches costs.
SLOW_S = 0.03


def test_a_stall_warns_once_after_its_run_of_steps() -> None:
    meter = StallMeter(share=0.2, steps=3)
    fired = []
    for _ in range(8):
        meter.record(0.5, 1.0, 10)
        fired.append(meter.stalled)
    assert fired == [False, False, True, False, False, False, False, False]
    assert meter.metrics() == {"data/wait_ms": 500.0, "data/wait_share": 0.5, "data/rows_per_s": 10.0}
    assert meter.metrics() == {}


def test_a_step_below_the_share_starts_the_run_again() -> None:
    meter = StallMeter(share=0.2, steps=3)
    shares = [0.5, 0.5, 0.1, 0.5, 0.5, 0.5]
    fired = []
    for share in shares:
        meter.record(share, 1.0, 1)
        fired.append(meter.stalled)
    assert fired == [False, False, False, False, False, True]


@pytest.mark.parametrize(
    ("share", "steps", "error"),
    [
        (0, 5, "share must be between 0 and 1, not 0"),
        (1, 5, "share must be between 0 and 1, not 1"),
        (0.2, 0, "steps must be a positive int, not 0"),
        (0.2, True, "steps must be a positive int, not True"),
    ],
)
def test_bad_settings_are_refused(share: float, steps: int, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        StallMeter(share, steps)


def test_rows_of_a_batch_is_its_first_dimension() -> None:
    assert rows_of({"id": torch.arange(7), "x": torch.zeros(7, 3)}) == 7
    assert rows_of((torch.zeros(4, 2), torch.zeros(4))) == 4
    assert rows_of({"text": ["a", "b"]}) == 2
    assert rows_of("not a batch") == 0
    # What a Mixture's collate may make: an Arrow batch, numpy columns, a list of rows.
    assert rows_of(pa.record_batch({"id": pa.array(range(5))})) == 5
    assert rows_of({"id": np.arange(6), "x": np.zeros((6, 2))}) == 6
    assert rows_of((np.zeros((3, 2)), np.zeros(3))) == 3
    assert rows_of([{"id": 0}, {"id": 1}]) == 2


def slow(items: int, seconds: float) -> Iterator[dict[str, torch.Tensor]]:
    for item in range(items):
        time.sleep(seconds)
        yield {"id": torch.full((8,), item)}


def test_metered_batches_show_where_the_loop_waits() -> None:
    fast_data = StallMeter(steps=5)
    for batch in fast_data.metered(slow(12, 0)):
        time.sleep(SLOW_S)
        assert batch["id"].shape == (8,)
    assert fast_data.metrics()["data/wait_share"] < 0.5

    slow_data = StallMeter(steps=5)
    with pytest.warns(UserWarning, match=r"the last 5 training steps each waited for their batch") as warned:
        delivered = [int(batch["id"][0]) for batch in slow_data.metered(slow(12, SLOW_S))]
    assert delivered == list(range(12))
    assert len(warned) == 1
    metrics = slow_data.metrics()
    assert metrics["data/wait_share"] > 0.5
    assert metrics["data/rows_per_s"] < 8 / SLOW_S


def slowed(batch: dict[str, Any]) -> dict[str, Any]:
    """A transform that makes every batch slow to arrive."""
    time.sleep(SLOW_S)
    return batch


def test_the_warning_names_the_settings_of_a_table_loader(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([64], columns=["id"])
    loader = TableDataset(spec, batch_size=8, read_threads=1, transform=slowed).loader(num_workers=0)
    assert loader_settings(loader) == {"num_workers": 0, "read_threads": 1, "read_ahead": 2, "batch_size": 8}
    meter = StallMeter(steps=2)
    with pytest.warns(UserWarning, match=r"num_workers=0, read_threads=1, read_ahead=2, batch_size=8"):
        assert sorted(i for batch in meter.metered(loader) for i in batch["id"].tolist()) == list(range(64))


class Recording(DataStallMeter):
    """The meter, keeping every step's times for the test to read."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.steps: list[StepWait] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        super().on_train_batch_end(trainer, pl_module, *args)
        assert self.meter.last is not None
        self.steps.append(self.meter.last)


class Sleeper(pl.LightningModule):
    """A one-weight model whose training step sleeps ``seconds``."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seconds = seconds

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        time.sleep(self.seconds)
        loss: torch.Tensor = self.layer(batch["x"][:, None]).pow(2).mean()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6)


def test_the_datamodule_logs_a_near_zero_share_when_the_model_is_slow(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    spec = make_table([160], columns=["id", "x"])
    run = trainer(tmp_path, max_epochs=1)
    run.fit(Sleeper(SLOW_S), datamodule=SpiralDataModule(spec, batch_size=8))
    (meter,) = [callback for callback in run.callbacks if isinstance(callback, DataStallMeter)]
    assert meter.meter.last is not None and meter.meter.last.rows == 8
    assert set(run.callback_metrics) >= {"data/wait_ms", "data/wait_share", "data/rows_per_s"}
    assert float(run.callback_metrics["data/wait_share"]) < 0.5


def test_a_slowed_source_shows_a_share_near_one_and_warns_once(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    spec = make_table([160], columns=["id", "x"])
    meter = Recording(steps=5)
    run = trainer(tmp_path, max_epochs=1, callbacks=[meter])
    data = SpiralDataModule(spec, batch_size=8, transform=slowed, num_workers=0)
    with pytest.warns(
        UserWarning, match=r"rank 0: the last 5 training steps .* num_workers=0, read_threads=None, read_ahead=2"
    ) as warned:
        run.fit(Sleeper(0), datamodule=data)
    assert len([warning for warning in warned if "training steps" in str(warning.message)]) == 1
    # The DataModule found the meter the Trainer had and added none.
    assert [callback for callback in run.callbacks if isinstance(callback, DataStallMeter)] == [meter]
    assert len(meter.steps) == 20
    assert statistics.median(step.share for step in meter.steps) > 0.5


def test_the_meter_can_be_left_out(make_table: Callable[..., TableSpec], tmp_path: Path) -> None:
    spec = make_table([16], columns=["id", "x"])
    run = trainer(tmp_path, max_epochs=1)
    run.fit(Sleeper(0), datamodule=SpiralDataModule(spec, batch_size=8, stall_meter=False))
    assert not [callback for callback in run.callbacks if isinstance(callback, DataStallMeter)]
    assert "data/wait_share" not in run.callback_metrics


def test_the_logger_gets_the_means_of_the_steps_since_its_last_write(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    spec = make_table([88], columns=["id", "x"])
    logger = CSVLogger(tmp_path, name="stall", version=0)
    run = trainer(tmp_path, max_epochs=1, logger=logger, log_every_n_steps=4)
    run.fit(Sleeper(0), datamodule=SpiralDataModule(spec, batch_size=8, num_workers=0))
    with open(Path(logger.log_dir) / "metrics.csv") as file:
        logged = [row for row in csv.DictReader(file) if row["data/wait_ms"]]
    # 11 steps, written at the Trainer's cadence of 4 (steps 3 and 7, counted from 0); the means of
    # the last three steps, logged at the epoch's last batch, reach callback_metrics.
    assert [int(row["step"]) for row in logged] == [3, 7]
    assert all(0 <= float(row["data/wait_share"]) <= 1 and float(row["data/rows_per_s"]) > 0 for row in logged)
    assert float(run.callback_metrics["data/wait_ms"]) not in {float(row["data/wait_ms"]) for row in logged}
