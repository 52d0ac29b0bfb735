"""Media projections: which encoded column decodes to which tensors (``Image``, ``Video``, the
frame selections). Values only; the decoding lives in ``spiral_lightning.media.decode``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

from spiral_lightning.core.checks import check_count, check_positive

Dtype = Literal["uint8", "float32"]


Normalize = Literal["unit", "imagenet"]


#: What ``project`` does with a row it cannot decode: raise, or drop the row and report it.
OnError = Literal["raise", "skip"]


ON_ERROR: tuple[OnError, ...] = ("raise", "skip")


_DTYPES: tuple[Dtype, ...] = ("uint8", "float32")


_NORMALIZE: tuple[Normalize, ...] = ("unit", "imagenet")


class DecodeError(ValueError):
    """A value that cannot be decoded as the projection asks, with the decoder's reason."""


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite, non-negative number of seconds, not {value!r}")
    return float(value)


def _sequence(name: str, value: Any) -> tuple[Any, ...]:
    # YAML gives lists where Python code gives tuples; both become tuples so specs stay hashable.
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"{name} must be a non-empty list, not {value!r}")
    return tuple(value)


def check_choice(name: str, value: Any, options: tuple[Any, ...]) -> None:
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
        check_count("FrameSlice.start", self.start)
        check_positive("FrameSlice.step", self.step)
        if self.stop is not None and check_count("FrameSlice.stop", self.stop) <= self.start:
            raise ValueError(f"FrameSlice.stop ({self.stop}) must be after start ({self.start})")


@dataclass(frozen=True)
class FrameIndices:
    """The frames at these presentation indices (0 is the first frame shown), in this order,
    repeats allowed."""

    indices: tuple[int, ...]

    def __post_init__(self) -> None:
        indices = _sequence("FrameIndices.indices", self.indices)
        for index in indices:
            check_count("a frame index", index)
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
        check_positive("FrameNeighborhood.count", self.count)
        check_positive("FrameNeighborhood.step", self.step)


#: Which frames of a video a ``Video`` projection decodes.
FrameSelection: TypeAlias = FrameSlice | FrameIndices | FrameTimes | FrameNeighborhood


def _size(name: str, value: Any) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(f"{name} must be (height, width), not {value!r}")
    return (check_positive(f"{name} height", value[0]), check_positive(f"{name} width", value[1]))


def _check_pixels(kind: str, dtype: Any, normalize: Any) -> None:
    check_choice(f"{kind}.dtype", dtype, _DTYPES)
    if normalize is not None:
        check_choice(f"{kind}.normalize", normalize, _NORMALIZE)
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
        check_choice("Image.layout", self.layout, ("HWC", "CHW"))
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
        check_choice("Video.layout", self.layout, ("THWC", "TCHW"))
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
