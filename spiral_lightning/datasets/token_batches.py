"""TokenBatchDataset: batches of whole documents sized by a token budget, planned from the
documents' lengths so that every batch count is known ahead and a resume continues exactly (see
``spiral_lightning.reading.token_batches``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from spiral_lightning.core import integrity
from spiral_lightning.core.budget import TokenBudget
from spiral_lightning.core.checks import check_count
from spiral_lightning.core.plan import Policy, Shard, WorkItem
from spiral_lightning.core.spec import TableSpec, as_spec
from spiral_lightning.core.state import State, check_same_topology, check_saved
from spiral_lightning.core.tokens import check_token_column, token_spec
from spiral_lightning.datasets.consumer import DEFAULT_READ_AHEAD, Consumer
from spiral_lightning.datasets.groups import MOST_GROUPED
from spiral_lightning.datasets.loader import TableLoader, loader_options, workers_for
from spiral_lightning.planning.holes import FirstRows
from spiral_lightning.planning.lists import Pieces
from spiral_lightning.planning.policies import policy_name
from spiral_lightning.planning.token_batches import (
    Ints,
    WindowPlan,
    count_batches,
    delivered_documents,
    plan_window,
    window_rng,
)
from spiral_lightning.reading.frames import start_of
from spiral_lightning.reading.token_batches import BudgetPosition, PlanKey, count_lengths, read_batches
from spiral_lightning.reading.transfer import handed_on

#: The version of the dictionary ``TokenBatchDataset.state_dict`` writes.
TOKEN_BATCHES_FORMAT = 1

_KIND = "TokenBatchDataset"


class TokenBatchDataset(Consumer, IterableDataset[Any]):
    """Batches of whole documents of a token column, each as many as fit a ``TokenBudget``.

        dataset = TokenBatchDataset("spiral:data/corpus", budget=TokenBudget("tokens", max_tokens=8192))
        for batch in dataset.loader():  # {"tokens": int64 [B, L], "lengths": int64 [B]}, B * L <= 8192
            ...

    Each consumer (a DataLoader worker of a rank, dealt its work list by ``policy`` or
    ``shuffle`` as in ``TableDataset``) batches its own documents, a window at a time (see
    ``TokenBudget``); only the token column is read, and token ids arrive as int64 whatever the
    column's integer type (as ``PackedDataset``'s do). Every
    document (or piece of one, with ``long="split"``) is delivered once an epoch.

    The batches are planned from the documents' lengths, so ``batches(num_workers)`` counts them
    ahead by reading the token column once (each work item's lengths are kept), and the
    SpiralDataModule gives every DDP rank the fewest batches any rank has. ``state_dict`` /
    ``load_state_dict`` follow torchdata's ``StatefulDataLoader``: the state is the cursor of the
    current window's first document and the batches of that window delivered, so a resume reads
    at most one window again and continues exactly. Under other ranks or workers,
    ``load_elastic`` shares the documents no saved consumer delivered (those of a window it was
    in, less the ones its delivered batches held) among the new consumers, which batch them
    afresh: every document once in the epoch (a split one partly delivered, whole again).
    """

    # Windows are planned shortest first: a shuffle permutes blocks of documents only.
    SHUFFLES_WINDOWS = False
    # A batch is a budget of tokens, not rows: a worker's group holds this many of them (fewer
    # past ``groups.GROUP_BYTES``), as many as it holds of small batches of rows.
    GROUP_BATCHES = MOST_GROUPED

    def __init__(
        self,
        spec: TableSpec | str,
        *,
        budget: TokenBudget,
        policy: Policy | str | None = None,
        shuffle: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        read_ahead: int = DEFAULT_READ_AHEAD,
        read_threads: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        transform: Callable[[Any], Any] | None = None,
        filter: Any = None,
    ) -> None:
        if not isinstance(budget, TokenBudget):
            raise TypeError(f"budget must be a TokenBudget(column, max_tokens, ...), not {budget!r}")
        super().__init__(
            token_spec(as_spec(spec, storage_options), budget.column, _KIND),
            policy=policy,
            shuffle=shuffle,
            seed=seed,
            rank=rank,
            world_size=world_size,
            read_ahead=read_ahead,
            read_threads=read_threads,
            filter=filter,
        )
        check_token_column(self.source().schema, budget.column, self.spec.uri, _KIND)
        self.budget = budget
        self.seed = seed
        self.transform = transform
        self._work: str | None = None
        self._position: BudgetPosition | None = None
        self._restored: tuple[State, int, int] | None = None
        self._lengths: dict[WorkItem, Ints] = {}
        # The work list and plan of the window ``documents_of`` planned last: a window's steps
        # follow each other, and each would otherwise plan the list again.
        self._plan: tuple[tuple[int, tuple[int, ...], int], list[WorkItem], WindowPlan] | None = None

    def _on_new_epoch(self) -> None:
        self._work = None
        self._position = None

    def loader(self, num_workers: int | None = None, **options: Any) -> StatefulDataLoader:
        """A ``StatefulDataLoader`` of this dataset's own batches whose ``len`` is this rank's
        batches in the epoch: ``num_workers`` workers (``None``: in this process on threads,
        unless a ``transform`` runs) started by ``forkserver`` and persistent, as
        ``TableDataset.loader`` makes them; ``options`` go to the loader and override these."""
        self.check_shares(num_workers := workers_for(self, num_workers))
        return TableLoader(self, **loader_options(num_workers, options, self))

    def __len__(self) -> int:
        raise TypeError(
            "a TokenBatchDataset has no length without reading its documents' lengths; batches(num_workers) "
            "counts its batches"
        )

    def batches(self, workers: int) -> int:
        """The exact batches this rank yields in this epoch through a DataLoader with ``workers``
        workers (0 reads in the main process), planned from the lengths of each consumer's
        documents (read once per work item, then kept)."""
        consumers = max(1, workers)
        total = 0
        for worker in range(consumers):
            shard = Shard(self.rank, self.world_size, worker, consumers)
            lengths = self._lengths_of(self.work(shard))
            total += count_batches(lengths, self.budget, self.seed, self.epoch, tuple(shard))
        return total

    def _lengths_of(self, items: Sequence[WorkItem]) -> Ints:
        """The token counts of ``items``' documents, in order, reading the items not read before."""
        missing = [item for item in dict.fromkeys(items) if item not in self._lengths]
        if missing:
            self._lengths.update(zip(missing, count_lengths(self.source(), missing), strict=True))
        if not items:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([self._lengths[item] for item in items])

    def documents_of(self, shard: Shard, window: int, batch: int) -> tuple[list[WorkItem], Ints]:
        """Consumer ``shard``'s work list this epoch, and the places in its stream of the documents
        whose tokens batch ``batch`` (-1: the last) of its window ``window`` holds, in stream
        order, planned from the lengths as its reads plan them (a step record's rows)."""
        low = window * self.budget.window
        key = (self.epoch, tuple(shard), window)
        if self._plan is None or self._plan[0] != key:
            items = self.work(shard)
            lengths = self._lengths_of(items)[low : low + self.budget.window]
            rng = window_rng(self.seed, self.epoch, tuple(shard), window)
            self._plan = (key, items, plan_window(lengths, self.budget, rng))
        _, items, (found, batches) = self._plan
        return items, low + np.unique(found.document[batches[batch]])

    def load_elastic(self, states: Sequence[Mapping[str, Any]], lineage: Mapping[str, Any] | None = None) -> None:
        """Continue an epoch saved by every consumer of another topology (``states``, their
        ``state_dict``s; ``lineage``, the ``lineage()`` saved beside states of an epoch re-planned
        before): the documents none of them delivered are shared among this dataset's consumers
        with ``balanced`` cuts, each once, and batched by them; later epochs plan as usual. A
        document split by ``long="split"`` that a consumer had delivered some pieces of comes
        again whole. ``ValueError`` when the states are not one epoch of one version, policy and
        budget."""
        parsed = [self._parsed(state) for state in states]
        for state, (table, _, _) in zip(states, parsed, strict=True):
            integrity.check_digest(state, _KIND, table.where())
        windows = [(window, taken) for _, window, taken in parsed]
        self.replan_saved([table for table, _, _ in parsed], lineage, windows=windows)
        self._restored = None

    def window_holes(self) -> TokenHoles:
        """The documents a saved consumer's batches delivered of the window it was in."""
        return TokenHoles(self.budget, self.seed, self._window_lengths)

    def _window_lengths(self, items: list[WorkItem]) -> Ints:
        """The token counts of ``items``' documents, in order, read now (a re-plan's few windows)."""
        found = count_lengths(self.source(), items)
        return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)

    def _state(self, shard: Shard) -> State:
        return State(
            version=self.version,
            shard=shard,
            batch_size=None,
            epoch=self.epoch,
            policy=policy_name(self.policy),
            work=self._work,
            cursor=None if self._position is None else self._position.cursor,
            remainder=self.lineage_digest(),
        )

    def sliced(self) -> bool:
        """No: a batch is gathered from a window's plan, never a slice of a frame (``groups.Grouped``)."""
        return False

    def state_now(self) -> dict[str, Any]:
        """The state a worker's group carries after each batch (``groups.Grouped``)."""
        return self.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """This consumer's window, the batches of it delivered, and the settings they are valid for."""
        if self._restored is not None:
            table, window, taken = self._restored
        else:
            position = self._position or BudgetPosition(start_of([]))
            table, window, taken = self._state(self.shard()), position.window, position.taken
        return integrity.sealed(
            {
                "format": TOKEN_BATCHES_FORMAT,
                "table": table.to_dict(),
                "budget": self.budget.settings(),
                "window": [window, taken],
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a state saved by a dataset over the same version, consumer, policy and
        budget; ``ValueError`` naming what differs otherwise."""
        saved, index, taken = self._parsed(state)
        shard = self.shard()
        check_same_topology(_KIND, saved.shard, shard)
        self.check_lineage(_KIND, saved)
        saved.check_matches(self._state(shard))
        self.set_epoch(saved.epoch)
        self.check_loaded(_KIND, saved, self.work(), windows=False, rows=False)
        integrity.check_digest(state, _KIND, saved.where())
        self._restored = (saved, index, taken)

    def _parsed(self, state: Mapping[str, Any]) -> tuple[State, int, int]:
        """The table state of a ``state_dict``, its window and the batches of it taken, once its
        budget is this dataset's; ``ValueError`` naming what differs or is damaged otherwise."""
        check_saved(state, _KIND, TOKEN_BATCHES_FORMAT, ("table", "budget", "window"))
        saved_budget, now = state["budget"], self.budget.settings()
        if saved_budget != now:
            if not integrity.intact(state):
                raise integrity.damaged(_KIND, found=f"budget: saved {saved_budget!r}")
            raise ValueError(
                f"the {_KIND} state was saved under another token budget (saved {saved_budget!r}, now {now!r}: "
                "column, max_tokens, form, long, window, group, pad); restore it into a dataset with the same budget"
            )
        window = state["window"]
        if not isinstance(window, list | tuple) or len(window) != 2:
            raise ValueError(f"the {_KIND} state's window must be [index, batches taken], not {window!r}")
        index = check_count(f"the {_KIND} state's window index", window[0])
        taken = check_count(f"the {_KIND} state's batches taken", window[1])
        return State.from_dict(state["table"], check_digest=False), index, taken

    def __iter__(self) -> Iterator[Any]:
        shard, items, work = self.begin()
        restored, self._restored = self._restored, None
        position = BudgetPosition(start_of(items))
        if restored is not None and restored[0].cursor is not None:
            saved, window, taken = restored
            position = BudgetPosition(self.check_resume(_KIND, saved, shard, work, items), window, taken)
        self._work = work
        self._position = position
        key = PlanKey(self.seed, self.epoch, tuple(shard))
        where = f"{self.spec.uri} (rank {shard.rank}, worker {shard.worker})"
        for batch, after in read_batches(self.reader(), items, position, self.budget, key, where):
            self._position = after
            made = batch if self.transform is None else self.transform(batch)
            yield handed_on(made) if self.hands_on else made


@dataclass(frozen=True)
class TokenHoles:
    """What a consumer saved in the middle of a token-budget window had delivered of it: the
    documents its first batches held, found by planning the window again from its documents'
    lengths (``lengths`` reads them for work items) under ``budget`` and ``seed``."""

    budget: TokenBudget
    seed: int
    lengths: Callable[[list[WorkItem]], Ints]

    @property
    def name(self) -> str:
        """The budget and seed the windows were planned under, pinned in a lineage."""
        return "tokens " + json.dumps([self.seed, *self.budget.settings()], separators=(",", ":"))

    def __call__(self, shard: Shard, epoch: int, window: int, taken: int, rows: Pieces, first: FirstRows) -> np.ndarray:
        places = first(self.budget.window)
        # The items up to the window's last document: its documents, read through the filter if any.
        sizes = np.minimum(np.cumsum(rows.end - rows.start), int(places[-1]) + 1 if len(places) else 0)
        ends = rows.start + sizes - np.concatenate(([0], sizes[:-1]))
        items = rows._replace(end=ends).take(np.flatnonzero(ends > rows.start)).items()
        rng = window_rng(self.seed, epoch, tuple(shard), window)
        try:
            delivered: np.ndarray = places[delivered_documents(self.lengths(items), self.budget, rng, taken)]
        except ValueError as error:
            raise ValueError(f"the {_KIND} state of consumer {tuple(shard)} in window {window}: {error}") from None
        return delivered
