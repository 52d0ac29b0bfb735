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
stream at a time (``PIECE_TOKENS``): no Python runs per document or per token.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import torch

from spiral_lightning.dataset import DEFAULT_READ_AHEAD, TableDataset
from spiral_lightning.frames import Last, Run, cursor_after, runs, start_of
from spiral_lightning.lists import every_shard
from spiral_lightning.sources import Reader, Source
from spiral_lightning.spec import TableSpec, as_spec
from spiral_lightning.state import Cursor, State, check_cursor, check_saved
from spiral_lightning.transfer import handed_on
from spiral_lightning.work import Policy, Shard, WorkItem, policy_name, stripe

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
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 1:
            raise ValueError(f"the block length must be a positive int, not {self.length!r}")
        separator = self.separator
        if separator is not None and (isinstance(separator, bool) or not isinstance(separator, int)):
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


class PackedDataset(TableDataset):
    """Batches of ``batch_size`` blocks of exactly ``length`` tokens from the token column
    ``column``, each consumer packing its own work list's documents in order (see the module).

    A batch is ``{column: int64 [batch_size, length], "positions": int64 [batch_size, length]}``;
    other columns are not read. ``separator`` (a token id) follows each non-empty document when
    given. Every token of a consumer's documents is delivered once, in order, except its tail
    shorter than one block, which is dropped: ``dropped`` holds its tokens once the consumer's
    pass ends, and ``tokens`` counts each consumer's stream ahead.

    It is a ``TableDataset`` whose rows are blocks: consumers, ``policy``, ranks, ``read_ahead``,
    the pinned version, ``set_epoch``, ``transform`` and ``loader()`` work as there, and
    ``last``, ``rows_per_consumer``, ``len``, ``batches`` and ``even_rows`` count blocks, so the
    DataModule's even batches give DDP ranks equal batches. Counting reads the token column of
    every work list counted, once per work item (each item's count is kept).

    ``state_dict`` / ``load_state_dict`` follow torchdata's ``StatefulDataLoader``: the state is a
    ``TableDataset`` state whose cursor names the document where the next block starts, plus the
    token offset inside it and the packing it is valid for, so a resume mid-document continues the
    identical stream, re-reading at most one batch of tokens and one read batch. A state saved
    under another column, length or separator is refused. The elastic re-plan is not supported:
    a remainder of stored rows would deliver the tokens of partly delivered documents again.
    """

    def __init__(
        self,
        spec: TableSpec | str,
        *,
        column: str,
        length: int,
        batch_size: int,
        separator: int | None = None,
        last: Last = "keep_partial",
        policy: Policy | str = stripe,
        rank: int | None = None,
        world_size: int | None = None,
        rows_per_consumer: int | None = None,
        read_ahead: int = DEFAULT_READ_AHEAD,
        storage_options: Mapping[str, Any] | None = None,
        transform: Callable[[Any], Any] | None = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int (blocks per batch), not {batch_size!r}")
        packing = Packing(column, length, separator)
        super().__init__(
            _token_spec(as_spec(spec, storage_options), column),
            batch_size=batch_size,
            last=last,
            policy=policy,
            rank=rank,
            world_size=world_size,
            collate=None,
            rows_per_consumer=rows_per_consumer,
            read_ahead=read_ahead,
            transform=transform,
        )
        kind = self.source().schema.field(column).type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(kind.value_type):
            raise ValueError(
                f"PackedDataset packs a column of token ids (a list or large_list of integers per row), not "
                f"{column!r} of type {kind} in {self.spec.uri!r}"
            )
        self.packing = packing
        self.batch_size: int = batch_size
        self.dropped = 0
        self._next: After | None = None
        self._blocks = 0
        self._packed_work: str | None = None
        self._restored: tuple[State, int] | None = None
        self._item_tokens: dict[WorkItem, int] = {}

    def set_epoch(self, epoch: int) -> None:
        """Read ``epoch``'s work lists from now on (epoch-dependent policies change order)."""
        if epoch != self.epoch:
            self._next = None
            self._blocks = 0
            self._packed_work = None
            self.dropped = 0
        super().set_epoch(epoch)

    def load_elastic(self, states: Sequence[Mapping[str, Any]], *lineage: Any, **options: Any) -> None:
        """Refused: see the class."""
        raise ValueError(
            "a PackedDataset resumes only under the world size and worker count it was saved with: an elastic "
            "re-plan shares stored rows, and the documents a consumer had partly delivered would be delivered "
            "again; resume with the saved topology, or start the epoch afresh"
        )

    def tokens(self, workers: int) -> list[int]:
        """The stream tokens (separators included) of each consumer of this rank in this epoch
        when it has ``workers`` DataLoader workers (0 reads in the main process), in worker order."""
        consumers = max(1, workers)
        return self._tokens([Shard(self.rank, self.world_size, worker, consumers) for worker in range(consumers)])

    def __len__(self) -> int:
        """The blocks this rank yields in this epoch read in the main process (no workers), after
        the quota; ``batches`` counts for any worker count."""
        return self._capped_blocks(self._tokens([Shard(self.rank, self.world_size)])[0] // self.packing.length)

    def batches(self, workers: int) -> int:
        """The exact batches this rank yields in this epoch through a DataLoader with ``workers``
        workers: each consumer's whole blocks, after the quota, in batches of ``batch_size``, the
        shorter tail counted with ``last="keep_partial"``."""
        total = 0
        for tokens in self.tokens(workers):
            blocks = self._capped_blocks(tokens // self.packing.length)
            total += -(-blocks // self.batch_size) if self.last == "keep_partial" else blocks // self.batch_size
        return total

    def even_rows(self, workers: int) -> tuple[int, int]:
        """The blocks every consumer of every rank yields in this epoch for equal batches when each
        rank has ``workers`` DataLoader workers, and the blocks that leaves out of the epoch: the
        fewest whole blocks of any consumer, rounded down to whole batches with
        ``last="require_full"``; give it to ``set_rows_per_consumer``."""
        tokens = self._tokens(every_shard(self.world_size, max(1, workers)))
        blocks = [count // self.packing.length for count in tokens]
        quota = min(blocks)
        if self.last == "require_full":
            quota -= quota % self.batch_size
        return quota, sum(blocks) - quota * len(blocks)

    def _capped_blocks(self, blocks: int) -> int:
        quota = self.rows_per_consumer
        return blocks if quota is None else min(blocks, quota)

    def count_shared(self, workers: int) -> None:
        """Count the stream tokens of every work item of this epoch's lists with ``workers``
        workers a rank, each rank a ``1/world_size`` share of the items, and exchange the counts
        over the default ``torch.distributed`` process group: even batches need the blocks of
        every rank's consumers, and the token column is then read once per job, not once per rank
        (items counted before are not read again). A collective, called like
        ``TableDataset.count_shared``, with or without a filter; without a process group of this
        dataset's ranks it does nothing, and each rank counts alone when asked."""
        if not self._ranks_grouped():
            return
        shards = every_shard(self.world_size, max(1, workers))
        every = list(dict.fromkeys(item for shard in shards for item in self.work(shard)))
        parts: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(parts, self._item_counts(every[self.rank :: self.world_size]))
        for rank, part in enumerate(parts):
            self._item_tokens.update(zip(every[rank :: self.world_size], part, strict=True))

    def _item_counts(self, items: Sequence[WorkItem]) -> list[int]:
        """The stream tokens of each of ``items``, counting those not counted yet in one read of
        the token column."""
        missing = [item for item in dict.fromkeys(items) if item not in self._item_tokens]
        if missing:
            counted = count_tokens(self.source(), missing, self.packing)
            self._item_tokens.update(zip(missing, counted, strict=True))
        return [self._item_tokens[item] for item in items]

    def _tokens(self, shards: Sequence[Shard]) -> list[int]:
        """The stream tokens of each of ``shards``' work lists, counting the items not counted yet
        in one read of the token column."""
        lists = [self.work(shard) for shard in shards]
        self._item_counts([item for items in lists for item in items])
        return [sum(self._item_tokens[item] for item in items) for items in lists]

    def _packed_state(self, shard: Shard, position: PackPosition | None) -> State:
        # A table state whose cursor is the document of the next block and whose delivered are blocks.
        cursor = None if position is None else position.cursor
        return replace(self._state(shard), work=self._packed_work, cursor=cursor, delivered=self._blocks, skipped=0)

    def state_dict(self) -> dict[str, Any]:
        """This consumer's next block and the settings it is valid for, as plain values."""
        if self._restored is not None:
            table, offset = self._restored
        else:
            position = None if self._next is None else self._next()
            table, offset = self._packed_state(self.shard(), position), 0 if position is None else position.offset
        return {"format": PACKED_FORMAT, "table": table.to_dict(), "packing": self.packing.settings(), "offset": offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state saved by a dataset over the same version, consumer, batch size,
        policy, quota and packing; ``ValueError`` naming what differs otherwise."""
        if isinstance(state, Mapping) and "packing" not in state:
            raise ValueError(
                "the state is not a PackedDataset state: it names no packing (a TableDataset state restores into a "
                "TableDataset)"
            )
        check_saved(state, "PackedDataset", PACKED_FORMAT, ("table", "packing", "offset"))
        saved_packing, now = state["packing"], self.packing.settings()
        if saved_packing != now:
            names = ("column", "length", "separator")
            if isinstance(saved_packing, list | tuple) and len(saved_packing) == len(names):
                differ = "; ".join(
                    f"{name}: saved {old!r}, now {new!r}"
                    for name, old, new in zip(names, saved_packing, now, strict=True)
                    if old != new
                )
            else:
                differ = f"saved {saved_packing!r}, now {now!r}"
            raise ValueError(
                f"the PackedDataset state was saved packing another token stream ({differ}); restore it into a "
                "dataset with the same column, length and separator"
            )
        offset = state["offset"]
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ValueError(f"the PackedDataset state's offset must be a non-negative int, not {offset!r}")
        saved = State.from_dict(state["table"])
        if offset and saved.cursor is None:
            raise ValueError(
                f"the PackedDataset state has token offset {offset} but no cursor; it was edited or damaged"
            )
        saved.check_matches(self._packed_state(self.shard(), None))
        self.set_epoch(saved.epoch)
        self._restored = (saved, offset)

    def __iter__(self) -> Iterator[Any]:
        shard, items, work = self._begin()
        restored, self._restored = self._restored, None
        position = PackPosition(start_of(items))
        delivered = 0
        saved, offset = restored if restored is not None else (None, 0)
        if saved is not None and saved.cursor is not None:
            if saved.work != work:
                raise ValueError(
                    f"the policy {policy_name(self.policy)} gives consumer {tuple(shard)} another work list in epoch "
                    f"{self.epoch} (fingerprint {work}) than the state was saved with ({saved.work}); "
                    "the policy must depend only on the plan, the shard and the epoch"
                )
            check_cursor(saved.cursor, items)
            position, delivered = PackPosition(saved.cursor, offset), saved.delivered
        self._packed_work = work
        self._next = partial(PackPosition, *position)
        self._blocks = delivered
        self.dropped = 0
        quota = self.rows_per_consumer
        table = f"{self.spec.uri} (rank {shard.rank}, worker {shard.worker})"
        blocks = read_blocks(
            self.reader(),
            items,
            position,
            self.packing,
            self.batch_size,
            self.last,
            None if quota is None else quota - delivered,
            table,
        )
        for batch, after in self._tallied(blocks):
            self._next = after
            self._blocks += len(batch.tokens)
            tensors = {
                self.packing.column: torch.from_numpy(batch.tokens),
                POSITIONS: torch.from_numpy(batch.positions),
            }
            yield handed_on(tensors if self.transform is None else self.transform(tensors))

    def _tallied(self, blocks: Generator[tuple[Blocks, After], None, int]) -> Iterator[tuple[Blocks, After]]:
        """``blocks`` as they come, keeping the tokens the stream's tail dropped in ``dropped``."""
        self.dropped = yield from blocks


def _token_spec(spec: TableSpec, column: str) -> TableSpec:
    """``spec`` reading only the token ``column``; ``ValueError`` for options a packed stream
    cannot honour."""
    if spec.columns is not None and column not in spec.columns:
        raise ValueError(f"the token column {column!r} is not among the columns {list(spec.columns)} of {spec.uri!r}")
    if spec.media or spec.padded:
        raise ValueError(
            f"a PackedDataset yields only the token column {column!r}, so the spec's media and padded projections "
            "do not apply; drop them from the spec"
        )
    if spec.null_fill or spec.null_mask:
        raise ValueError(
            "a PackedDataset packs whole documents, so null_fill and null_mask do not apply; keep null documents "
            f"out with filter='{column} IS NOT NULL'"
        )
    return replace(spec, columns=(column,))
