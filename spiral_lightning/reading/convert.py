"""What a consumer's frames become: tensors (or what its collate makes), with errors that name the row.

A frame is converted on its own (``frame_converter``) or, where a DataLoader worker sends its
batches in groups, with the frames after it (``group_pieces``): the group is converted stretch by
stretch of its read batches and copied once into shared memory, instead of a conversion and a
copy per batch, each batch then a slice of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import torch

from spiral_lightning.core.media import Where
from spiral_lightning.core.sequences import Padded, TooLong
from spiral_lightning.reading.frames import Frame, Part
from spiral_lightning.reading.tensors import Batch, BatchSlices, NullError, Nulls, sliceable, to_torch

#: Converts a frame whose first row is the given row of the consumer's stream.
Converter = Callable[[Frame, int], Any]


def frame_converter(
    collate: Callable[[pa.RecordBatch], Any], nulls: Nulls, padded: Sequence[Padded], table: str
) -> Converter:
    """``collate`` of a frame's rows; a null that ``nulls`` leaves, or a row too long for its
    padded column, raises naming ``table`` and the row."""
    # Most frames are one slice of one read batch; converting each read batch once and slicing
    # its tensors costs a fraction of converting every frame.
    slices = BatchSlices(nulls, padded)

    def rows(frame: Frame) -> Any:
        if collate is not to_torch:
            return collate(frame.rows())
        if len(frame.parts) == 1:
            return slices(*frame.parts[0])
        return to_torch(frame.rows(), nulls, padded)

    def convert(frame: Frame, first_row: int) -> Any:
        try:
            return rows(frame)
        except (NullError, TooLong) as error:
            raise error.located(f"{table}, {Where(table, first_row).name(error.position)}") from None

    return convert


def joined(frames: Sequence[Frame]) -> Frame:
    """``frames`` laid end to end as one frame, a part that continues the one before it in the
    same chunk merged into it."""
    parts: list[Part] = []
    for part in (part for frame in frames for part in frame.parts):
        last = parts[-1] if parts else None
        if last is not None and last.rows is part.rows and last.offset + last.length == part.offset:
            parts[-1] = last._replace(length=last.length + part.length)
        else:
            parts.append(part)
    return Frame(tuple(parts), sum(frame.num_rows for frame in frames))


def group_pieces(frames: Sequence[Frame], nulls: Nulls, padded: Sequence[Padded]) -> list[Batch] | None:
    """The rows of ``frames`` laid end to end, as the ``to_torch`` of each *piece* (a stretch of
    one read batch, see ``joined``): a tensor column's pieces are the tensor of the whole group cut
    by rows, and a list column's its list. ``None`` where a frame's own conversion would not be the
    slice of the group's that holds its rows (``tensors.sliceable``), or a tensor column changes
    its dtype or row shape from piece to piece: convert the frames one by one.

    The pieces are views of the read batches; copied end to end into the block a worker sends
    (``transfer.handed_on_pieces``), they cost one copy, where joining the read batches first
    (Arrow's concat) would add another."""
    pieces: list[Batch] = []
    for part in joined(frames).parts:
        piece = sliceable(part.rows.slice(part.offset, part.length), nulls, padded)
        if piece is None:
            return None
        pieces.append(piece)
    for name, value in pieces[0].items():
        if isinstance(value, torch.Tensor):
            row = (value.dtype, value.shape[1:])
            if any(not isinstance(p[name], torch.Tensor) or (p[name].dtype, p[name].shape[1:]) != row for p in pieces):
                return None
        elif not isinstance(value, list):
            return None
    return pieces


class FrameBytes:
    """About the bytes of a frame's rows, called frame after frame: each part's share of its
    chunk's Arrow buffers, whose size is taken once per chunk (it walks every buffer)."""

    def __init__(self) -> None:
        self._chunk: pa.RecordBatch | None = None
        self._per_row = 0.0

    def __call__(self, frame: Frame) -> int:
        held = 0.0
        for part in frame.parts:
            if part.rows is not self._chunk:
                self._chunk, self._per_row = part.rows, part.rows.nbytes / max(part.rows.num_rows, 1)
            held += self._per_row * part.length
        return int(held)
