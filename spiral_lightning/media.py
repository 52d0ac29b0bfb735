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
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal, NamedTuple, TypeAlias

import av
import av.video.reformatter
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image as PILImage
from PIL import UnidentifiedImageError

Dtype = Literal["uint8", "float32"]
Normalize = Literal["unit", "imagenet"]
#: What ``project`` does with a row it cannot decode: raise, or drop the row and report it.
OnError = Literal["raise", "skip"]
ON_ERROR: tuple[OnError, ...] = ("raise", "skip")

_DTYPES: tuple[Dtype, ...] = ("uint8", "float32")
_NORMALIZE: tuple[Normalize, ...] = ("unit", "imagenet")
# The channel statistics of ImageNet's training images, the convention of pretrained vision models.
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


class DecodeError(ValueError):
    """A value that cannot be decoded as the projection asks, with the decoder's reason."""


def _int(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int of at least {least}, not {value!r}")
    return value


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite, non-negative number of seconds, not {value!r}")
    return float(value)


def _sequence(name: str, value: Any) -> tuple[Any, ...]:
    # YAML gives lists where Python code gives tuples; both become tuples so specs stay hashable.
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"{name} must be a non-empty list, not {value!r}")
    return tuple(value)


def _choice(name: str, value: Any, options: tuple[Any, ...]) -> None:
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, not {value!r}")


@dataclass(frozen=True)
class FrameSlice:
    """Frames ``start``, ``start + step``, ... before ``stop`` in presentation order (to the last
    frame when ``stop`` is ``None``); every selected frame must exist."""

    start: int = 0
    stop: int | None = None
    step: int = 1

    def __post_init__(self) -> None:
        _int("FrameSlice.start", self.start, 0)
        _int("FrameSlice.step", self.step, 1)
        if self.stop is not None and _int("FrameSlice.stop", self.stop, 0) <= self.start:
            raise ValueError(f"FrameSlice.stop ({self.stop}) must be after start ({self.start})")


@dataclass(frozen=True)
class FrameIndices:
    """The frames at these presentation indices (0 is the first frame shown), in this order,
    repeats allowed."""

    indices: tuple[int, ...]

    def __post_init__(self) -> None:
        indices = _sequence("FrameIndices.indices", self.indices)
        for index in indices:
            _int("a frame index", index, 0)
        object.__setattr__(self, "indices", indices)


@dataclass(frozen=True)
class FrameTimes:
    """For each time, in seconds after the first frame, the frame on screen then: the last frame
    shown at or before it. A time at or after the end of the last frame is an error."""

    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        seconds = tuple(_seconds("a frame time", value) for value in _sequence("FrameTimes.seconds", self.seconds))
        object.__setattr__(self, "seconds", seconds)


@dataclass(frozen=True)
class FrameNeighborhood:
    """``count`` frames ``step`` apart around the frame on screen at ``time`` seconds, that frame at
    position ``count // 2``; near either end the window shifts to stay inside the video, so a clip
    always has ``count`` frames (a video shorter than the window is an error)."""

    time: float
    count: int
    step: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "time", _seconds("FrameNeighborhood.time", self.time))
        _int("FrameNeighborhood.count", self.count, 1)
        _int("FrameNeighborhood.step", self.step, 1)


#: Which frames of a video a ``Video`` projection decodes.
FrameSelection: TypeAlias = FrameSlice | FrameIndices | FrameTimes | FrameNeighborhood


def _size(name: str, value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(f"{name} must be (height, width), not {value!r}")
    return (_int(f"{name} height", value[0], 1), _int(f"{name} width", value[1], 1))


def _check_pixels(kind: str, dtype: Any, normalize: Any) -> None:
    _choice(f"{kind}.dtype", dtype, _DTYPES)
    if normalize is not None:
        _choice(f"{kind}.normalize", normalize, _NORMALIZE)
        if dtype != "float32":
            raise ValueError(f"{kind}.normalize={normalize!r} needs dtype='float32'; uint8 holds only 0..255")


@dataclass(frozen=True)
class Image:
    """Decode ``column``'s encoded images (JPEG, PNG, anything Pillow reads) into RGB tensors.

    ``size`` is ``(height, width)``, as in torchvision: every image is resized to exactly that
    (bilinear with antialiasing, aspect ratio not kept), so a batch stacks into one tensor;
    ``None`` keeps each image's own size.
    ``layout`` orders height, width and channels. ``dtype="uint8"`` keeps values 0..255;
    ``"float32"`` converts them, and ``normalize`` then maps them: ``"unit"`` to 0..1,
    ``"imagenet"`` to 0..1 less ImageNet's channel means, divided by its standard deviations.
    """

    column: str
    size: tuple[int, int] | None = None
    layout: Literal["HWC", "CHW"] = "HWC"
    dtype: Dtype = "uint8"
    normalize: Normalize | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.column, str) or not self.column:
            raise ValueError(f"Image.column must be a column name, not {self.column!r}")
        object.__setattr__(self, "size", _size("Image.size", self.size))
        _choice("Image.layout", self.layout, ("HWC", "CHW"))
        _check_pixels("Image", self.dtype, self.normalize)

    @property
    def shape(self) -> tuple[int, ...] | None:
        """The shape of every decoded image, known when ``size`` is set."""
        if self.size is None:
            return None
        height, width = self.size
        return (height, width, 3) if self.layout == "HWC" else (3, height, width)


@dataclass(frozen=True)
class Video:
    """Decode the ``frames`` of ``column``'s encoded videos (H.264 in MP4, anything FFmpeg reads)
    into one RGB clip tensor per row.

    Frames are counted in presentation order, as they are shown, whatever order the codec stores
    them in. ``size``, ``dtype`` and ``normalize`` mean what they mean for ``Image``; ``layout``
    orders time, height, width and channels.
    """

    column: str
    frames: FrameSelection
    size: tuple[int, int] | None = None
    layout: Literal["THWC", "TCHW"] = "THWC"
    dtype: Dtype = "uint8"
    normalize: Normalize | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.column, str) or not self.column:
            raise ValueError(f"Video.column must be a column name, not {self.column!r}")
        if not isinstance(self.frames, FrameSlice | FrameIndices | FrameTimes | FrameNeighborhood):
            raise ValueError(
                f"Video.frames must be a FrameSlice, FrameIndices, FrameTimes or FrameNeighborhood, not {self.frames!r}"
            )
        object.__setattr__(self, "size", _size("Video.size", self.size))
        _choice("Video.layout", self.layout, ("THWC", "TCHW"))
        _check_pixels("Video", self.dtype, self.normalize)

    @property
    def length(self) -> int | None:
        """The frames in every clip, known unless the selection runs to the end of each video."""
        frames = self.frames
        if isinstance(frames, FrameSlice):
            return None if frames.stop is None else len(range(frames.start, frames.stop, frames.step))
        if isinstance(frames, FrameIndices):
            return len(frames.indices)
        if isinstance(frames, FrameTimes):
            return len(frames.seconds)
        return frames.count

    @property
    def shape(self) -> tuple[int, ...] | None:
        """The shape of every decoded clip, known when ``size`` and ``length`` are."""
        length = self.length
        if self.size is None or length is None:
            return None
        height, width = self.size
        return (length, height, width, 3) if self.layout == "THWC" else (length, 3, height, width)


#: A projection of one media column.
Media: TypeAlias = Image | Video


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


@dataclass(frozen=True)
class Where:
    """Where a batch came from, for error messages: the table's uri, and the number the caller
    gives the batch's first row (row ``first_row + i`` is the batch's position ``i``), or instead
    the dataset index of each row when they are not consecutive (a map-style read)."""

    table: str
    first_row: int = 0
    indices: tuple[int, ...] | None = None

    def name(self, position: int) -> str:
        """How an error names the batch's row at ``position``."""
        if self.indices is None:
            return f"row {self.first_row + position} (position {position} of its batch)"
        return f"index {self.indices[position]}"

    def remedy(self) -> str:
        """What to do about a row that does not decode; a map-style read gives every index its
        row, so it has no rows to skip instead."""
        if self.indices is None:
            return "fix or remove the row, or pass on_error='skip' to drop rows that do not decode"
        return "fix or remove the row (a map-style read must give every index its row, so it cannot skip it)"


def left_to_decode(media: Sequence[Media], decoded: frozenset[str]) -> list[Media]:
    """The projections of ``media`` that still need decoding: a source decodes some columns
    itself (a Spiral scan turns pixel columns into tensors), and those pass through."""
    return [item for item in media if item.column not in decoded]


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
    _choice("on_error", on_error, ON_ERROR)
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
