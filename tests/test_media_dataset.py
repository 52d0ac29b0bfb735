"""Media projections through TableDataset: Spiral blobs, Spiral binary and Parquet binary columns
decoded in worker processes into stacked tensors, with exact errors and counted skips."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pytest
import spiral
import spiral.types
import torch
from PIL import Image as PILImage
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from spiral_lightning import TableDataset, TableMapDataset, TableSpec, write_table
from spiral_lightning.core.media import DecodeError, FrameSlice, Image, Video
from spiral_lightning.media.ingest import classes_of, ingest_images
from spiral_lightning.sources.spiral import IDS_FILE
from tests.test_media import encode_video

ROWS = 12
BROKEN = {5}


def jpeg(row: int) -> bytes:
    """A solid image whose red level encodes the row, in a size that varies by row."""
    buffer = io.BytesIO()
    PILImage.new("RGB", (20 + row, 10 + row % 3), (row * 20, 100, 200)).save(buffer, "JPEG", quality=95)
    return buffer.getvalue()


def payloads() -> list[bytes]:
    return [b"not an image" if row in BROKEN else jpeg(row) for row in range(ROWS)]


def spiral_blob_table(root: Path) -> TableSpec:
    """A Spiral table whose images are stored as packed blobs, as Spiral's own writers store them."""
    schema = pa.schema([("id", pa.int64()), ("img", spiral.types.Blob._instance())])
    writer = spiral.Client.local().create_local_table(root, schema)
    blobs = writer.pack_blobs([(data, "image/jpeg") for data in payloads()])
    writer.append(pa.table({"id": list(range(ROWS)), "img": blobs}, schema=schema))
    table = writer.finish()
    (root / IDS_FILE).write_text(json.dumps({"resource_id": table.resource_id, "version_id": table.version_id}))
    return TableSpec(f"spiral:{root}").resolve()


def binary_table(root: Path, backend: str) -> TableSpec:
    data = pa.table({"id": pa.array(range(ROWS), pa.int64()), "img": pa.array(payloads(), pa.binary())})
    return write_table(f"{backend}:{root}", data, split_rows=5)


@pytest.fixture(params=["spiral-blob", "spiral", "parquet"])
def images(request: pytest.FixtureRequest, tmp_path: Path) -> TableSpec:
    if request.param == "spiral-blob":
        return spiral_blob_table(tmp_path / "t")
    return binary_table(tmp_path / "t", request.param)


RESIZE = Image("img", size=(12, 16), layout="CHW", dtype="float32", normalize="unit")


def with_media(spec: TableSpec, on_error: str = "raise") -> TableSpec:
    return TableSpec(spec.uri, files=spec.files, media=(RESIZE,), on_error=on_error)  # type: ignore[arg-type]


@pytest.mark.slow
def test_images_arrive_as_one_tensor_per_batch_from_worker_processes(
    images: TableSpec, request: pytest.FixtureRequest
) -> None:
    dataset = TableDataset(with_media(images, "skip"), batch_size=4)
    # Blobs come through spawned workers, fresh interpreters that import the decoders themselves
    # (seconds each); the rest fork theirs from the preloaded forkserver, as loader() does.
    context = "spawn" if request.node.callspec.params["images"] == "spiral-blob" else "forkserver"
    loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context=context)
    seen: list[int] = []
    for batch in loader:
        rows = batch["id"].tolist()
        assert batch["img"].shape == (len(rows), 3, 12, 16) and batch["img"].dtype == torch.float32
        red = batch["img"][:, 0].mean(dim=(1, 2))
        assert torch.allclose(red, torch.tensor([row * 20 / 255 for row in rows]), atol=0.03)
        assert torch.allclose(batch["img"][:, 2].mean(dim=(1, 2)), torch.full((len(rows),), 200 / 255), atol=0.03)
        seen += rows
    assert sorted(seen) == [row for row in range(ROWS) if row not in BROKEN]


def test_a_row_that_does_not_decode_is_named(images: TableSpec) -> None:
    dataset = TableDataset(with_media(images), batch_size=4)
    with pytest.raises(DecodeError, match=r"cannot decode column 'img' of .*\(rank 0, worker 0\), row 5") as error:
        list(dataset)
    assert images.uri in str(error.value) and "pass on_error='skip' to drop rows" in str(error.value)


def test_skipped_rows_are_counted_in_the_state_and_survive_a_resume(images: TableSpec) -> None:
    spec = with_media(images, "skip")
    whole = [batch["id"].tolist() for batch in TableDataset(spec, batch_size=4)]
    assert [row for batch in whole for row in batch] == [row for row in range(ROWS) if row not in BROKEN]
    assert [len(batch) for batch in whole] == [4, 3, 4]
    loader = StatefulDataLoader(TableDataset(spec, batch_size=4), batch_size=None)
    delivering = iter(loader)
    first, second = next(delivering), next(delivering)
    state = loader.state_dict()
    assert state["dataset_state"]["skipped"] == 1
    resumed = StatefulDataLoader(TableDataset(spec, batch_size=4), batch_size=None)
    resumed.load_state_dict(state)
    rest = [batch["id"].tolist() for batch in resumed]
    assert [first["id"].tolist(), second["id"].tolist(), *rest] == whole


def test_skipped_rows_read_the_same_in_the_main_process_whatever_the_worker_count(tmp_path: Path) -> None:
    dataset = TableDataset(with_media(binary_table(tmp_path / "t", "parquet"), "skip"), batch_size=2)
    in_process = [row for batch in dataset for row in batch["id"].tolist()]
    assert dataset.skipped == len(BROKEN)
    loader = dataset.loader(num_workers=2)
    through_workers = [row for batch in loader for row in batch["id"].tolist()]
    assert sorted(through_workers) == in_process
    assert dataset.skipped == len(BROKEN)
    # A new epoch counts again from nothing.
    dataset.set_epoch(1)
    assert dataset.skipped == 0
    assert len([row for batch in loader for row in batch["id"].tolist()]) == ROWS - len(BROKEN)
    assert dataset.skipped == len(BROKEN)


def test_ingested_class_names_survive_a_spiral_table(tmp_path: Path) -> None:
    for label, name in enumerate(["cat", "dog"]):
        (tmp_path / "src" / name).mkdir(parents=True)
        for row in range(3):
            (tmp_path / "src" / name / f"{row}.jpg").write_bytes(jpeg(label * 3 + row))
    report = ingest_images(tmp_path / "src", f"spiral:{tmp_path / 't'}", split_rows=4, progress=False)
    dataset = TableDataset(TableSpec(report.spec.uri, media=(Image("image", size=(8, 8)),)), batch_size=6)
    assert classes_of(dataset.source().schema) == ("cat", "dog")
    batch = next(iter(dataset))
    assert batch["image"].shape == (6, 8, 8, 3) and batch["image"].dtype == torch.uint8
    assert batch["label"].tolist() == [0, 0, 0, 1, 1, 1]


def test_sizes_are_height_then_width_as_in_torchvision(tmp_path: Path) -> None:
    # Images 20 wide and 10 high, red above and blue below, and 64 x 48 videos, on the Pillow and
    # PyAV paths; non-square sizes tell the two orders apart.
    buffer = io.BytesIO()
    halves = PILImage.new("RGB", (20, 10), (255, 0, 0))
    halves.paste((0, 0, 255), (0, 5, 20, 10))
    halves.save(buffer, "PNG")
    data = pa.table({"img": pa.array([buffer.getvalue()] * 3), "clip": pa.array([encode_video(frames=4)] * 3)})
    stored = write_table(f"parquet:{tmp_path / 't'}", data)
    image = Image("img", size=(64, 32), layout="CHW", dtype="float32", normalize="unit")
    clip = Video("clip", frames=FrameSlice(0, 2), size=(48, 16), layout="TCHW")
    batch = next(iter(TableDataset(TableSpec(stored.uri, files=stored.files, media=(image, clip)), batch_size=3)))
    assert batch["img"].shape == (3, 3, 64, 32) and batch["clip"].shape == (3, 2, 3, 48, 16)
    assert batch["img"][:, 0, :16].min() > 0.99 and batch["img"][:, 2, 48:].min() > 0.99


@pytest.mark.parametrize("condition", [None, "id > 2"])
def test_random_access_reads_blob_bytes_with_and_without_a_filter(tmp_path: Path, condition: str | None) -> None:
    spec = spiral_blob_table(tmp_path / "t")
    rows = TableMapDataset(TableSpec(spec.uri, filter=condition))
    first = 3 if condition else 0
    assert [row["img"] for row in rows.__getitems__([1, 0])] == [payloads()[first + 1], payloads()[first]]


def test_random_access_decodes_rows_as_the_iterable_dataset_does(images: TableSpec) -> None:
    rows = TableMapDataset(with_media(images))
    whole = next(iter(TableDataset(with_media(images, "skip"), batch_size=ROWS)))
    decoded = dict(zip(whole["id"].tolist(), whole["img"], strict=True))
    indices = [11, 0, 7, 0, 3]
    together = rows.__getitems__(indices)
    assert [int(row["id"]) for row in together] == indices
    for index, row in zip(indices, together, strict=True):
        assert row["img"].shape == (3, 12, 16) and row["img"].dtype == torch.float32
        assert torch.equal(row["img"], decoded[index])
        assert torch.equal(rows[index]["img"], decoded[index])
    # A repeated index gives a copy of its own, as every row's tensors are.
    together[1]["img"].add_(1)
    assert torch.equal(together[3]["img"], decoded[0])
    for read in (lambda: rows.__getitems__([0, *BROKEN, 2]), lambda: rows[min(BROKEN)]):
        with pytest.raises(DecodeError, match=rf"cannot decode column 'img' of .*, index {min(BROKEN)}: ") as error:
            read()
        assert images.uri in str(error.value)
        # The remedy fits the read: a map-style read cannot skip the row.
        assert "cannot skip it" in str(error.value) and "on_error='skip'" not in str(error.value)


def test_random_access_refuses_to_skip_rows_and_keeps_images_of_each_size(tmp_path: Path) -> None:
    spec = binary_table(tmp_path / "t", "parquet")
    with pytest.raises(ValueError, match=r"on_error='skip' drops rows .* use on_error='raise'"):
        TableMapDataset(with_media(spec, "skip"))
    # Without a size every image keeps its own, so the rows come as a list of tensors.
    rows = TableMapDataset(TableSpec(spec.uri, media=(Image("img"),)))
    first, other, again = rows.__getitems__([2, 3, 2])
    assert first["img"].shape == (12, 22, 3) and other["img"].shape == (10, 23, 3)
    first["img"].zero_()
    assert torch.equal(again["img"], rows[2]["img"]) and int(again["img"][0, 0, 0]) > 0
