"""spiral-lightning: exact, resumable training data from tables into PyTorch, Lightning and Ray."""

from spiral_lightning.datamodule import SpiralDataModule
from spiral_lightning.dataset import TableDataset
from spiral_lightning.loader import SpiralLoader
from spiral_lightning.spec import TableSpec
from spiral_lightning.state import Cursor, State
from spiral_lightning.tensors import to_torch
from spiral_lightning.work import Policy, Shard, Split, WorkItem, balanced, stripe
from spiral_lightning.write import write_table

__all__ = [
    "Cursor",
    "Policy",
    "Shard",
    "SpiralDataModule",
    "SpiralLoader",
    "Split",
    "State",
    "TableDataset",
    "TableSpec",
    "WorkItem",
    "balanced",
    "stripe",
    "to_torch",
    "write_table",
]
