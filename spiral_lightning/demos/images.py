"""The image demo: a folder of synthetic JPEGs ingested into a table, its DataModule and a small
convolutional model, so ``configs/images.yaml`` trains on images that arrive as ready tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from spiral_lightning.core.media import Image
from spiral_lightning.core.spec import TableSpec
from spiral_lightning.demos.data import COLOURS, demo_image_folder
from spiral_lightning.lightning.datamodule import SpiralDataModule
from spiral_lightning.lightning.padding import VALID
from spiral_lightning.media.ingest import ingest_images

#: ``demo_image_folder`` lives in ``spiral_lightning.demos.data``; this path still works.
__all__ = ["COLOURS", "ImageDemoDataModule", "ImageDemoModel", "demo_image_folder"]


class ImageDemoModel(pl.LightningModule):
    """A small convolutional classifier of ``image`` tensors ``[B, 3, H, W]`` into ``label``s."""

    def __init__(self, classes: int = len(COLOURS), width: int = 16, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(width, classes),
        )
        self.lr = lr

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        scores: torch.Tensor = self.net(image)
        return scores

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self(batch["image"]), batch["label"])
        self.log("loss", loss, prog_bar=True, batch_size=len(batch["label"]))
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        # Only the valid rows count: a DDP rank with fewer batches pads with rows marked False.
        valid = batch[VALID].float()
        rows = int(valid.sum())
        right = (self(batch["image"]).argmax(dim=1) == batch["label"]).float()
        self.log("val_acc", (right * valid).sum() / max(rows, 1), prog_bar=True, batch_size=rows, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class ImageDemoDataModule(SpiralDataModule):
    """The ingested image table at ``table`` (a local Spiral table, or ``parquet:`` folder),
    made by ``prepare_data`` from the synthetic folder ``folder`` when missing. Images arrive
    resized to ``size`` (height, width) as ``[B, 3, H, W]`` float32 in ``[0, 1]``; files named
    ``val-*`` validate. Other arguments are ``SpiralDataModule``'s."""

    def __init__(
        self,
        folder: str = "data/demo-images/folder",
        table: str = "data/demo-images/table",
        size: tuple[int, int] = (32, 32),
        **options: Any,
    ) -> None:
        uri = table if ":" in table else f"spiral:{table}"
        image = Image("image", size=size, layout="CHW", dtype="float32", normalize="unit")
        columns = ("label", "image")
        super().__init__(
            train=TableSpec(uri, columns=columns, filter="path LIKE '%/train-%'", media=(image,)),
            val=TableSpec(uri, columns=columns, filter="path LIKE '%/val-%'", media=(image,)),
            **options,
        )
        self.folder = folder
        self.uri = uri

    def prepare_data(self) -> None:
        root = Path(self.uri.split(":", 1)[1])
        if root.is_dir() and any(root.iterdir()):
            return
        demo_image_folder(self.folder)
        ingest_images(self.folder, self.uri, split_rows=128, progress=False)
