"""The demo: a small learnable classification task stored as an embedded local table, its
DataModule, and a model that learns it."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import spiral
import torch
import torch.nn.functional as F
from torch import nn

from spiral_lightning.core.spec import TableSpec
from spiral_lightning.demos.data import CLASSES, FEATURES, demo_data, demo_table
from spiral_lightning.lightning.datamodule import SpiralDataModule
from spiral_lightning.lightning.mixing import MixedTable
from spiral_lightning.lightning.padding import VALID

#: ``demo_data`` and ``demo_table`` live in ``spiral_lightning.demos.data``; these paths still work.
__all__ = ["CLASSES", "FEATURES", "DemoDataModule", "DemoModel", "MixedDemoDataModule", "demo_data", "demo_table"]


class DemoModel(pl.LightningModule):
    """A small network that learns the demo task: features in, class scores out.

    It logs ``loss`` on the progress bar while training and ``val_loss`` / ``val_acc`` while
    validating, so the falling loss shows that the rows arrive with their labels.
    """

    def __init__(self, hidden: int = 64, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES))
        self.lr = lr

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        scores: torch.Tensor = self.net(features)
        return scores

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self(batch["features"]), batch["label"])
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, torch.Tensor]:
        # VALID marks the rows of the table; padding rows (a DDP rank with fewer batches) are False.
        return {"id": batch["id"], "label": self(batch["features"]).argmax(dim=1), VALID: batch[VALID]}

    def _evaluate(self, batch: dict[str, Any], stage: str) -> None:
        # Sums over the valid rows and batch_size=rows: a padding batch adds nothing to the means.
        valid = batch[VALID].float()
        rows = int(valid.sum())
        scores = self(batch["features"])
        losses = F.cross_entropy(scores, batch["label"], reduction="none")
        right = (scores.argmax(dim=1) == batch["label"]).float()
        for name, values in (("loss", losses), ("acc", right)):
            mean = (values * valid).sum() / max(rows, 1)
            self.log(f"{stage}_{name}", mean, prog_bar=True, batch_size=rows, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class DemoDataModule(SpiralDataModule):
    """The demo table at ``root``, written there by ``prepare_data`` when missing: rows with
    ``id`` below ``val_from`` train, the rest validate and test. Other arguments are
    ``SpiralDataModule``'s."""

    def __init__(self, root: str = "data/demo", rows: int = 200_000, val_from: int = 180_000, **options: Any) -> None:
        uri = f"spiral:{root}"
        held_out = spiral.gte(spiral.column("id"), spiral.literal(val_from))
        super().__init__(
            train=TableSpec(uri, filter=spiral.lt(spiral.column("id"), spiral.literal(val_from))),
            val=TableSpec(uri, filter=held_out),
            test=TableSpec(uri, filter=held_out),
            predict=TableSpec(uri, filter=held_out),
            **options,
        )
        self.root = root
        self.rows = rows

    def prepare_data(self) -> None:
        demo_table(self.root, rows=self.rows)


class MixedDemoDataModule(SpiralDataModule):
    """A ``SpiralDataModule`` that trains on a mixture of ``train`` tables, as a config names
    them, each a local demo table written by ``prepare_data`` when missing (``rows`` rows for the
    first, a quarter of that for the others). Other arguments are ``SpiralDataModule``'s."""

    def __init__(self, train: list[MixedTable], rows: int = 40_000, **options: Any) -> None:
        super().__init__(train=train, **options)
        self.rows = rows

    def prepare_data(self) -> None:
        for index, (spec, _) in enumerate(self.mixture or ()):
            if spec.uri.startswith("spiral:"):
                demo_table(spec.uri.removeprefix("spiral:"), rows=self.rows if index == 0 else self.rows // 4)
