"""Ingest of real image and video folders into local Spiral tables, read back through TableDataset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from spiral_lightning import TableDataset, TableSpec
from spiral_lightning.core.media import FrameSlice, Image, Video, Where
from spiral_lightning.media.decode import project
from spiral_lightning.media.ingest import (
    CLASSES_KEY,
    BadFile,
    class_names,
    classes_of,
    ingest_images,
    ingest_videos,
    read_folder,
)
from tests.test_media import encode_image, encode_video, frame_numbers, gradient


def write_files(root: Path, files: dict[str, bytes]) -> None:
    for relative, data in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def read_back(uri: str, batch_size: int) -> dict[str, list[Any]]:
    """Every row of the table at ``uri``, column by column, through ``TableDataset``."""
    rows: dict[str, list[Any]] = {"path": [], "label": [], "image": [], "video": []}
    for batch in TableDataset(TableSpec(uri), batch_size=batch_size):
        assert len(batch["path"]) <= batch_size
        for name, values in batch.items():
            rows[name].extend(values.tolist() if isinstance(values, torch.Tensor) else values)
    return rows


@pytest.fixture
def image_folder(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """Two classes of real JPEG and PNG files, one nested folder, a hidden file and a broken one."""
    good = {
        "dog/b.png": encode_image(gradient(12, 8), "PNG"),
        "cat/z.jpg": encode_image(gradient(30, 20), "JPEG"),
        "cat/a.png": encode_image(gradient(8, 8), "PNG", "L"),
        "dog/nested/c.jpg": encode_image(gradient(16, 16), "JPEG"),
        "dog/a.jpg": encode_image(gradient(10, 6), "JPEG"),
    }
    src = tmp_path / "src"
    write_files(src, {**good, "dog/broken.jpg": b"\xff\xd8 not really a jpeg", "cat/.DS_Store": b"junk"})
    (src / "empty-class").mkdir()
    return src, good


def test_ingest_images_writes_paths_labels_and_bytes(
    tmp_path: Path, image_folder: tuple[Path, dict[str, bytes]], capsys: pytest.CaptureFixture[str]
) -> None:
    src, good = image_folder
    report = ingest_images(src, f"spiral:{tmp_path / 't'}", split_rows=2, progress=False)
    assert report.classes == ("cat", "dog", "empty-class")
    assert report.rows == 5 and len(report.bad) == 1
    assert report.bad[0].path == "dog/broken.jpg" and "not a readable image" in report.bad[0].reason
    assert "left out dog/broken.jpg: not a readable image" in capsys.readouterr().err
    rows = read_back(f"spiral:{tmp_path / 't'}", batch_size=2)
    expected = ["cat/a.png", "cat/z.jpg", "dog/a.jpg", "dog/b.png", "dog/nested/c.jpg"]
    assert rows["path"] == expected
    assert rows["label"] == [0, 0, 1, 1, 1]
    assert rows["image"] == [good[path] for path in expected]
    assert TableDataset(report.spec).source().splits[0].end == 2  # split_rows reached the table


def test_ingested_images_decode_through_project(tmp_path: Path, image_folder: tuple[Path, dict[str, bytes]]) -> None:
    src, _ = image_folder
    report = ingest_images(src, f"spiral:{tmp_path / 't'}", progress=False)
    media = [Image("image", size=(4, 8), layout="CHW", dtype="float32", normalize="unit")]
    for position, batch in enumerate(TableDataset(report.spec, batch_size=5)):
        projected, skipped = project(batch, media, Where(report.spec.uri, first_row=5 * position))
        assert skipped == () and projected["image"].shape == (5, 3, 4, 8)
        assert projected["image"].min() >= 0 and projected["image"].max() <= 1


def test_the_folder_schema_keeps_the_class_names(image_folder: tuple[Path, dict[str, bytes]]) -> None:
    src, _ = image_folder
    rows = read_folder(src, "images", progress=False)
    assert classes_of(rows.schema) == ("cat", "dog", "empty-class")
    assert rows.schema.names == ["path", "label", "image"]
    table = rows.reader().read_all()
    assert classes_of(table.schema) == rows.classes and table.num_rows == rows.rows == 5
    assert rows.bad == [BadFile("dog/broken.jpg", rows.bad[0].reason)]
    assert CLASSES_KEY in (table.schema.metadata or {})


def test_ingest_videos_reads_back_and_leaves_out_truncated_files(tmp_path: Path) -> None:
    plain, bframes = encode_video(frames=12), encode_video(frames=12, b_frames=2)
    good = {"run/one.mp4": plain, "jump/two.mp4": bframes, "jump/three.mp4": plain}
    src = tmp_path / "src"
    write_files(src, {**good, "run/cut.mp4": bframes[: len(bframes) // 2], "run/notes.txt": b"hello"})
    report = ingest_videos(src, f"spiral:{tmp_path / 'v'}", split_rows=2, progress=False)
    assert report.classes == ("jump", "run") and report.rows == 3
    assert [bad.path for bad in report.bad] == ["run/cut.mp4", "run/notes.txt"]
    assert all("not a readable video" in bad.reason for bad in report.bad)
    rows = read_back(f"spiral:{tmp_path / 'v'}", batch_size=2)
    assert rows["path"] == ["jump/three.mp4", "jump/two.mp4", "run/one.mp4"]
    assert rows["label"] == [0, 0, 1]
    assert rows["video"] == [good[path] for path in rows["path"]]
    batch = next(iter(TableDataset(report.spec, batch_size=3)))
    clips = project(batch, [Video("video", frames=FrameSlice(3, 9, 2))], Where(report.spec.uri)).batch["video"]
    assert clips.shape == (3, 3, 48, 64, 3) and [frame_numbers(clip) for clip in clips] == [[3, 5, 7]] * 3


def test_ingest_refuses_folders_without_classes_or_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        class_names(tmp_path / "missing")
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.png").write_bytes(encode_image(gradient(4, 4), "PNG"))
    with pytest.raises(ValueError, match="has no class subfolders"):
        ingest_images(tmp_path / "flat", f"spiral:{tmp_path / 't'}", progress=False)
    (tmp_path / "hollow" / "cat").mkdir(parents=True)
    with pytest.raises(ValueError, match="hold no files"):
        ingest_images(tmp_path / "hollow", f"spiral:{tmp_path / 't'}", progress=False)
    with pytest.raises(ValueError, match="kind must be 'images' or 'videos'"):
        read_folder(tmp_path / "flat", "audio", progress=False)  # type: ignore[arg-type]


def test_a_folder_with_nothing_readable_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_files(src, {"cat/broken.jpg": b"\xff\xd8 not really a jpeg", "dog/notes.txt": b"hello"})
    dest = tmp_path / "t"
    with pytest.raises(ValueError, match=r"none of the 2 files under .* is a readable image, so nothing was written"):
        ingest_images(src, f"spiral:{dest}", progress=False)
    assert not dest.exists()


def test_ingest_videos_leaves_out_images_as_not_videos(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # FFmpeg opens a JPEG or PNG as a one-frame "video", which no clip of two frames could read.
    still = {
        "run/still.jpg": encode_image(gradient(64, 48), "JPEG"),
        "run/still.png": encode_image(gradient(8, 8), "PNG"),
    }
    src = tmp_path / "src"
    write_files(src, {"run/one.mp4": encode_video(frames=12), **still})
    report = ingest_videos(src, f"spiral:{tmp_path / 'v'}", progress=False)
    assert report.rows == 1
    assert [bad.path for bad in report.bad] == ["run/still.jpg", "run/still.png"]
    assert all("an image, not a video" in bad.reason for bad in report.bad)
    printed = capsys.readouterr().err
    assert "left out run/still.jpg: an image, not a video" in printed
    images = tmp_path / "images"
    write_files(images, still)
    with pytest.raises(ValueError, match=r"none of the 2 files .* is a readable video"):
        ingest_videos(images, f"spiral:{tmp_path / 'w'}", progress=False)
    assert not (tmp_path / "w").exists()
