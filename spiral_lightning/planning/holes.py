"""What consumers saved inside their windows had delivered of them: the rows an elastic re-plan
leaves out of a remainder as holes (see ``spiral_lightning.planning.elastic``).

A kind whose consumers deliver a window's rows out of stored order says which rows a consumer
took of its window with a ``WindowHoles``: ``ShuffleHoles`` (below) for ``Shuffled(buffer_rows=...)``,
whose window's seeded order gives them, and ``datasets.token_batches.TokenHoles``, whose window's
plan does. A window is the next rows the consumer delivers from the window's start: its stored
rows, or under a filter the ones the source keeps (``Counted.kept``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, NamedTuple, Protocol

import numpy as np

from spiral_lightning.core.plan import Plan, Policy, Shard, WorkItem
from spiral_lightning.planning.lineage import Link
from spiral_lightning.planning.lists import Pieces, distinct
from spiral_lightning.planning.policies import Shuffled, policy_name, window_key, window_order


class Counted(Protocol):
    """What a re-plan reads of a source: its plan, the rows of work items after the filter and
    the stored rows it keeps of a split (a ``Source`` is one). Planning reads no table itself."""

    @property
    def splits(self) -> Plan: ...

    def count(self, items: Sequence[WorkItem]) -> list[int]: ...

    def kept(self, split: int) -> np.ndarray: ...


#: The places (in a consumer's undelivered stored rows laid end to end) of the first ``n`` rows
#: it delivers from there: all of them without a filter, the kept ones under one.
FirstRows = Callable[[int], np.ndarray]


class WindowHoles(Protocol):
    """What a kind's consumer saved inside one of its windows had delivered of it: ``name`` is
    pinned in the lineage (``RowLineage.windows``), and a call gives the places (sorted) of the
    rows consumer ``shard`` delivered of its window ``window`` in ``epoch``, ``taken`` the
    window's progress as its state counts it, ``rows`` its undelivered stored rows laid end to
    end, beginning at the window's first row, and ``first`` the places of the rows it delivers
    from there (see ``FirstRows``)."""

    @property
    def name(self) -> str: ...

    def __call__(
        self, shard: Shard, epoch: int, window: int, taken: int, rows: Pieces, first: FirstRows
    ) -> np.ndarray: ...


@dataclass(frozen=True)
class ShuffleHoles:
    """The rows a consumer took of a shuffle window of ``policy`` (a ``Shuffled`` with
    ``buffer_rows``): the first ``taken`` of the window's order, a window being the next
    ``buffer_rows`` rows the consumer delivers."""

    policy: Policy
    name: ClassVar[str] = ""

    def __call__(self, shard: Shard, epoch: int, window: int, taken: int, rows: Pieces, first: FirstRows) -> np.ndarray:
        policy = self.policy
        if not isinstance(policy, Shuffled) or not policy.buffer_rows:
            raise ValueError(
                f"the re-plan lineage says consumers were inside shuffle windows, but the policy "
                f"{policy_name(policy)} shuffles in no windows; the lineage belongs to another dataset"
            )
        places = first(policy.buffer_rows)
        if taken >= len(places):
            raise ValueError(
                f"saved consumer {tuple(shard)} took {taken} rows of a shuffle window of {len(places)}; the state or "
                "the lineage was edited or damaged"
            )
        order = window_order(window_key(policy.seed, epoch, shard), window, len(places))
        taken_rows: np.ndarray = np.sort(places[order[:taken]])
        return taken_rows


class Windows(NamedTuple):
    """What finds the rows consumers took of their windows: the kind's ``holes``, and the
    ``source`` whose kept rows a window is made of when ``filtered``."""

    holes: WindowHoles
    source: Counted
    filtered: bool

    def first(self, rows: Pieces) -> FirstRows:
        """The ``FirstRows`` of undelivered ``rows``."""
        total = int((rows.end - rows.start).sum())
        if not self.filtered:
            return lambda count: np.arange(min(count, total), dtype=np.int64)
        return partial(_first_kept, self.source, rows)


def _first_kept(source: Counted, rows: Pieces, count: int) -> np.ndarray:
    """The places of the first ``count`` rows of ``rows`` (laid end to end) that ``source``'s
    filter keeps, reading the kept rows of as few splits as hold them."""
    found: list[np.ndarray] = []
    held = offset = 0
    for split, start, end in zip(rows.split.tolist(), rows.start.tolist(), rows.end.tolist(), strict=True):
        kept = source.kept(split)
        mine = kept[(kept >= start) & (kept < end)] - start + offset
        found.append(mine)
        held, offset = held + len(mine), offset + end - start
        if held >= count:
            break
    return np.concatenate(found)[:count] if found else np.zeros(0, dtype=np.int64)


def without_taken(rest: Pieces, link: Link, windows: Windows, epoch: int) -> Pieces:
    """``rest`` (undelivered pieces grouped by owner, each consumer's beginning at its window)
    without the rows each consumer had taken from its window, as ``windows`` finds them."""
    parts: list[Pieces] = []
    done = 0
    for consumer in np.flatnonzero(link.taken).tolist():
        low, high = np.searchsorted(rest.owner, [consumer, consumer + 1])
        parts.append(rest.take(np.arange(done, low)))
        mine = rest.take(np.arange(low, high))
        shard = Shard(consumer // link.workers, link.world_size, consumer % link.workers, link.workers)
        window, taken = int(link.windows[consumer]), int(link.taken[consumer])
        parts.append(_holed(mine, windows.holes(shard, epoch, window, taken, mine, windows.first(mine))))
        done = high
    parts.append(rest.take(np.arange(done, rest.owner.size)))
    return Pieces(*(np.concatenate([getattr(part, name) for part in parts]) for name in Pieces._fields))


def _holed(pieces: Pieces, positions: np.ndarray) -> Pieces:
    """``pieces`` (one consumer's, laid end to end) without the rows at ``positions`` (sorted,
    inside them): cut at every piece and around every position, and the positions' cuts dropped."""
    offsets = np.concatenate((np.zeros(1, dtype=np.int64), np.cumsum(pieces.end - pieces.start)))
    cuts = distinct(offsets, positions, positions + 1)
    low, high = cuts[:-1], cuts[1:]
    kept = ~np.isin(low, positions)
    piece = np.searchsorted(offsets, low[kept], side="right") - 1
    start = pieces.start[piece] + low[kept] - offsets[piece]
    return Pieces(pieces.split[piece], start, start + high[kept] - low[kept], pieces.owner[piece])
