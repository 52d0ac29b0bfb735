"""With no worker count given, a loader reads plain columns in process and Python-heavy batches
(a transform, a collate of its own, media) in worker processes."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
from PIL import Image as PILImage

from spiral_lightning import (
    Image,
    Mixture,
    SpiralDataModule,
    TableDataset,
    TableSpec,
    WindowDataset,
    Windows,
    write_table,
)
from spiral_lightning.datasets.loader import MOST_WORKERS, default_workers, runs_python, workers_for


def doubled(batch: dict[str, Any]) -> dict[str, Any]:
    return {**batch, "x": batch["x"] * 2}


def processes() -> int:
    """The worker count a Python-heavy dataset gets on this machine."""
    return max(1, min(MOST_WORKERS, len(os.sched_getaffinity(0))))


def test_plain_columns_read_in_process_and_python_work_in_processes(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([60, 40])
    plain = TableDataset(spec, batch_size=10)
    transformed = TableDataset(spec, batch_size=10, transform=doubled)
    assert not runs_python(plain) and workers_for(plain, None) == 0
    assert runs_python(transformed) and workers_for(transformed, None) == processes() == default_workers(True)
    assert workers_for(transformed, 0) == 0 and workers_for(plain, 3) == 3
    assert runs_python(Mixture([(spec, 1.0), (TableSpec(spec.uri, columns=["id"]), 1.0)], batch_size=10)) is False
    assert not runs_python(WindowDataset(spec, windows=Windows(4), batch_size=2))
    with pytest.raises(ValueError, match="num_workers"):
        workers_for(plain, -1)
    loader = transformed.loader()
    assert loader.num_workers == processes()
    rows = [batch for batch in loader]
    assert sorted(torch.cat([batch["id"] for batch in rows]).tolist()) == list(range(100))
    assert all(torch.equal(batch["x"], batch["id"].to(torch.float32)) for batch in rows)  # x = id / 2, doubled
    assert plain.loader().num_workers == 0


def test_media_to_decode_reads_in_processes(make_table: Callable[..., TableSpec], tmp_path: Path) -> None:
    buffer = io.BytesIO()
    PILImage.new("RGB", (8, 6), (10, 100, 200)).save(buffer, "PNG")
    data = pa.table({"id": pa.array(range(6), pa.int64()), "img": pa.array([buffer.getvalue()] * 6, pa.binary())})
    spec = write_table(f"parquet:{tmp_path}/images", data, split_rows=3)
    images = TableSpec(spec.uri, files=spec.files, media=(Image("img", size=(4, 4)),))
    dataset = TableDataset(images, batch_size=3)
    assert runs_python(dataset) and workers_for(dataset, None) == processes()
    assert runs_python(Mixture([(spec, 1.0), (images, 1.0)], batch_size=3))
    loader = dataset.loader()
    assert loader.num_workers == processes()
    assert sorted(int(row) for batch in loader for row in batch["id"]) == list(range(6))
    assert all(batch["img"].shape[1:] == (4, 4, 3) for batch in loader)
    assert SpiralDataModule(train=images, batch_size=3).num_workers == processes()
    plain = make_table([20])
    modules = [SpiralDataModule(train=plain, batch_size=10, transform=doubled), SpiralDataModule(train=plain)]
    assert [module.num_workers for module in modules] == [processes(), 0]
    assert modules[0].multiprocessing_context == "forkserver" and modules[1].multiprocessing_context is None


def test_a_transform_that_does_not_pickle_is_read_in_process_and_said(make_table: Callable[..., TableSpec]) -> None:
    dataset = TableDataset(make_table([30]), batch_size=10, transform=lambda batch: batch)
    with pytest.warns(UserWarning, match="does not pickle .* read in this process; define its transform"):
        loader = dataset.loader()
    assert loader.num_workers == 0
    assert sorted(int(row) for batch in loader for row in batch["id"]) == list(range(30))
