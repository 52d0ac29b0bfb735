"""spiral-lightning: exact, resumable training data from tables into PyTorch, Lightning and Ray."""

from typing import TYPE_CHECKING, Any

from spiral_lightning.dataset import TableDataset
from spiral_lightning.loader import SpiralLoader
from spiral_lightning.mapstyle import TableMapDataset
from spiral_lightning.media import FrameIndices, FrameNeighborhood, FrameSlice, FrameTimes, Image, Video
from spiral_lightning.mixture import Mixture
from spiral_lightning.packing import PackedDataset, Packing
from spiral_lightning.sequences import Padded, TooLong
from spiral_lightning.spec import TableSpec
from spiral_lightning.state import Cursor, State
from spiral_lightning.tensors import NullError, Nulls, to_torch
from spiral_lightning.transfer import send_by_name
from spiral_lightning.windows import WindowDataset, Windows
from spiral_lightning.work import Policy, Shard, Shuffled, Split, WorkItem, balanced, stripe
from spiral_lightning.write import write_table

if TYPE_CHECKING:
    from spiral_lightning.datamodule import SpiralDataModule

__all__ = [
    "Cursor",
    "FrameIndices",
    "FrameNeighborhood",
    "FrameSlice",
    "FrameTimes",
    "Image",
    "Mixture",
    "NullError",
    "Nulls",
    "PackedDataset",
    "Packing",
    "Padded",
    "Policy",
    "Shard",
    "Shuffled",
    "SpiralDataModule",
    "SpiralLoader",
    "Split",
    "State",
    "TableDataset",
    "TableMapDataset",
    "TableSpec",
    "TooLong",
    "Video",
    "WindowDataset",
    "Windows",
    "WorkItem",
    "balanced",
    "send_by_name",
    "stripe",
    "to_torch",
    "write_table",
]


def __getattr__(name: str) -> Any:
    # Lightning takes seconds to import; DataLoader workers import this package to unpickle a
    # dataset and never need it, so the DataModule loads on first use.
    if name == "SpiralDataModule":
        from spiral_lightning.datamodule import SpiralDataModule

        return SpiralDataModule
    raise AttributeError(f"module 'spiral_lightning' has no attribute {name!r}")
