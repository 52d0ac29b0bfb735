"""A SpiralDataModule's position is found in a Lightning checkpoint whatever the DataModule class
is called (Lightning files it under the class's name), and a fit that resumes mid-epoch from a
checkpoint holding none is refused rather than training rows twice: through a real Trainer,
comparing the row ids the model saw with an uninterrupted epoch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from spiral_lightning import SpiralDataModule, TableSpec
from spiral_lightning.core.integrity import DIGEST
from spiral_lightning.demos.data import demo_table
from spiral_lightning.lightning.checkpoint import CHECKPOINT_KEY

#: 400 rows in splits of 100, read in batches of 50: 8 batches an epoch, saved after 3.
ROWS, BATCH, SAVED_AT = 400, 50, 3


class Seen(pl.LightningModule):
    """Keeps the ids of every training batch; trains nothing (a weight with no effect)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[int]] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.seen.append(batch["id"].tolist())
        return (self.weight * batch["id"].float().mean()).pow(2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class SavedBy(SpiralDataModule):
    """The project's DataModule, as a user subclasses it."""


class ResumedBy(SpiralDataModule):
    """The same DataModule under another name: a subclass, or the class renamed between runs."""


def trainer(root: Path, **options: Any) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=root,
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        num_sanity_val_steps=0,
        **options,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TableSpec, Path, list[int]]]:
    """The demo table, a checkpoint saved by ``SavedBy`` 3 batches into the epoch, and the ids
    the model saw before it."""
    root = tmp_path_factory.mktemp("checkpoint-key")
    spec = demo_table(root / "table", rows=ROWS, split_rows=100)
    model = Seen()
    every = ModelCheckpoint(root / "checkpoints", "{step}", every_n_train_steps=SAVED_AT, save_top_k=-1)
    trainer(root, max_steps=SAVED_AT, callbacks=[every]).fit(model, datamodule=SavedBy(spec, batch_size=BATCH))
    yield spec, root / "checkpoints" / f"step={SAVED_AT}.ckpt", [i for ids in model.seen for i in ids]


def resumed(spec: TableSpec, checkpoint: Path, root: Path, **options: Any) -> list[int]:
    """The ids a model sees fitting the rest of the epoch from ``checkpoint`` under ``ResumedBy``."""
    model = Seen()
    data = ResumedBy(spec, batch_size=BATCH, **options)
    trainer(root).fit(model, datamodule=data, ckpt_path=checkpoint)
    return [i for ids in model.seen for i in ids]


def rewritten(checkpoint: Path, folder: Path, **changes: Any) -> Path:
    """A copy of ``checkpoint`` with the given top-level entries replaced (``None``: deleted)."""
    content = torch.load(checkpoint, weights_only=True)
    for key, value in changes.items():
        content.pop(key, None)
        if value is not None:
            content[key] = value
    path = folder / "rewritten.ckpt"
    torch.save(content, path)
    return path


def test_the_entry_is_filed_under_the_class_name_and_a_stable_key(saved: tuple[TableSpec, Path, list[int]]) -> None:
    content = torch.load(saved[1], weights_only=True)
    assert content["SavedBy"] == content[CHECKPOINT_KEY]
    assert content[CHECKPOINT_KEY]["kind"] == "spiral_lightning.SpiralDataModule"
    assert DIGEST in content[CHECKPOINT_KEY]


def test_a_checkpoint_resumes_exactly_under_another_class_name(
    saved: tuple[TableSpec, Path, list[int]], tmp_path: Path
) -> None:
    spec, checkpoint, before = saved
    assert before + resumed(spec, checkpoint, tmp_path) == list(range(ROWS))


def test_an_entry_saved_before_the_stable_key_is_found_under_any_class_name(
    saved: tuple[TableSpec, Path, list[int]], tmp_path: Path
) -> None:
    spec, checkpoint, before = saved
    content = torch.load(checkpoint, weights_only=True)
    # As an earlier spiral-lightning wrote it: under its class's name only, with no kind or digest.
    old = {key: value for key, value in content["SavedBy"].items() if key not in ("kind", DIGEST)}
    path = rewritten(checkpoint, tmp_path, SavedBy=None, **{CHECKPOINT_KEY: None, "RenamedSince": old})
    assert before + resumed(spec, path, tmp_path) == list(range(ROWS))


def test_a_mid_epoch_resume_without_a_position_is_refused(
    saved: tuple[TableSpec, Path, list[int]], tmp_path: Path
) -> None:
    spec, checkpoint, _ = saved
    path = rewritten(checkpoint, tmp_path, SavedBy=None, **{CHECKPOINT_KEY: None})
    with pytest.raises(ValueError, match=r"inside epoch 0, after 3 batches, but holds no SpiralDataModule position"):
        resumed(spec, path, tmp_path)
    # Asked for on purpose, the epoch's data starts again while the fit loop continues at batch 3.
    again = resumed(spec, path, tmp_path, missing_position="restart_epoch")
    assert again == list(range((ROWS // BATCH - SAVED_AT) * BATCH))


def test_an_edited_entry_is_refused_when_the_checkpoint_loads(
    saved: tuple[TableSpec, Path, list[int]], tmp_path: Path
) -> None:
    spec, checkpoint, _ = saved
    content = torch.load(checkpoint, weights_only=True)
    entry = content[CHECKPOINT_KEY]
    entry["ranks"][0]["position"]["batches"] = 1
    path = rewritten(checkpoint, tmp_path, SavedBy=entry, **{CHECKPOINT_KEY: entry})
    with pytest.raises(ValueError, match="the SpiralDataModule state of the checkpoint entry was edited or damaged"):
        resumed(spec, path, tmp_path)
