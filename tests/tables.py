"""Real local Spiral tables for tests: layouts with uneven splits and a filter that empties some."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import spiral

from spiral_lightning import TableSpec
from spiral_lightning.sources.spiral import IDS_FILE

#: Rows with ``score`` below this pass ``KEEP`` (native Spiral) and ``KEEP_TEXT`` (any backend).
THRESHOLD = 50
KEEP = spiral.lt(spiral.column("score"), spiral.literal(THRESHOLD))
KEEP_TEXT = f"score < {THRESHOLD}"
#: The backends every invariant test runs on.
BACKENDS = ("spiral", "parquet")


def layout_table(split_sizes: Sequence[int], seed: int = 0) -> pa.Table:
    """Rows ``id`` 0..n-1 in order, ``score`` (``KEEP`` holds below 50), ``x`` float32 and ``v``
    float32[4]. Each split's scores are all kept, all dropped or mixed, chosen by ``seed``."""
    generator = np.random.default_rng(seed)
    scores = [np.zeros(0, np.int64)]
    for size in split_sizes:
        low, high = ((0, 50), (50, 100), (0, 100))[generator.integers(3)]
        scores.append(generator.integers(low, high, size))
    rows = sum(split_sizes)
    return pa.table(
        {
            "id": pa.array(np.arange(rows, dtype=np.int64)),
            "score": pa.array(np.concatenate(scores)),
            "x": pa.array(np.arange(rows, dtype=np.float32) / 2),
            "v": pa.FixedSizeListArray.from_arrays(pa.array(np.arange(rows * 4, dtype=np.float32)), 4),
        }
    )


def write_uneven(root: Path, data: pa.Table, split_sizes: Sequence[int]) -> TableSpec:
    """``data`` as a local Spiral table at ``root`` whose splits hold ``split_sizes`` rows."""
    writer = spiral.Client.local().create_local_table(root, data.schema)
    offset = 0
    for size in split_sizes:
        writer.append(data.slice(offset, size))
        offset += size
    table = writer.finish()
    (root / IDS_FILE).write_text(json.dumps({"resource_id": table.resource_id, "version_id": table.version_id}))
    return TableSpec(f"spiral:{root}").resolve()


def kept_ids(split_sizes: Sequence[int], seed: int = 0) -> list[int]:
    """The ids of ``layout_table``'s rows that ``KEEP`` holds for, in stored order."""
    data = layout_table(split_sizes, seed)
    score = data.column("score").to_numpy()
    return [int(i) for i in data.column("id").to_numpy()[score < THRESHOLD]]


def write_uneven_parquet(root: Path, data: pa.Table, split_sizes: Sequence[int]) -> TableSpec:
    """``data`` as Parquet files under ``root`` whose row groups hold ``split_sizes`` rows, two
    files when there are several splits (a row group cannot be empty, so empty splits vanish)."""
    root.mkdir(parents=True)
    halves = [split_sizes[: len(split_sizes) // 2], split_sizes[len(split_sizes) // 2 :]]
    offset = 0
    for number, sizes in enumerate(halves):
        if not sizes:
            continue
        with pq.ParquetWriter(root / f"part-{number}.parquet", data.schema) as writer:
            for size in sizes:
                if size:
                    writer.write_table(data.slice(offset, size), row_group_size=size)
                offset += size
    return TableSpec(f"parquet:{root}").resolve()


def write_layout(root: Path, split_sizes: Sequence[int], seed: int, backend: str) -> TableSpec:
    """``layout_table(split_sizes, seed)`` written by ``backend`` with those splits."""
    data = layout_table(split_sizes, seed)
    if backend == "parquet":
        return write_uneven_parquet(root, data, split_sizes)
    return write_uneven(root, data, split_sizes)
