"""Spiral pixel columns (``spql.Image``): the scan itself resizes and makes tensors, and they
arrive as stacked tensors without any decoding in Python."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import spiral
import spiral.types
import torch
from torch.utils.data import DataLoader

from spiral_lightning import TableDataset, TableSpec
from spiral_lightning.core.media import Image
from spiral_lightning.sources.spiral import IDS_FILE

ROWS = 6


def picture(row: int) -> np.ndarray:
    """A solid RGB picture whose colour encodes the row, in a size that varies by row."""
    return np.broadcast_to(np.array([row * 30, 100, 250 - row * 10], np.uint8), (5 + row, 7 + row, 3)).copy()


def pixel_table(root: Path, pictures: list[np.ndarray]) -> TableSpec:
    """A Spiral table of ``pictures`` (``[H, W, 3]`` uint8) as a pixel column, in two writes."""
    values = pa.list_(pa.field("item", pa.uint8(), nullable=False))
    images = spiral.types.image(
        data=pa.array([p.reshape(-1) for p in pictures], values),
        width=pa.array([p.shape[1] for p in pictures], pa.uint32()),
        height=pa.array([p.shape[0] for p in pictures], pa.uint32()),
        pixel_format=pa.array([1] * len(pictures), pa.uint8()),
    )
    data = pa.table({"id": pa.array(range(len(pictures)), pa.int64()), "img": images})
    writer = spiral.Client.local().create_local_table(root, data.schema)
    writer.append(data.slice(0, 4))
    writer.append(data.slice(4))
    table = writer.finish()
    (root / IDS_FILE).write_text(json.dumps({"resource_id": table.resource_id, "version_id": table.version_id}))
    return TableSpec(f"spiral:{root}").resolve()


@pytest.fixture
def pixels(tmp_path: Path) -> TableSpec:
    return pixel_table(tmp_path / "pixels", [picture(row) for row in range(ROWS)])


def with_media(spec: TableSpec, image: Image, **options: object) -> TableSpec:
    return TableSpec(spec.uri, media=(image,), **options)  # type: ignore[arg-type]


@pytest.mark.slow
def test_resized_pixels_arrive_stacked_from_worker_processes(pixels: TableSpec) -> None:
    image = Image("img", size=(4, 6), layout="CHW", dtype="float32", normalize="unit")
    dataset = TableDataset(with_media(pixels, image, filter="id > 0"), batch_size=5)
    # Forked from the preloaded forkserver; spawned workers decode media in test_media_dataset.py.
    loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="forkserver")
    batches = list(loader)
    rows = [row for batch in batches for row in batch["id"].tolist()]
    assert sorted(rows) == list(range(1, ROWS))
    for batch in batches:
        assert batch["img"].shape == (len(batch["id"]), 3, 4, 6) and batch["img"].dtype == torch.float32
        colours = torch.tensor([picture(row)[0, 0].tolist() for row in batch["id"].tolist()]) / 255
        assert torch.allclose(batch["img"].mean(dim=(2, 3)), colours, atol=1e-3)


def test_the_scan_resizes_to_height_then_width_as_in_torchvision(tmp_path: Path) -> None:
    # Pictures 20 wide and 10 high, red above and blue below; (64, 32) is 64 rows of 32 pixels.
    halves = np.zeros((10, 20, 3), np.uint8)
    halves[:5, :, 0] = halves[5:, :, 2] = 255
    spec = pixel_table(tmp_path / "halves", [halves] * 5)
    image = Image("img", size=(64, 32), layout="CHW", dtype="float32", normalize="unit")
    batch = next(iter(TableDataset(with_media(spec, image), batch_size=5)))
    assert batch["img"].shape == (5, 3, 64, 32)
    assert batch["img"][:, 0, :16].min() > 0.99 and batch["img"][:, 2, 48:].min() > 0.99
    hwc = next(iter(TableDataset(with_media(spec, Image("img", size=(64, 32))), batch_size=5)))
    assert hwc["img"].shape == (5, 64, 32, 3)


def test_pixels_without_a_resize_stay_one_tensor_per_row(pixels: TableSpec) -> None:
    image = Image("img", layout="HWC", dtype="uint8")
    batch = next(iter(TableDataset(with_media(pixels, image), batch_size=ROWS)))
    assert isinstance(batch["img"], list)
    for row, tensor in zip(batch["id"].tolist(), batch["img"], strict=True):
        assert torch.equal(tensor, torch.from_numpy(picture(row)))


def test_projections_the_scan_cannot_make_are_named(pixels: TableSpec) -> None:
    image = Image("img", size=(6, 4), layout="HWC", dtype="float32", normalize="unit")
    with pytest.raises(ValueError, match="column 'img' holds decoded pixels, which the scan turns into tensors as"):
        len(TableDataset(with_media(pixels, image)))
