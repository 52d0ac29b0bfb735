"""spiral-lightning: exact, resumable training data from tables into PyTorch, Lightning and Ray.

The names below are what users build; each loads its module on first use, so importing the
package (as every DataLoader worker does) loads neither Lightning, PyAV, Pillow nor sqlglot.
The layout, bottom up: ``core`` (values), ``sources`` (backends), ``planning`` (work lists),
``reading`` (a consumer's pass), ``media`` (decoding), ``datasets``, ``lightning``, ``demos``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from spiral_lightning import _moved

if TYPE_CHECKING:
    from spiral_lightning.core.media import FrameIndices, FrameNeighborhood, FrameSlice, FrameTimes, Image, Video
    from spiral_lightning.core.plan import Policy, Shard, Split, WorkItem
    from spiral_lightning.core.sequences import Padded, TooLong
    from spiral_lightning.core.spec import TableSpec
    from spiral_lightning.core.state import Cursor, State
    from spiral_lightning.datasets.mapstyle import TableMapDataset
    from spiral_lightning.datasets.mixture import Mixture
    from spiral_lightning.datasets.packing import PackedDataset
    from spiral_lightning.datasets.stall import StallMeter
    from spiral_lightning.datasets.table import TableDataset
    from spiral_lightning.datasets.windows import WindowDataset, Windows
    from spiral_lightning.lightning.datamodule import SpiralDataModule
    from spiral_lightning.lightning.loader import SpiralLoader
    from spiral_lightning.lightning.stall import DataStallMeter
    from spiral_lightning.planning.policies import Shuffled, balanced, stripe
    from spiral_lightning.reading.packing import Packing
    from spiral_lightning.reading.tensors import NullError, Nulls, to_torch
    from spiral_lightning.reading.transfer import send_by_name
    from spiral_lightning.sources.write import write_table

#: Each public name and the module that defines it.
_HOMES = {
    "Cursor": "core.state",
    "DataStallMeter": "lightning.stall",
    "FrameIndices": "core.media",
    "FrameNeighborhood": "core.media",
    "FrameSlice": "core.media",
    "FrameTimes": "core.media",
    "Image": "core.media",
    "Mixture": "datasets.mixture",
    "NullError": "reading.tensors",
    "Nulls": "reading.tensors",
    "PackedDataset": "datasets.packing",
    "Packing": "reading.packing",
    "Padded": "core.sequences",
    "Policy": "core.plan",
    "Shard": "core.plan",
    "Shuffled": "planning.policies",
    "SpiralDataModule": "lightning.datamodule",
    "SpiralLoader": "lightning.loader",
    "Split": "core.plan",
    "StallMeter": "datasets.stall",
    "State": "core.state",
    "TableDataset": "datasets.table",
    "TableMapDataset": "datasets.mapstyle",
    "TableSpec": "core.spec",
    "TooLong": "core.sequences",
    "Video": "core.media",
    "WindowDataset": "datasets.windows",
    "Windows": "datasets.windows",
    "WorkItem": "core.plan",
    "balanced": "planning.policies",
    "send_by_name": "reading.transfer",
    "stripe": "planning.policies",
    "to_torch": "reading.tensors",
    "write_table": "sources.write",
}

__all__ = [
    "Cursor",
    "DataStallMeter",
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
    "StallMeter",
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

_moved.install()


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'spiral_lightning' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"spiral_lightning.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
