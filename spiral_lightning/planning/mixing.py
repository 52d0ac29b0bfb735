"""How a ``Mixture`` consumer chooses its next table, and how many batches its epoch holds.

The choice is a deficit rule: the table whose delivered rows, shifted by its phase (a fraction
of a batch drawn per consumer and epoch), lag furthest behind its weight is read next. It depends
on counts only, so the batches of a consumer's epoch follow from the rows each pass of each table
gives it, without reading a row: that is what lets every rank of a job agree on one epoch length.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from spiral_lightning.core.mixture_state import Progress, ended
from spiral_lightning.core.plan import Shard
from spiral_lightning.core.schedule import Weights


def phases_of(seed: int, epoch: int, shard: Shard, tables: int) -> list[float]:
    """Each table's phase in ``[0, 1)`` for consumer ``shard`` in ``epoch``: where in the turn
    order it starts. A string seed hashes the same in every process, unlike ``hash`` of a tuple."""
    generator = random.Random(f"{seed}:{epoch}:{shard.rank}:{shard.world_size}:{shard.worker}:{shard.workers}")
    return [generator.random() for _ in range(tables)]


def next_table(
    progress: Sequence[Progress],
    phases: Sequence[float],
    weights: Sequence[float],
    batch_size: int,
    since: Sequence[int] = (),
) -> int | None:
    """The table a consumer standing at ``progress`` reads next: the least ``(rows - since +
    phase * batch_size) / weight`` among the tables not dropped as empty, lowest index on ties;
    ``None`` when every table was dropped. ``since`` holds each table's rows when ``weights``
    took effect (none: all 0), so new weights shape the rows after their change only."""
    chosen = [index for index, table in enumerate(progress) if not table.empty]
    if not chosen:
        return None
    base = since or [0] * len(progress)
    return min(chosen, key=lambda i: ((progress[i].rows - base[i] + phases[i] * batch_size) / weights[i], i))


class Chooser:
    """A consumer's choice of table, batch after batch: ``next_table`` under the weights in force
    at its step (``weights_at``, see ``core.schedule``). ``weights`` and ``since`` are those of
    its last choice; a change of weights sets ``since`` to the rows delivered so far, so the new
    weights shape only the rows after it. ``step`` is the rank's step of the consumer's next
    batch, and ``stride`` what a batch adds to it (the consumers of its rank)."""

    def __init__(
        self, weights_at: Callable[[int], Weights], weights: Weights, since: Sequence[int], step: int, stride: int
    ) -> None:
        self.weights_at = weights_at
        self.weights = weights
        self.since = list(since)
        self.step = step
        self.stride = stride

    def choose(self, progress: Sequence[Progress], phases: Sequence[float], batch_size: int) -> int | None:
        """The table the consumer reads next (``None`` when every table was dropped)."""
        now = self.weights_at(self.step)
        if now != self.weights:
            self.weights, self.since = now, [table.rows for table in progress]
        return next_table(progress, phases, self.weights, batch_size, self.since)

    def took(self) -> None:
        """The consumer delivered the batch it chose."""
        self.step += self.stride


def count_batches(
    start: Sequence[Progress],
    pass_rows: Callable[[int, int], int],
    phases: Sequence[float],
    chooser: Chooser,
    batch_size: int,
    stop: str,
) -> int:
    """The batches a consumer delivers from ``start`` (each table's pass and rows delivered when its
    epoch, or a re-plan of it, begins) to the end of its epoch under ``stop``, where
    ``pass_rows(table, passes)`` gives the rows that pass of that table holds for it. A table's
    batches are frames of ``batch_size`` rows, the last of a pass shorter, as ``TableDataset``
    cuts them with ``last="keep_partial"``; the steps are ``Mixture.__iter__``'s, on counts, with
    ``chooser`` standing where the consumer's choices begin."""
    progress = list(start)
    left: list[int | None] = [None] * len(progress)
    batches = 0
    while (index := chooser.choose(progress, phases, batch_size)) is not None:
        rows = left[index]
        if rows is None:
            rows = pass_rows(index, progress[index].passes)
        if rows == 0:
            table = progress[index] = progress[index]._replace(passes=progress[index].passes + 1)
            if ended(stop, progress):
                return batches
            rows = pass_rows(index, table.passes)
            if rows == 0:
                progress[index] = table._replace(empty=True)
                continue
        taken = min(batch_size, rows)
        left[index] = rows - taken
        progress[index] = progress[index]._replace(rows=progress[index].rows + taken)
        chooser.took()
        batches += 1
    return batches
