"""Packing: each consumer's documents joined into one token stream and cut into blocks of exactly
``length`` tokens, resumable in the middle of a document.

A document is one row's list of token ids. A consumer's stream is its documents in its work
list's order, each followed by the separator token when there is one (an empty document adds
nothing, not even a separator). A block is ``length`` consecutive tokens of the stream; a batch
is ``batch_size`` consecutive blocks. Each token's position is its place in its document,
counted from 0 at the document's first token and continuing across block boundaries, so a
block's document boundaries are where positions fall back to 0 (document masking), and a
separator takes the position after its document's last token. The stream's tail shorter than
one block is dropped and counted.

Everything is computed with numpy over the Arrow offsets and values, a piece of a read batch's
stream at a time (``PIECE_TOKENS``): no Python runs per document or per token. ``PackedDataset``
(``spiral_lightning.datasets.packing``) reads a table this way.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from spiral_lightning.core.checks import check_positive, is_int
from spiral_lightning.core.plan import WorkItem
from spiral_lightning.core.state import Cursor
from spiral_lightning.reading.frames import Last, Run, cursor_after, runs
from spiral_lightning.sources import Reader, Source

#: The version of the dictionary ``PackedDataset.state_dict`` writes.
PACKED_FORMAT = 1


#: The key of each token's position in its document in a packed batch.
POSITIONS = "positions"


Tokens = np.ndarray[Any, np.dtype[np.int64]]


#: Tokens a read batch's stream is built in at a time (rounded to whole batches, at least one):
#: pieces this size stay in the processor's cache and reuse freed memory, where building a whole
#: read batch of millions of tokens at once runs at the speed of memory and fresh pages.
PIECE_TOKENS = 1 << 16


@dataclass(frozen=True)
class Packing:
    """What a packed stream is made of: the token ids of ``column`` (a list or large list of
    integers per row), cut into blocks of ``length`` tokens, with ``separator`` (a token id) after
    each non-empty document when given. All three change the stream, so a state records them."""

    column: str
    length: int
    separator: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.column, str) or not self.column or self.column == POSITIONS:
            raise ValueError(f"Packing needs the name of a token column other than {POSITIONS!r}, not {self.column!r}")
        check_positive("the block length", self.length)
        separator = self.separator
        if separator is not None and not is_int(separator):
            raise ValueError(f"the separator must be a token id (an int) or None, not {separator!r}")

    def settings(self) -> list[Any]:
        """``[column, length, separator]``, as a state records them."""
        return [self.column, self.length, self.separator]


class PackPosition(NamedTuple):
    """Where a consumer's next block starts: the cursor of the document that holds its first
    token, and ``offset``, that document's tokens (its separator included) already delivered."""

    cursor: Cursor
    offset: int = 0


#: What finds the position after a batch of blocks: called only when a state is saved, which is
#: far rarer than a batch.
After = Callable[[], PackPosition]


class Blocks(NamedTuple):
    """Consecutive blocks of a stream: token ids and their positions, both int64 ``[blocks, length]``."""

    tokens: Tokens
    positions: Tokens


class Stream(NamedTuple):
    """The stream of one read batch's documents, described rather than built: ``values``, their
    token ids as read (viewed, not copied); ``starts`` and ``ends``, where each non-empty
    document's tokens (its separator included) start and end in the stream; ``bounds``, where
    every document's tokens end (empty ones too), for cursors; and ``begin``, the first token not
    delivered before this read batch."""

    values: np.ndarray[Any, np.dtype[Any]]
    starts: Tokens
    ends: Tokens
    bounds: Tokens
    begin: int
    separator: int | None

    @property
    def total(self) -> int:
        """The tokens of the whole stream, from its first document's first token."""
        return int(self.bounds[-1]) if len(self.bounds) else 0

    def piece(self, low: int, high: int, ramp: Tokens) -> tuple[Tokens, Tokens]:
        """Tokens ``low`` to ``high`` of the stream and their positions, both int64; ``ramp`` is
        ``0, 1, 2, ...``, reused when it is long enough."""
        size = high - low
        first = int(np.searchsorted(self.ends, low, side="right"))
        last = int(np.searchsorted(self.starts, high, side="left"))
        starts, ends = self.starts[first:last], self.ends[first:last]
        # A token's position is its place in the stream less its document's start.
        spans = np.minimum(ends, high) - np.maximum(starts, low)
        positions = np.repeat(starts - low, spans)
        np.subtract(ramp[:size] if size <= len(ramp) else np.arange(size), positions, out=positions)
        if self.separator is None:
            return self.values[low:high].astype(np.int64), positions
        # Every document ending before ``low`` put one separator before it, so this piece's values
        # start that many tokens earlier; the separators take the places the values leave.
        separators = ends[ends <= high] - 1 - low
        tokens = np.empty(size, dtype=np.int64)
        between = np.ones(size, dtype=bool)
        between[separators] = False
        held = low - first
        tokens[between] = self.values[held : held + size - len(separators)]
        tokens[separators] = self.separator
        return tokens, positions


def _documents(documents: pa.Array, where: str) -> tuple[Tokens, pa.Array]:
    """Each document's token count and the values they index, from ``offsets[0]`` on; a null
    document or token raises, naming ``where`` and the document."""
    if documents.null_count or documents.values.null_count:
        offsets = documents.offsets.to_numpy()
        values_valid = documents.values.is_valid().to_numpy(zero_copy_only=False)
        bad = ~documents.is_valid().to_numpy(zero_copy_only=False)
        counts = np.concatenate(([0], np.cumsum(~values_valid)))
        bad |= counts[offsets[1:]] > counts[offsets[:-1]]
        if bad.any():
            raise ValueError(
                f"document {int(np.argmax(bad))} of {where} is null or holds a null token, which a packed stream "
                "cannot hold; keep such rows out with a filter such as '<column> IS NOT NULL'"
            )
    offsets = documents.offsets.to_numpy().astype(np.int64)
    lengths = np.diff(offsets)
    return lengths, documents.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))


def stream_tokens(documents: pa.Array, packing: Packing, where: str) -> int:
    """The tokens ``documents`` add to a stream, separators included."""
    lengths, _ = _documents(documents, where)
    separators = 0 if packing.separator is None else int(np.count_nonzero(lengths))
    return int(lengths.sum()) + separators


def document_stream(documents: pa.Array, packing: Packing, first: int, where: str) -> Stream:
    """The stream of ``documents`` (a list array of token ids), its first ``first`` tokens delivered."""
    lengths, values = _documents(documents, where)
    if packing.separator is not None:
        lengths = lengths + (lengths > 0)
    if first and (not len(lengths) or first >= lengths[0]):
        held = int(lengths[0]) if len(lengths) else 0
        raise ValueError(
            f"the state's token offset {first} lies past the {held} tokens of the document it names ({where}); "
            "the state was edited or damaged"
        )
    bounds = np.cumsum(lengths)
    nonempty = lengths > 0
    ends = bounds[nonempty]
    return Stream(values.to_numpy(), ends - lengths[nonempty], ends, bounds, first, packing.separator)


def _after(run: Run, stream: Stream, used: int, items: Sequence[WorkItem]) -> PackPosition:
    """The position of the stream's token ``used`` (the next block's first) in ``run``."""
    document = int(np.searchsorted(stream.bounds, used, side="right"))
    if document == len(stream.bounds):
        return PackPosition(cursor_after(run, items, run.rows.num_rows))
    start = int(stream.bounds[document - 1]) if document else 0
    return PackPosition(cursor_after(run, items, document), used - start)


def read_blocks(
    reader: Reader,
    items: Sequence[WorkItem],
    position: PackPosition,
    packing: Packing,
    batch_size: int,
    last: Last,
    limit: int | None = None,
    table: str = "the table",
    piece: int = PIECE_TOKENS,
) -> Generator[tuple[Blocks, After], None, int]:
    """Batches of ``batch_size`` blocks of the stream of ``items`` from ``position`` on, each
    with what finds the position after it; returns the tokens of the stream's tail dropped for
    being shorter than a block.

    The blocks after the last full batch are one shorter batch with ``last="keep_partial"``, a
    ``ValueError`` with ``"require_full"``. With a ``limit`` the stream stops after that many
    blocks, at the position of a finished consumer. Batches inside one read batch are views of
    pieces of about ``piece`` tokens (whole batches, at least one); only the tokens of the batch
    being filled are held beyond the current read batch.
    """
    length = packing.length
    size = batch_size * length
    per_piece = max(1, piece // size)
    ramp = np.arange(per_piece * size, dtype=np.int64)
    done = partial(PackPosition, Cursor(len(items), 0))
    left = limit
    if left is not None and left <= 0:
        return 0
    # Tokens read but not yet delivered, as (tokens, positions) pieces of earlier read batches.
    held: list[tuple[Tokens, Tokens]] = []
    held_tokens = 0
    first = position.offset
    for run in runs(reader, items, position.cursor):
        item = items[run.item]
        where = f"{table}, split {item.split} from stored row {run.row} (output row {run.skip} on)"
        stream = document_stream(run.rows.column(0), packing, first, where)
        first = 0
        used, total = stream.begin, stream.total
        while held_tokens + total - used >= size:
            ready: list[tuple[Blocks, int]] = []
            if held:
                take = size - held_tokens
                held.append(stream.piece(used, used + take, ramp))
                used += take
                ready.append((_blocks(held, batch_size, length), used))
                held, held_tokens = [], 0
            else:
                count = min(per_piece, (total - used) // size)
                tokens, positions = stream.piece(used, used + count * size, ramp)
                shape = (count, batch_size, length)
                batches = zip(tokens.reshape(shape), positions.reshape(shape), strict=True)
                ready += [(Blocks(*batch), used + (index + 1) * size) for index, batch in enumerate(batches)]
                used += count * size
            for blocks, end in ready:
                if left is not None and left <= batch_size:
                    yield _head(blocks, left), done
                    return 0
                if left is not None:
                    left -= batch_size
                yield blocks, partial(_after, run, stream, end, items)
        if used < total:
            held.append(stream.piece(used, total, ramp))
            held_tokens += total - used
    whole = held_tokens // length
    if whole:
        if last == "require_full":
            raise ValueError(
                f"{whole} blocks remain after this consumer's last full batch of {batch_size} blocks; use "
                "last='keep_partial' to deliver them as a shorter batch, or a batch size that divides the blocks"
            )
        count = whole if left is None else min(whole, left)
        yield _blocks(held, count, length), done
        if count < whole:
            return 0
    return held_tokens - whole * length


def _blocks(pieces: Sequence[tuple[Tokens, Tokens]], count: int, length: int) -> Blocks:
    """The first ``count`` blocks of ``pieces`` joined; a single piece is viewed, not copied."""
    size = count * length
    if len(pieces) == 1:
        tokens, positions = pieces[0]
    else:
        tokens = np.concatenate([piece[0] for piece in pieces])
        positions = np.concatenate([piece[1] for piece in pieces])
    return Blocks(tokens[:size].reshape(count, length), positions[:size].reshape(count, length))


def _head(blocks: Blocks, count: int) -> Blocks:
    """The first ``count`` blocks of ``blocks``."""
    return Blocks(blocks.tokens[:count], blocks.positions[:count])


def count_tokens(source: Source, items: Sequence[WorkItem], packing: Packing) -> list[int]:
    """The stream tokens of each of ``items`` (separators included), reading only the token column."""
    counts = [0] * len(items)
    for batch, index, _ in source.read(items):
        item = items[index]
        where = f"{source.version}, split {item.split} (stored rows {item.start}..{item.end})"
        counts[index] += stream_tokens(batch.column(0), packing, where)
    return counts
