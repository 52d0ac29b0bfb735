"""Decoded images and clips per second through TableDataset's media projections against a plain
torch ``Dataset`` that decodes the same files from a folder.

Run ``.venv/bin/python benchmarks/media.py`` (``--images 500 --videos 16`` for a quick look;
``--root`` keeps the files and tables between runs).

Images: ``--images`` JPEGs of about 256x256 pixels (sizes vary by up to 16 pixels each way, the
content is a random colour gradient with shapes and noise, quality 90) in ``--classes`` class
folders, ingested with ``ingest_images`` as a local Spiral table and as Parquet. TableDataset
reads ``columns=["label", "image"]`` with ``Image("image", size=(64, 64), layout="CHW",
dtype="float32", normalize="unit")`` in batches of 64 through ``DataLoader(batch_size=None)``. The
plain path is a map-style ``Dataset`` whose ``__getitem__`` opens one JPEG file with Pillow,
converts it to RGB, resizes it to 64x64 (bilinear) and returns a CHW float tensor in 0..1 with
its label, through ``DataLoader(batch_size=64)``.

Videos: ``--videos`` H.264 MP4s (libx264, ``--frames`` frames of 128x96 at 25 fps, moving
content) ingested with ``ingest_videos`` the same two ways. TableDataset decodes
``Video("video", frames=FrameSlice(0, 16, 2), size=(48, 64))``; the plain ``Dataset`` opens each
file with PyAV, decodes frames in order, keeps frames 0, 2, ..., 14 resized to 64x48 RGB (by
FFmpeg's scaler, bilinear, as the projection does), stops after frame 14 and stacks them into a
``[8, 48, 64, 3]`` uint8 tensor. Both go in batches of ``--clip-batch-size`` (8).

Every loader has ``num_workers=2``, ``multiprocessing_context="forkserver"`` and
``persistent_workers=True``, and the forkserver preloads torch, PyAV, Pillow and spiral_lightning
for all of them. Tables are split so that each worker reads four splits. The first epoch of each
loader starts its workers and is timed only for the "first epoch" column; the rate is the best of
the epochs after it (``--epochs`` in all for images, by default the second and third;
``--clip-epochs`` for clips, by default the second to fifth), the paths taking turns so that load
from other processes falls on all of them alike. Worker start-up is therefore excluded from the
rate. The last column divides each rate by the plain path's; the targets are at least 1.5 for
images and at least 1.0 for clips.

What the plain paths do is what their libraries' own examples do: Pillow decodes each JPEG at
full size (no draft mode), and ``VideoFrame.to_ndarray(width=..., height=...)`` resizes each frame
with a scaler made for that frame. The projections decode JPEGs in draft mode and keep one scaler
per worker thread.
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from collections.abc import Iterable
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch
from PIL import Image as PILImage
from PIL import ImageDraw
from throughput import in_turns
from torch.utils.data import DataLoader, Dataset

from spiral_lightning import TableDataset, TableSpec
from spiral_lightning.core.media import FrameSlice, Image, Video
from spiral_lightning.media.ingest import ingest_images, ingest_videos

WORKERS = 2
CONTEXT = "forkserver"
IMAGE_SIZE = (64, 64)
CLIP_SIZE = (48, 64)
CLIP_FRAMES = range(0, 16, 2)
#: The tables each folder is ingested as, by uri scheme.
SCHEMES = {"spiral": "Spiral", "parquet": "Parquet"}
#: Modules the forkserver imports once, so that workers start without importing them.
PRELOAD = ["torch", "numpy", "av", "PIL.Image", "spiral_lightning", "spiral_lightning.media.ingest"]


def make_images(folder: Path, count: int, classes: int) -> None:
    """``count`` JPEGs of varied content and size in ``classes`` class folders."""
    generator = np.random.default_rng(0)
    for index in range(count):
        width, height = (int(value) for value in generator.integers(240, 273, 2))
        low, high = generator.integers(0, 256, 3), generator.integers(0, 256, 3)
        ramp = np.linspace(0, 1, width, dtype=np.float32)[None, :, None]
        fall = np.linspace(0, 1, height, dtype=np.float32)[:, None, None]
        pixels = low + (high - low) * (ramp + fall) / 2 + generator.normal(0, 12, (height, width, 3))
        image = PILImage.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(image)
        for _ in range(6):
            x, y = int(generator.integers(0, width - 40)), int(generator.integers(0, height - 40))
            box = (x, y, x + int(generator.integers(20, 120)), y + int(generator.integers(20, 120)))
            colour = tuple(int(value) for value in generator.integers(0, 256, 3))
            (draw.ellipse if generator.random() < 0.5 else draw.rectangle)(box, fill=colour)
        target = folder / f"class{index % classes:02d}" / f"{index:06d}.jpg"
        target.parent.mkdir(parents=True, exist_ok=True)
        image.save(target, quality=90)


def make_videos(folder: Path, count: int, frames: int, classes: int) -> None:
    """``count`` H.264 MP4s of ``frames`` 128x96 frames of moving content in ``classes`` folders."""
    generator = np.random.default_rng(1)
    width, height = 128, 96
    for index in range(count):
        target = folder / f"class{index % classes:02d}" / f"{index:06d}.mp4"
        target.parent.mkdir(parents=True, exist_ok=True)
        background = generator.integers(0, 256, (height, width, 3)).astype(np.float32)
        background = (background + np.roll(background, 1, 0) + np.roll(background, 1, 1)) / 3
        colour = generator.integers(0, 256, 3)
        with av.open(str(target), mode="w") as container:
            stream = container.add_stream("libx264", rate=Fraction(25, 1))
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            for number in range(frames):
                pixels = np.roll(background, 2 * number, axis=1)
                x, y = (3 * number) % (width - 24), (2 * number) % (height - 24)
                pixels[y : y + 24, x : x + 24] = colour
                frame = av.VideoFrame.from_ndarray(pixels.astype(np.uint8), format="rgb24")
                container.mux(stream.encode(frame))
            container.mux(stream.encode(None))


def class_files(folder: Path, suffix: str) -> list[tuple[Path, int]]:
    """The files under ``folder``'s class folders with their labels, in the order ingest uses."""
    classes = sorted(path.name for path in folder.iterdir() if path.is_dir())
    return [(path, label) for label, name in enumerate(classes) for path in sorted((folder / name).rglob(f"*{suffix}"))]


class FolderImages(Dataset[dict[str, Any]]):
    """Each JPEG opened with Pillow, converted to RGB, resized and returned as CHW floats."""

    def __init__(self, folder: Path) -> None:
        self.files = class_files(folder, ".jpg")

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, Any]:
        path, label = self.files[index]
        with PILImage.open(path) as image:
            rgb = image.convert("RGB").resize(IMAGE_SIZE[::-1], PILImage.Resampling.BILINEAR)
        pixels = torch.from_numpy(np.array(rgb)).permute(2, 0, 1).to(torch.float32) / 255
        return {"label": label, "image": pixels}


class FolderClips(Dataset[dict[str, Any]]):
    """Each MP4 decoded frame by frame with PyAV, keeping frames 0, 2, ..., 14 resized."""

    def __init__(self, folder: Path) -> None:
        self.files = class_files(folder, ".mp4")

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> dict[str, Any]:
        path, label = self.files[index]
        height, width = CLIP_SIZE
        kept: list[np.ndarray[Any, Any]] = []
        with av.open(str(path)) as container:
            for number, frame in enumerate(container.decode(video=0)):
                if number in CLIP_FRAMES:
                    kept.append(frame.to_ndarray(format="rgb24", width=width, height=height, interpolation="BILINEAR"))
                if number >= CLIP_FRAMES[-1]:
                    break
        return {"label": label, "video": torch.from_numpy(np.stack(kept))}


def loader(dataset: Any, batch_size: int | None) -> DataLoader[Any]:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=WORKERS,
        multiprocessing_context=CONTEXT,
        persistent_workers=True,
    )


def table_loader(uri: str, media: Image | Video, batch_size: int) -> DataLoader[Any]:
    """A loader of ``uri``'s labels and decoded ``media``, batched by the dataset."""
    spec = TableSpec(uri, columns=["label", media.column], media=(media,))
    return loader(TableDataset(spec, batch_size=batch_size), None)


def epoch(batches: Iterable[dict[str, Any]], column: str, shape: tuple[int, ...]) -> tuple[int, float]:
    """One pass: the rows it delivered and its wall time, each batch checked for its shape."""
    began = time.perf_counter()
    rows = 0
    for batch in batches:
        values = batch[column]
        if tuple(values.shape[1:]) != shape or len(batch["label"]) != len(values):
            raise AssertionError(f"a batch of {column!r} has the shape {tuple(values.shape)}, not [B, {shape}]")
        rows += len(values)
    return rows, time.perf_counter() - began


class Row:
    """One path's results: the first epoch's time, the best later epoch's, and its rows."""

    def __init__(self) -> None:
        self.first = 0.0
        self.best = float("inf")
        self.rows = 0


def compare(loaders: dict[str, DataLoader[Any]], column: str, shape: tuple[int, ...], epochs: int) -> dict[str, Row]:
    """The paths' epochs taken in turns; the first epoch of each starts its workers."""
    rows = {name: Row() for name in loaders}
    names = list(loaders)
    for number in range(epochs):
        for name in in_turns(names, number):
            count, seconds = epoch(loaders[name], column, shape)
            row = rows[name]
            if number == 0:
                row.first, row.rows = seconds, count
            else:
                row.best = min(row.best, seconds)
            if count != row.rows:
                raise AssertionError(f"{name} delivered {count} rows, then {row.rows}")
    return rows


def table(title: str, unit: str, rows: dict[str, Row], reference: str) -> None:
    base = rows[reference].rows / rows[reference].best
    print(f"\n{title}\n")
    print(f"| path | {unit} per epoch | first epoch s (with worker start-up) | later epoch s | {unit}/s | / plain |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, row in rows.items():
        rate = row.rows / row.best
        print(f"| {name} | {row.rows:,} | {row.first:.2f} | {row.best:.2f} | {rate:,.0f} | {rate / base:.2f}x |")


def split_rows(count: int) -> int:
    """Rows per split so that each worker reads four splits."""
    return max(1, -(-count // (WORKERS * 4)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--videos", type=int, default=40)
    parser.add_argument("--frames", type=int, default=64)
    parser.add_argument("--clip-batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3, help="image epochs per path, the first one untimed")
    parser.add_argument("--clip-epochs", type=int, default=5, help="clip epochs per path, the first one untimed")
    parser.add_argument("--root", type=Path, default=None, help="keep the files and tables here between runs")
    args = parser.parse_args()
    if min(args.epochs, args.clip_epochs) < 2:
        parser.error("--epochs and --clip-epochs must be at least 2: the first epoch starts the workers, untimed")
    # The forkserver's default preload (``__main__``) imports nothing of this script here, so each
    # worker would import torch again; preloading what every worker needs makes start-up cheap.
    # It applies to every loader alike and only to the untimed first epoch.
    multiprocessing.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as temporary:
        root = args.root or Path(temporary)
        images = root / f"images-{args.images}-{args.classes}"
        videos = root / f"videos-{args.videos}-{args.frames}-{args.classes}"
        began = time.perf_counter()
        if not images.exists():
            make_images(images / "files", args.images, args.classes)
            for scheme in SCHEMES:
                ingest_images(images / "files", f"{scheme}:{images / scheme}", split_rows=split_rows(args.images))
        if not videos.exists():
            make_videos(videos / "files", args.videos, args.frames, args.classes)
            for scheme in SCHEMES:
                ingest_videos(videos / "files", f"{scheme}:{videos / scheme}", split_rows=split_rows(args.videos))
        prepared = time.perf_counter() - began

        image = Image("image", size=IMAGE_SIZE, layout="CHW", dtype="float32", normalize="unit")
        image_loaders = {"plain `Dataset`, Pillow per file": loader(FolderImages(images / "files"), args.batch_size)}
        for scheme, name in SCHEMES.items():
            uri = f"{scheme}:{images / scheme}"
            image_loaders[f"`TableDataset`, {name}"] = table_loader(uri, image, args.batch_size)
        image_rows = compare(image_loaders, "image", image.shape or (), args.epochs)
        del image_loaders

        clip = Video("video", frames=FrameSlice(0, 16, 2), size=CLIP_SIZE)
        clip_loaders = {"plain `Dataset`, PyAV per file": loader(FolderClips(videos / "files"), args.clip_batch_size)}
        for scheme, name in SCHEMES.items():
            uri = f"{scheme}:{videos / scheme}"
            clip_loaders[f"`TableDataset`, {name}"] = table_loader(uri, clip, args.clip_batch_size)
        clip_rows = compare(clip_loaders, "video", clip.shape or (), args.clip_epochs)
        del clip_loaders

    print(
        f"{WORKERS} workers ({CONTEXT}, persistent) per loader; a rate is the best of epochs 2..{args.epochs} "
        f"(clips: 2..{args.clip_epochs}) of its loader, so worker start-up is excluded. "
        f"Making and ingesting the files took {prepared:.1f} s."
    )
    table(
        f"{args.images:,} JPEGs (about 256x256) in {args.classes} classes -> 3x64x64 float32, batch {args.batch_size}",
        "images",
        image_rows,
        "plain `Dataset`, Pillow per file",
    )
    table(
        f"{args.videos} H.264 MP4s ({args.frames} frames, 128x96) -> frames 0,2,..,14 at 64x48 uint8, "
        f"batch {args.clip_batch_size}",
        "clips",
        clip_rows,
        "plain `Dataset`, PyAV per file",
    )


if __name__ == "__main__":
    main()
