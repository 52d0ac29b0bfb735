"""PackedDataset: a table's token column read as blocks of exactly ``length`` tokens (see
``spiral_lightning.reading.packing``), a ``TableDataset`` whose rows are blocks."""

from __future__ import annotations

from collections.abc import Callable, Collection, Generator, Iterator, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from spiral_lightning.core.checks import check_count, check_positive
from spiral_lightning.core.integrity import check_digest, damaged, intact, sealed
from spiral_lightning.core.plan import Policy, Shard, WorkItem
from spiral_lightning.core.spec import TableSpec, as_spec
from spiral_lightning.core.state import State, check_saved
from spiral_lightning.core.tokens import check_token_column, token_spec
from spiral_lightning.datasets.consumer import DEFAULT_READ_AHEAD, DROPPED
from spiral_lightning.datasets.job import grouped
from spiral_lightning.datasets.table import TableDataset
from spiral_lightning.planning.lists import every_shard
from spiral_lightning.reading.frames import Last, start_of
from spiral_lightning.reading.packing import (
    PACKED_FORMAT,
    POSITIONS,
    After,
    Blocks,
    Packing,
    PackPosition,
    count_tokens,
    read_blocks,
)
from spiral_lightning.reading.transfer import handed_on


class PackedDataset(TableDataset):
    """Batches of ``batch_size`` blocks of exactly ``length`` tokens from the token column
    ``column``, each consumer packing its own work list's documents in order (see the module).

        packed = PackedDataset("spiral:data/corpus", column="tokens", length=1024, batch_size=8, separator=0)
        batch = next(iter(packed.loader(num_workers=2)))
        batch["tokens"], batch["positions"]  # int64 [8, 1024] each; positions restart per document

    A batch is ``{column: int64 [batch_size, length], "positions": int64 [batch_size, length]}``;
    other columns are not read. ``separator`` (a token id) follows each non-empty document when
    given. Every token of a consumer's documents is delivered once, in order, except its tail
    shorter than one block, which is dropped: ``dropped`` counts its tokens once the consumer's
    pass ends, and ``tokens`` counts each consumer's stream ahead.

    It is a ``TableDataset`` whose rows are blocks: consumers, ``policy``, ranks, ``read_ahead``,
    ``read_threads``, ``filter``, the pinned version, ``shuffle`` (which permutes blocks of
    documents, each block's documents packed in stored order), ``set_epoch``, ``transform`` and
    ``loader()`` work as there, and ``last``, ``rows_per_consumer``, ``len``, ``batches`` and
    ``even_rows`` count blocks, so the DataModule's even batches give DDP ranks equal batches.
    Counting reads the token column of every work list counted, once per work item (each item's
    count is kept).

    ``state_dict`` / ``load_state_dict`` follow torchdata's ``StatefulDataLoader``: the state is a
    ``TableDataset`` state whose cursor names the document where the next block starts, plus the
    token offset inside it and the packing it is valid for, so a resume mid-document continues the
    identical stream, re-reading at most one batch of tokens and one read batch. A state saved
    under another column, length or separator is refused. ``load_elastic`` re-plans an epoch for
    another topology or batch size, reading the documents no saved consumer began once and the
    one each was inside of again whole.
    """

    # A packed stream keeps each work item's documents in stored order: shuffle=True permutes
    # blocks of documents only.
    SHUFFLES_WINDOWS = False

    def __init__(
        self,
        spec: TableSpec | str,
        *,
        column: str,
        length: int,
        batch_size: int,
        separator: int | None = None,
        last: Last = "keep_partial",
        policy: Policy | str | None = None,
        shuffle: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        rows_per_consumer: int | None = None,
        read_ahead: int = DEFAULT_READ_AHEAD,
        read_threads: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        transform: Callable[[Any], Any] | None = None,
        filter: Any = None,
    ) -> None:
        check_positive("batch_size", batch_size, "blocks per batch")
        packing = Packing(column, length, separator)
        super().__init__(
            token_spec(as_spec(spec, storage_options), column, "PackedDataset"),
            batch_size=batch_size,
            last=last,
            policy=policy,
            shuffle=shuffle,
            seed=seed,
            rank=rank,
            world_size=world_size,
            collate=None,
            rows_per_consumer=rows_per_consumer,
            read_ahead=read_ahead,
            read_threads=read_threads,
            transform=transform,
            filter=filter,
        )
        check_token_column(self.source().schema, column, self.spec.uri, "PackedDataset")
        self.packing = packing
        self.batch_size: int = batch_size
        self._next: After | None = None
        self._blocks = 0
        self._packed_work: str | None = None
        self._restored: tuple[State, int] | None = None
        self._item_tokens: dict[WorkItem, int] = {}

    def _on_new_epoch(self) -> None:
        super()._on_new_epoch()
        self._next = None
        self._blocks = 0
        self._packed_work = None

    def load_elastic(
        self,
        states: Sequence[Mapping[str, Any]],
        lineage: Mapping[str, Any] | None = None,
        *,
        finished: Collection[Shard] = (),
        keep: bool = False,
    ) -> None:
        """Continue an epoch saved by every consumer under another world size, worker count or
        batch size: the documents no saved consumer began are shared among this dataset's
        consumers, each exactly once, and the document a consumer was inside of when it saved (its
        next block began there) is read again whole, so that document's tokens delivered before
        the stop come twice (at most one document a saved consumer). The re-planned streams pack
        their own blocks, so each new consumer's tail shorter than a block is dropped as in any
        epoch. ``lineage``, ``finished`` and ``keep`` as for ``TableDataset.load_elastic``."""
        tables = []
        for state in states:
            saved = self._saved(state)[0]
            check_digest(state, "PackedDataset", saved.where())
            tables.append(saved.to_dict())
        super().load_elastic(tables, lineage, finished=finished, keep=keep)
        self._restored = None

    @property
    def dropped(self) -> int:
        """The tokens of this epoch's stream tails shorter than a block: a DataLoader worker's own,
        or in the main process those of every consumer of this rank, whatever the worker count."""
        return self.tally(DROPPED)

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
        if not grouped(self.rank, self.world_size):
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
        return replace(self.state_of(shard), work=self._packed_work, cursor=cursor, delivered=self._blocks, skipped=0)

    def state_dict(self) -> dict[str, Any]:
        """This consumer's next block and the settings it is valid for, as plain values."""
        if self._restored is not None:
            table, offset = self._restored
        else:
            position = None if self._next is None else self._next()
            table, offset = self._packed_state(self.shard(), position), 0 if position is None else position.offset
        return sealed(
            {"format": PACKED_FORMAT, "table": table.to_dict(), "packing": self.packing.settings(), "offset": offset}
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state saved by a dataset over the same version, consumer, batch size,
        policy, quota and packing; ``ValueError`` naming what differs otherwise."""
        saved, offset = self._saved(state)
        saved.check_matches(self._packed_state(self.shard(), None))
        self.set_epoch(saved.epoch)
        self.check_loaded("PackedDataset", saved, self.work(), windows=False, rows=False)
        check_digest(state, "PackedDataset", saved.where())
        self._restored = (saved, offset)

    def _saved(self, state: Mapping[str, Any]) -> tuple[State, int]:
        """The table state and token offset of a packed ``state``; ``ValueError`` when it is not
        one, or packs another token stream."""
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
            if not intact(state):
                raise damaged("PackedDataset", found=f"packing: {differ}")
            raise ValueError(
                f"the PackedDataset state was saved packing another token stream ({differ}); restore it into a "
                "dataset with the same column, length and separator"
            )
        offset = check_count("the PackedDataset state's offset", state["offset"])
        saved = State.from_dict(state["table"], check_digest=False)
        if offset and saved.cursor is None:
            raise ValueError(
                f"the PackedDataset state has token offset {offset} but no cursor; it was edited or damaged"
            )
        return saved, offset

    def __iter__(self) -> Iterator[Any]:
        shard, items, work = self.begin()
        restored, self._restored = self._restored, None
        position = PackPosition(start_of(items))
        delivered = 0
        saved, offset = restored if restored is not None else (None, 0)
        if saved is not None and saved.cursor is not None:
            self.check_resume("PackedDataset", saved, shard, work, items)
            position, delivered = PackPosition(saved.cursor, offset), saved.delivered
        self._packed_work = work
        self._next = partial(PackPosition, *position)
        self._blocks = delivered
        self.set_tally(DROPPED, 0)
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
            made = tensors if self.transform is None else self.transform(tensors)
            yield handed_on(made) if self.hands_on else made

    def _tallied(self, blocks: Generator[tuple[Blocks, After], None, int]) -> Iterator[tuple[Blocks, After]]:
        """``blocks`` as they come, keeping the tokens the stream's tail dropped in ``dropped``."""
        self.set_tally(DROPPED, (yield from blocks))
