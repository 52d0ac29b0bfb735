"""Ingest: a folder of images or videos in the class-per-subfolder layout, written as a new table.

The layout is ``SRC/<class name>/**/<file>``: each folder directly under ``SRC`` is a class, and
every file below it (hidden ones aside) is one row. A row holds the file's ``path`` relative to
``SRC``, its ``label`` (the class's index in sorted class-name order) and the file's bytes,
unchanged, in a binary ``image`` or ``video`` column. The class names are kept in the schema's
metadata under ``CLASSES_KEY``. Every file is decoded once as it is read: one that does not
decode (and, for videos, a still image) is left out of the table, listed on stderr once the
progress bar closes, and in the report, never dropped silently. A destination that is not empty,
and a folder in which no file decodes, are refused before anything is written.
"""

from __future__ import annotations

import io
import itertools
import json
import sys
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import av
import pyarrow as pa
from tqdm import tqdm  # type: ignore[import-untyped]

from spiral_lightning.core.media import DecodeError, FrameIndices, Image, Video
from spiral_lightning.core.spec import TableSpec
from spiral_lightning.media.decode import decode_clip, decode_image
from spiral_lightning.sources.ingest_files import check_destination
from spiral_lightning.sources.write import write_table

#: The schema metadata key holding the class names, a JSON list in label order.
CLASSES_KEY = b"spiral_lightning.classes"

# Rows are written in batches of at most this many bytes, so a folder of any size streams
# through in bounded memory.
_BATCH_BYTES = 32 << 20


class BadFile(NamedTuple):
    """A file left out of the table: its path relative to the source folder, and why."""

    path: str
    reason: str


@dataclass(frozen=True)
class IngestReport:
    """What an ingest wrote: the table's exact version, its rows, the class names in label order,
    and the files left out because they do not decode."""

    spec: TableSpec
    rows: int
    classes: tuple[str, ...]
    bad: tuple[BadFile, ...]


def class_names(src: Path) -> tuple[str, ...]:
    """The classes of a class-per-subfolder folder: its visible subfolders' names, sorted."""
    if not src.is_dir():
        raise FileNotFoundError(f"{str(src)!r} is not a folder; ingest reads a folder with one subfolder per class")
    names = tuple(sorted(path.name for path in src.iterdir() if path.is_dir() and not path.name.startswith(".")))
    if not names:
        raise ValueError(f"{str(src)!r} has no class subfolders; put each class's files in SRC/<class name>/")
    return names


def _files(src: Path, classes: Sequence[str]) -> list[tuple[str, int]]:
    """Every visible file under each class folder as (path relative to ``src``, label), in label
    order and then path order, so the table's row order depends only on the folder."""
    files: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        found = []
        for path in (src / name).rglob("*"):
            relative = path.relative_to(src)
            if path.is_file() and not any(part.startswith(".") for part in relative.parts):
                found.append(relative.as_posix())
        files.extend((path, label) for path in sorted(found))
    return files


def classes_of(schema: pa.Schema) -> tuple[str, ...]:
    """The class names an ingest kept in ``schema``'s metadata, in label order."""
    metadata = schema.metadata or {}
    if CLASSES_KEY not in metadata:
        raise ValueError(f"the schema keeps no class names (no {CLASSES_KEY.decode()!r} metadata)")
    names: list[str] = json.loads(metadata[CLASSES_KEY])
    return tuple(names)


class FolderRows:
    """The rows of a class-per-subfolder folder as a stream of Arrow batches under ``schema``.

    Each file is read and checked as ``reader()`` reaches it; the ones that do not decode are
    collected in ``bad`` instead of becoming rows, and printed once the pass ends. ``rows``
    counts the rows streamed.
    """

    def __init__(self, src: Path, column: str, check: Callable[[bytes], Any], progress: bool) -> None:
        self.src = src
        self.column = column
        self.check = check
        self.classes = class_names(src)
        self.files = _files(src, self.classes)
        if not self.files:
            raise ValueError(
                f"the class folders of {str(src)!r} hold no files; put each class's files in SRC/<class name>/"
            )
        self.bad: list[BadFile] = []
        self.rows = 0
        self._pass: Generator[tuple[str, int, bytes], None, None] | None = None
        self.progress = progress
        self.schema = pa.schema(
            [("path", pa.string()), ("label", pa.int64()), (column, pa.binary())],
            metadata={CLASSES_KEY: json.dumps(list(self.classes))},
        )

    def reader(self) -> pa.RecordBatchReader:
        """The rows, read lazily in one pass over the folder once the first file that decodes is
        found; ``ValueError`` when none does, before a writer could make an empty table."""
        files = self._pass = self._readable()
        first = next(files, None)
        if first is None:
            raise ValueError(
                f"none of the {len(self.files)} files under {str(self.src)!r} is a readable {self.column}, so "
                "nothing was written; each is listed above with why it was left out"
            )
        return pa.RecordBatchReader.from_batches(self.schema, self._batches(itertools.chain([first], files)))

    def close(self) -> None:
        """End the pass ``reader()`` began, and its progress bar, when a writer stops early."""
        if self._pass is not None:
            self._pass.close()

    def _readable(self) -> Generator[tuple[str, int, bytes], None, None]:
        """Each file that decodes as (path, label, bytes), under a progress bar; the list of the
        others is printed after the bar closes, where it cannot break the bar's line."""
        with tqdm(total=len(self.files), unit="file", desc=f"ingest {self.column}", disable=not self.progress) as bar:
            for path, label in self.files:
                try:
                    data = (self.src / path).read_bytes()
                    self.check(data)
                except (OSError, DecodeError) as error:
                    self.bad.append(BadFile(path, str(error)))
                    bar.update(1)
                else:
                    bar.update(1)
                    yield path, label, data
        for bad in self.bad:
            print(f"left out {bad.path}: {bad.reason}", file=sys.stderr)

    def _batches(self, files: Iterable[tuple[str, int, bytes]]) -> Iterator[pa.RecordBatch]:
        paths: list[str] = []
        labels: list[int] = []
        payloads: list[bytes] = []
        held = 0
        for path, label, data in files:
            paths.append(path)
            labels.append(label)
            payloads.append(data)
            held += len(data)
            if held >= _BATCH_BYTES:
                yield self._batch(paths, labels, payloads)
                paths, labels, payloads, held = [], [], [], 0
        if paths:
            yield self._batch(paths, labels, payloads)

    def _batch(self, paths: list[str], labels: list[int], payloads: list[bytes]) -> pa.RecordBatch:
        self.rows += len(paths)
        return pa.record_batch(
            [pa.array(paths, pa.string()), pa.array(labels, pa.int64()), pa.array(payloads, pa.binary())],
            schema=self.schema,
        )


# A video that indexes fully and decodes its first frame is one ``decode_clip`` can read.
_FIRST_FRAME = Video("video", frames=FrameIndices((0,)))

# FFmpeg's still-image demuxers: image2 and image2pipe, and one ``<codec>_pipe`` per image format
# (jpeg_pipe, png_pipe, webp_pipe, ...).
_STILL_IMAGE_DEMUXERS = ("image2", "image2pipe")


def _check_video(data: bytes) -> None:
    """Decode a video's first frame; ``DecodeError`` for a still image, which FFmpeg opens as a
    one-frame video that every clip of more frames would fail on later."""
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            demuxer = container.format
    except (av.FFmpegError, OSError, ValueError):
        demuxer = None  # decode_clip names the fault
    if demuxer is not None and (demuxer.name in _STILL_IMAGE_DEMUXERS or demuxer.name.endswith("_pipe")):
        raise DecodeError(
            f"an image, not a video (FFmpeg reads it as {demuxer.long_name!r}); ingest it with 'ingest images'"
        )
    decode_clip(data, _FIRST_FRAME)


def read_folder(src: str | Path, kind: Literal["images", "videos"], *, progress: bool = True) -> FolderRows:
    """The rows of the class-per-subfolder folder ``src``: images checked with Pillow into an
    ``image`` column, or videos checked with PyAV into a ``video`` column."""
    if kind == "images":
        return FolderRows(Path(src), "image", lambda data: decode_image(data, Image("image")), progress)
    if kind == "videos":
        return FolderRows(Path(src), "video", _check_video, progress)
    raise ValueError(f"kind must be 'images' or 'videos', not {kind!r}")


def _ingest(rows: FolderRows, dest_uri: str, split_rows: int) -> IngestReport:
    check_destination(dest_uri)
    reader = rows.reader()
    try:
        spec = write_table(dest_uri, reader, split_rows=split_rows)
    finally:
        # A writer that fails part way leaves the pass open, and its progress bar on the screen.
        rows.close()
    return IngestReport(spec, rows.rows, rows.classes, tuple(rows.bad))


def ingest_images(src: str | Path, dest_uri: str, *, split_rows: int = 10_000, progress: bool = True) -> IngestReport:
    """Write the images of the class-per-subfolder folder ``src`` as a new table at ``dest_uri``
    with columns ``path``, ``label`` and ``image`` (the encoded bytes), one split per
    ``split_rows`` rows. Files Pillow cannot decode are left out and listed in the report."""
    return _ingest(read_folder(src, "images", progress=progress), dest_uri, split_rows)


def ingest_videos(src: str | Path, dest_uri: str, *, split_rows: int = 1_000, progress: bool = True) -> IngestReport:
    """Write the videos of the class-per-subfolder folder ``src`` as a new table at ``dest_uri``
    with columns ``path``, ``label`` and ``video`` (the encoded bytes), one split per
    ``split_rows`` rows. Files whose stream does not index or whose first frame does not decode,
    and still images (JPEG, PNG, ...), are left out and listed in the report."""
    return _ingest(read_folder(src, "videos", progress=progress), dest_uri, split_rows)
