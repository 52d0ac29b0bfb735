"""SpiralDataModule training on windows of consecutive rows: the batches of the WindowDataset it
makes, counted ahead so the epoch has its length, resumed mid-epoch from a checkpoint and under
another worker count, every window once."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from spiral_lightning import SpiralDataModule, TableSpec, WindowDataset, Windows
from tests.tables import write_uneven
from tests.test_datamodule import checkpoints, trainer
from tests.test_windows import episode_table

SIZES = [300, 170, 410, 250]
WINDOWS = Windows(size=3, stride=2, group_by="episode")


class WindowRecorder(pl.LightningModule):
    """Trains a one-weight model on the windows' ``v`` and keeps each batch's windows as row ids."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.seen: list[tuple[int, list[tuple[int, ...]]]] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.seen.append((self.global_step, [tuple(window) for window in batch["id"].tolist()]))
        loss: torch.Tensor = self.layer(batch["v"]).pow(2).mean()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6)


def table(tmp_path: Path) -> TableSpec:
    spec = write_uneven(tmp_path / "episodes", episode_table(SIZES, seed=5), SIZES)
    return replace(spec, columns=("id", "episode", "v"))


def data(spec: TableSpec, workers: int = 0, **options: Any) -> SpiralDataModule:
    return SpiralDataModule(spec, windows=WINDOWS, batch_size=8, num_workers=workers, **options)


def test_windows_train_as_the_dataset_reads_them_and_resume_mid_epoch(tmp_path: Path) -> None:
    spec = table(tmp_path)
    whole = [[tuple(w) for w in batch["id"].tolist()] for batch in WindowDataset(spec, windows=WINDOWS, batch_size=8)]
    first = WindowRecorder()
    trainer(tmp_path, max_epochs=1, max_steps=7, callbacks=[checkpoints(tmp_path, 7)]).fit(first, datamodule=data(spec))
    assert [windows for _, windows in first.seen] == whole[:7]
    resumed = WindowRecorder()
    trainer(tmp_path, max_epochs=1).fit(resumed, datamodule=data(spec), ckpt_path=tmp_path / "step=7.ckpt")
    assert [windows for _, windows in resumed.seen] == whole[7:]
    assert [step for step, _ in resumed.seen] == list(range(7, len(whole)))


@pytest.mark.slow
def test_windows_resume_under_another_worker_count_every_window_once(tmp_path: Path) -> None:
    spec = table(tmp_path)
    every = sorted(
        tuple(w) for batch in WindowDataset(spec, windows=WINDOWS, batch_size=8) for w in batch["id"].tolist()
    )
    first = WindowRecorder()
    run = trainer(tmp_path, max_epochs=1, max_steps=6, callbacks=[checkpoints(tmp_path, 6)])
    run.fit(first, datamodule=data(spec, workers=2))
    resumed = WindowRecorder()
    trainer(tmp_path, max_epochs=1).fit(resumed, datamodule=data(spec), ckpt_path=tmp_path / "step=6.ckpt")
    delivered = [w for _, windows in first.seen + resumed.seen for w in windows]
    assert sorted(delivered) == every


def test_windows_refuse_what_they_cannot_train_with(tmp_path: Path) -> None:
    spec = table(tmp_path)
    with pytest.raises(ValueError, match="leave transform and shuffle at the default"):
        data(spec, transform=abs, shuffle=True)
    with pytest.raises(TypeError, match=r"windows must be a Windows\(size, stride, group_by\) value"):
        SpiralDataModule(spec, windows=3)  # type: ignore[arg-type]
