"""Image and video projections: which binary columns hold encoded media, and the tensors they become.

A projection (``Image`` or ``Video``) is a plain frozen value naming a column of encoded images or
videos and the tensor each row decodes to. ``decode_image`` and ``decode_clip`` decode one value;
``project`` decodes the media columns of a whole collated batch and stacks them. Decoding runs on
the CPU in the process that reads: Pillow for images (resized by torch), FFmpeg through PyAV for
video.

Sizes are ``(height, width)`` everywhere, torchvision's order and that of the tensors'
dimensions; Pillow and Spiral take width first, so the calls into them swap the pair.
"""

from __future__ import annotations

import bisect
import io
import threading
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any, NamedTuple

import av
import av.video.reformatter
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image as PILImage
from PIL import UnidentifiedImageError

from spiral_lightning.core.media import (
    ON_ERROR,
    DecodeError,
    FrameIndices,
    FrameSelection,
    FrameSlice,
    FrameTimes,
    Image,
    Media,
    OnError,
    Video,
    Where,
    check_choice,
)

# The channel statistics of ImageNet's training images, the convention of pretrained vision models.
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


def _tensor(pixels: np.ndarray[Any, Any], spec: Media) -> torch.Tensor:
    """``[..., H, W, 3]`` uint8 pixels as the tensor ``spec`` asks for: one image or clip, or a
    batch of them stacked in front, converted in one pass."""
    dtype, normalize = spec.dtype, spec.normalize
    channels_first = spec.layout in ("CHW", "TCHW")
    tensor = torch.from_numpy(pixels)
    if dtype == "float32":
        tensor = tensor.to(torch.float32)
        if normalize is not None:
            tensor = tensor / 255
        if normalize == "imagenet":
            tensor = (tensor - torch.tensor(_IMAGENET_MEAN)) / torch.tensor(_IMAGENET_STD)
    if channels_first:
        tensor = tensor.movedim(-1, -3)
    return tensor.contiguous()


def _reason(error: BaseException) -> str:
    if isinstance(error, UnidentifiedImageError):
        # Pillow's own message names the in-memory file object, which differs on every call.
        return f"{type(error).__name__}: not in a format Pillow reads"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


# What Pillow raises for data it cannot read: unknown formats (UnidentifiedImageError is an
# OSError), truncated or damaged data (OSError, SyntaxError, EOFError from format plugins) and
# images too large to be plausible (DecompressionBombError).
_IMAGE_ERRORS = (OSError, ValueError, SyntaxError, EOFError, PILImage.DecompressionBombError)


def decode_image(data: bytes, spec: Image) -> torch.Tensor:
    """One encoded image as ``spec`` asks; ``DecodeError`` with Pillow's reason otherwise."""
    return _tensor(_image_pixels(data, spec), spec)


def _image_pixels(data: bytes, spec: Image) -> np.ndarray[Any, Any]:
    """One encoded image's ``[H, W, 3]`` uint8 pixels, resized as ``spec`` asks.

    When ``spec.size`` shrinks a JPEG, the decoder's draft mode first decodes at the smallest
    scale (1/2, 1/4 or 1/8) still at least that size, which costs a fraction of a full decode.
    """
    try:
        with PILImage.open(io.BytesIO(data)) as image:
            if spec.size is not None:
                height, width = spec.size
                image.draft("RGB", (width, height))  # Pillow's sizes are (width, height)
            rgb = image.convert("RGB")
        pixels = np.array(rgb)
    except _IMAGE_ERRORS as error:
        raise DecodeError(f"not a readable image ({_reason(error)})") from error
    if spec.size is None or pixels.shape[:2] == spec.size:
        return pixels
    return _resize(pixels, spec.size)


def _resize(pixels: np.ndarray[Any, Any], size: tuple[int, int]) -> np.ndarray[Any, Any]:
    """``[H, W, 3]`` uint8 pixels resized to ``size`` (height, width), bilinear with antialiasing.

    torch's uint8 kernel computes Pillow's ``BILINEAR`` resampling to within one level per pixel
    in about half of Pillow's time.
    """
    image = torch.from_numpy(pixels).permute(2, 0, 1).unsqueeze(0)
    resized = F.interpolate(image, size=size, mode="bilinear", antialias=True, align_corners=False)
    return resized[0].permute(1, 2, 0).numpy()


class _Index(NamedTuple):
    """A video stream's packets in decode order and its frames' presentation timestamps sorted,
    so frame ``i`` (in presentation order) has timestamp ``pts[i]``; ``end`` is the timestamp
    just after the last frame, all in units of ``time_base`` seconds."""

    packets: list[av.Packet[Any]]
    pts: list[int]
    end: int
    time_base: Fraction

    def seconds(self, pts: int) -> float:
        return float((pts - self.pts[0]) * self.time_base)

    def at(self, seconds: float) -> int:
        """The frame on screen ``seconds`` after the first frame; times are rounded to the
        nearest tick of the time base, so a time written in decimal lands on its frame."""
        target = self.pts[0] + round(seconds / self.time_base)
        if target >= self.end:
            raise DecodeError(f"time {seconds}s is past the end of the video ({self.seconds(self.end)}s long)")
        return bisect.bisect_right(self.pts, target) - 1


def _index(container: av.container.InputContainer, stream: av.VideoStream) -> _Index:
    # Demuxing reads only packet headers, not pixels: it gives the exact frame count and
    # presentation order up front, and the packets to decode from a keyframe onwards.
    packets = [packet for packet in container.demux(stream) if packet.size > 0]
    if stream.frames and len(packets) < stream.frames:
        # The container's own index lists every frame; fewer on the wire means the data was cut.
        raise DecodeError(
            f"the video is truncated: its container lists {stream.frames} frames, the data holds {len(packets)}"
        )
    # Packets outside the container's edit list decode but are never shown, so they are no frame.
    shown = [packet for packet in packets if not packet.is_discard]
    if not shown:
        raise DecodeError("the video stream holds no frames")
    if any(packet.pts is None for packet in shown):
        raise DecodeError("the video's frames carry no timestamps; remux it into MP4")
    pts = sorted(packet.pts for packet in shown if packet.pts is not None)
    last = max(shown, key=lambda packet: packet.pts or 0)
    duration = last.duration or (pts[-1] - pts[-2] if len(pts) > 1 else 1)
    time_base = stream.time_base or Fraction(1, 1)
    return _Index(packets, pts, pts[-1] + duration, Fraction(time_base))


def _wanted(frames: FrameSelection, index: _Index) -> list[int]:
    """The presentation indices ``frames`` selects, in output order."""
    count = len(index.pts)
    if isinstance(frames, FrameSlice):
        stop = count if frames.stop is None else frames.stop
        if stop > count or frames.start >= count:
            raise DecodeError(f"{frames} reaches past the end: the video has {count} frames")
        return list(range(frames.start, stop, frames.step))
    if isinstance(frames, FrameIndices):
        beyond = sorted({index for index in frames.indices if index >= count})
        if beyond:
            raise DecodeError(f"frames {beyond} are past the end: the video has {count} frames")
        return list(frames.indices)
    if isinstance(frames, FrameTimes):
        return [index.at(seconds) for seconds in frames.seconds]
    span = frames.step * (frames.count - 1)
    if span >= count:
        raise DecodeError(f"{frames} spans {span + 1} frames but the video has {count}")
    centre = index.at(frames.time)
    first = min(max(centre - frames.step * (frames.count // 2), 0), count - 1 - span)
    return list(range(first, first + span + 1, frames.step))


# One scaler per thread, kept across frames and clips. ``VideoFrame.to_ndarray(width=...)`` makes
# a new swscale context (and its thread pool) for every frame, which costs many times the scaling
# of a small frame; a kept one re-initializes only when a frame's size or format changes.
_scalers = threading.local()


def _scaler() -> av.video.reformatter.VideoReformatter:
    scaler: av.video.reformatter.VideoReformatter | None = getattr(_scalers, "scaler", None)
    if scaler is None:
        scaler = _scalers.scaler = av.video.reformatter.VideoReformatter()
    return scaler


def _decode(stream: av.VideoStream, index: _Index, wanted: list[int], spec: Video) -> dict[int, np.ndarray[Any, Any]]:
    """The wanted frames' RGB pixels by presentation index, decoding from the last keyframe at
    or before the first wanted frame and stopping once the last wanted frame is out."""
    by_pts = {index.pts[frame]: frame for frame in wanted}
    first, last = min(by_pts), max(by_pts)
    start = 0
    for position, candidate in enumerate(index.packets):
        if candidate.is_keyframe and candidate.pts is not None and candidate.pts <= first:
            start = position
    height, width = spec.size if spec.size is not None else (None, None)
    context = stream.codec_context
    scaler = _scaler()
    pixels: dict[int, np.ndarray[Any, Any]] = {}
    flush: list[av.Packet[Any] | None] = [None]
    for packet in [*index.packets[start:], *flush]:
        # Decoders return frames in presentation order, so the first frame at or after the last
        # wanted timestamp ends the clip; None flushes the frames the decoder still holds.
        for frame in context.decode(packet):
            if frame.pts in by_pts:
                rgb = scaler.reformat(frame, width=width, height=height, format="rgb24", interpolation="BILINEAR")
                pixels[by_pts[frame.pts]] = rgb.to_ndarray()
            if frame.pts is not None and frame.pts >= last:
                return pixels
    return pixels


def decode_clip(data: bytes, spec: Video) -> torch.Tensor:
    """The frames ``spec`` selects from one encoded video; ``DecodeError`` with FFmpeg's reason,
    or naming the frames past the end, otherwise."""
    return _tensor(_clip_pixels(data, spec), spec)


def _clip_pixels(data: bytes, spec: Video) -> np.ndarray[Any, Any]:
    """The ``[T, H, W, 3]`` uint8 pixels of the frames ``spec`` selects from one encoded video."""
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise DecodeError("the data holds no video stream")
            stream = container.streams.video[0]
            index = _index(container, stream)
            wanted = _wanted(spec.frames, index)
            pixels = _decode(stream, index, wanted, spec)
    except DecodeError:
        raise
    except (av.FFmpegError, OSError, ValueError) as error:
        raise DecodeError(f"not a readable video ({_reason(error)})") from error
    missing = sorted(set(wanted) - set(pixels))
    if missing:
        raise DecodeError(f"frames {missing} did not decode; the video is truncated or damaged")
    return np.stack([pixels[frame] for frame in wanted])


def _pixels(data: bytes, spec: Media) -> np.ndarray[Any, Any]:
    """One encoded value's uint8 pixels: an image's ``[H, W, 3]`` or a clip's ``[T, H, W, 3]``."""
    return _image_pixels(data, spec) if isinstance(spec, Image) else _clip_pixels(data, spec)


def stack(pixels: Sequence[np.ndarray[Any, Any]], spec: Media) -> torch.Tensor | list[torch.Tensor]:
    """Decoded rows' uint8 pixels as one ``[B, ...]`` tensor when their shapes match, else as a
    list of tensors; rows of one shape are converted together, which costs far less per row.

    No rows give a ``[0, ...]`` tensor when ``spec`` fixes the shape, else an empty list.
    """
    if not pixels:
        shape = spec.shape
        dtype = torch.uint8 if spec.dtype == "uint8" else torch.float32
        return [] if shape is None else torch.empty((0, *shape), dtype=dtype)
    first = pixels[0].shape
    if all(array.shape == first for array in pixels):
        return _tensor(np.stack(pixels), spec)
    return [_tensor(array, spec) for array in pixels]


class Skipped(NamedTuple):
    """A row that ``project(..., on_error="skip")`` dropped: its position in the batch it was
    given, the first media column that failed, and the decoder's reason."""

    position: int
    column: str
    reason: str


class Projected(NamedTuple):
    """What ``project`` returns: the batch with its media decoded (and skipped rows dropped from
    every column), and the rows it skipped in position order (always empty with ``"raise"``)."""

    batch: dict[str, Any]
    skipped: tuple[Skipped, ...]


def _payloads(batch: Mapping[str, Any], column: str) -> list[Any]:
    if column not in batch:
        raise ValueError(f"media column {column!r} is not in the batch, which has {sorted(batch)}")
    value = batch[column]
    # An Arrow binary array (before collation) or the list of bytes ``to_torch`` makes of one.
    values = value.to_pylist() if hasattr(value, "to_pylist") else value
    if not isinstance(values, list | tuple):
        raise TypeError(f"media column {column!r} must hold encoded bytes per row, not a {type(value).__name__}")
    for data in values:
        if data is not None and not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError(f"media column {column!r} must hold encoded bytes per row, not {type(data).__name__}")
    return list(values)


def _keep(name: str, value: Any, keep: list[int], rows: int) -> Any:
    """``value``, one entry per row, with only the rows at positions ``keep``."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows:
        return value[torch.tensor(keep, dtype=torch.long)]
    if isinstance(value, list | tuple) and len(value) == rows:
        return [value[position] for position in keep]
    raise TypeError(f"cannot drop rows from column {name!r}: it is not a tensor or list of {rows} rows")


def project(
    batch: Mapping[str, Any],
    media: Sequence[Media],
    where: Where,
    *,
    on_error: OnError = "raise",
) -> Projected:
    """``batch`` with each projected column decoded: one ``[B, ...]`` tensor when every row's
    tensor has the same shape, else a list of tensors (see ``stack``). Other columns pass through.

    A media column holds one encoded value per row: the list of bytes ``to_torch`` makes of a
    binary column, or the Arrow array itself. A row that cannot be decoded (or is null) raises a
    ``DecodeError`` naming the table, column, row and reason, or with ``on_error="skip"`` is
    dropped from every column and reported in ``Projected.skipped``. Which rows are dropped depends
    only on their bytes, so a re-read drops the same rows, and ``len(skipped)`` is the count.
    """
    check_choice("on_error", on_error, ON_ERROR)
    columns = [spec.column for spec in media]
    twice = sorted({column for column in columns if columns.count(column) > 1})
    if twice:
        raise ValueError(f"columns {twice} are projected more than once; give each media column one projection")
    skipped: dict[int, Skipped] = {}
    decoded: dict[str, list[np.ndarray[Any, Any] | None]] = {}
    rows = 0
    for spec in media:
        payloads = _payloads(batch, spec.column)
        rows = len(payloads)
        arrays: list[np.ndarray[Any, Any] | None] = []
        for position, data in enumerate(payloads):
            if position in skipped:
                arrays.append(None)
                continue
            try:
                if data is None:
                    raise DecodeError("the value is null")
                arrays.append(_pixels(bytes(data), spec))
            except DecodeError as error:
                if on_error == "raise":
                    raise DecodeError(
                        f"cannot decode column {spec.column!r} of {where.table}, {where.name(position)}: "
                        f"{error}; {where.remedy()}"
                    ) from error
                skipped[position] = Skipped(position, spec.column, str(error))
                arrays.append(None)
        decoded[spec.column] = arrays
    keep = [position for position in range(rows) if position not in skipped]
    projected = {
        name: _keep(name, value, keep, rows) if skipped and name not in decoded else value
        for name, value in batch.items()
    }
    for spec in media:
        kept = [array for position, array in enumerate(decoded[spec.column]) if position not in skipped]
        projected[spec.column] = stack([array for array in kept if array is not None], spec)
    return Projected(projected, tuple(skipped[position] for position in sorted(skipped)))
