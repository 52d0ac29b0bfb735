"""The demo table: a small learnable classification task stored as an embedded local table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from spiral_lightning.sources.spiral import IDS_FILE
from spiral_lightning.spec import TableSpec
from spiral_lightning.write import write_table

#: Features per row and classes of the demo task.
FEATURES = 16
CLASSES = 4


def demo_data(rows: int, seed: int = 0) -> pa.Table:
    """``rows`` rows of ``id``, ``features`` (16 float32) and ``label``: the class whose fixed
    random direction is closest to the features, so a linear model can learn it."""
    generator = np.random.default_rng(seed)
    directions = generator.standard_normal((FEATURES, CLASSES)).astype(np.float32)
    features = generator.standard_normal((rows, FEATURES)).astype(np.float32)
    labels = (features @ directions).argmax(axis=1).astype(np.int64)
    return pa.table(
        {
            "id": pa.array(np.arange(rows, dtype=np.int64)),
            "features": pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1)), FEATURES),
            "label": pa.array(labels),
        }
    )


def demo_table(root: str | Path, rows: int = 200_000, split_rows: int = 20_000) -> TableSpec:
    """The demo table at ``root``, written there first when the folder holds none."""
    root = Path(root)
    if not (root / IDS_FILE).exists():
        write_table(f"spiral:{root}", demo_data(rows), split_rows=split_rows)
    return TableSpec(f"spiral:{root}").resolve()
