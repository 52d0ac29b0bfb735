"""spiral-lightning: exact, resumable training data from tables into PyTorch, Lightning and Ray.

    from spiral_lightning import TableDataset, write_table

    write_table("spiral:data/points", pa.table({"id": range(10_000)}), split_rows=1_000)
    dataset = TableDataset("spiral:data/points", batch_size=256, shuffle=True)
    loader = dataset.loader(num_workers=2)  # each worker reads only its own rows
    for batch in loader:  # {"id": torch.int64 [256]}, a new order every epoch
        ...
    state = loader.state_dict()  # a cursor: a new loader resumes there, nothing lost or repeated

``SpiralDataModule`` does the same for Lightning, ``spiral_lightning.ray`` for Ray; ``__all__``
lists what users build. Names load on first use: importing the package (as every DataLoader
worker does) loads neither Lightning, PyAV, Pillow nor sqlglot. The layout, bottom up: ``core``
(values), ``sources`` (backends), ``planning`` (work lists), ``reading`` (a consumer's pass),
``media`` (decoding), ``datasets``, ``lightning``, ``demos``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from spiral_lightning import _moved

if TYPE_CHECKING:
    from spiral_lightning.core.budget import TokenBudget
    from spiral_lightning.core.media import FrameIndices, FrameNeighborhood, FrameSlice, FrameTimes, Image, Video
    from spiral_lightning.core.plan import Policy as Policy
    from spiral_lightning.core.plan import Shard as Shard
    from spiral_lightning.core.plan import Split as Split
    from spiral_lightning.core.plan import WorkItem as WorkItem
    from spiral_lightning.core.sequences import Padded
    from spiral_lightning.core.sequences import TooLong as TooLong
    from spiral_lightning.core.spec import TableSpec
    from spiral_lightning.core.state import Cursor as Cursor
    from spiral_lightning.core.state import State as State
    from spiral_lightning.datasets.mapstyle import TableMapDataset
    from spiral_lightning.datasets.mixture import Mixture
    from spiral_lightning.datasets.packing import PackedDataset
    from spiral_lightning.datasets.stall import StallMeter
    from spiral_lightning.datasets.stuck import WorkerTimeout as WorkerTimeout
    from spiral_lightning.datasets.table import TableDataset
    from spiral_lightning.datasets.token_batches import TokenBatchDataset
    from spiral_lightning.datasets.windows import WindowDataset, Windows
    from spiral_lightning.lightning.datamodule import SpiralDataModule
    from spiral_lightning.lightning.loader import SpiralLoader as SpiralLoader
    from spiral_lightning.lightning.mixing import MixedTable
    from spiral_lightning.lightning.stall import DataStallMeter
    from spiral_lightning.media.ingest import ingest_images, ingest_videos
    from spiral_lightning.planning.policies import Shuffled, balanced, stripe
    from spiral_lightning.reading.packing import Packing
    from spiral_lightning.reading.tensors import NullError as NullError
    from spiral_lightning.reading.tensors import Nulls as Nulls
    from spiral_lightning.reading.tensors import to_torch as to_torch
    from spiral_lightning.reading.transfer import send_by_name as send_by_name
    from spiral_lightning.sources.damage import DamagedData as DamagedData
    from spiral_lightning.sources.ingest_files import ingest_files
    from spiral_lightning.sources.retry import StoreUnavailable as StoreUnavailable
    from spiral_lightning.sources.write import write_table

#: Each public name and the module that defines it.
_HOMES = {
    "Cursor": "core.state",
    "DamagedData": "sources.damage",
    "DataStallMeter": "lightning.stall",
    "FrameIndices": "core.media",
    "FrameNeighborhood": "core.media",
    "FrameSlice": "core.media",
    "FrameTimes": "core.media",
    "Image": "core.media",
    "MixedTable": "lightning.mixing",
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
    "StoreUnavailable": "sources.retry",
    "TableDataset": "datasets.table",
    "TableMapDataset": "datasets.mapstyle",
    "TableSpec": "core.spec",
    "TokenBatchDataset": "datasets.token_batches",
    "TokenBudget": "core.budget",
    "TooLong": "core.sequences",
    "Video": "core.media",
    "WindowDataset": "datasets.windows",
    "Windows": "datasets.windows",
    "WorkItem": "core.plan",
    "WorkerTimeout": "datasets.stuck",
    "balanced": "planning.policies",
    "ingest_files": "sources.ingest_files",
    "ingest_images": "media.ingest",
    "ingest_videos": "media.ingest",
    "send_by_name": "reading.transfer",
    "stripe": "planning.policies",
    "to_torch": "reading.tensors",
    "write_table": "sources.write",
}

#: What users build. The other names of ``_HOMES`` (cursors, states, plan values, the loader
#: class, tensor helpers, and the errors a run may meet: ``DamagedData``, ``StoreUnavailable``,
#: ``WorkerTimeout``) stay importable from here, and from their modules.
__all__ = [
    "DataStallMeter",
    "FrameIndices",
    "FrameNeighborhood",
    "FrameSlice",
    "FrameTimes",
    "Image",
    "MixedTable",
    "Mixture",
    "PackedDataset",
    "Packing",
    "Padded",
    "Shuffled",
    "SpiralDataModule",
    "StallMeter",
    "TableDataset",
    "TableMapDataset",
    "TableSpec",
    "TokenBatchDataset",
    "TokenBudget",
    "Video",
    "WindowDataset",
    "Windows",
    "balanced",
    "ingest_files",
    "ingest_images",
    "ingest_videos",
    "stripe",
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
