"""Elastic re-plans of a ``Mixture`` epoch: each table's passes in progress, re-planned for the
consumers of another topology.

A mixture consumer reads each table's work list pass after pass. A re-plan shares, table by
table and pass by pass, the rows of each pass in progress that no saved consumer delivered
(``elastic.replan`` over that table epoch's states), so each row of a pass is delivered once.
Under ``stop="cycle"`` the saved consumers may be in different passes of a table: every pass
from the earliest to the latest is re-planned, a consumer behind a pass counting as not begun
and one ahead of it as finished, and the new consumers read their share of each in turn (a
table holds one re-plan per table epoch). Under ``stop="first_exhausted"`` every consumer reads
pass 0 only, and one whose epoch has ended counts as finished in every table: what it left stays
out of the epoch, as it would have.

The new consumers start each table at its earliest pass in progress, with an equal share of the
rows all saved consumers delivered of it, so the deficit choice keeps the epoch's proportions. A
*mixture lineage* is every table's lineages for the re-planned epoch; it is kept once per
checkpoint and each consumer's state names it by digest.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, NamedTuple, Self

from spiral_lightning.core.mixture_state import MixtureState, Progress, ended, pass_epoch
from spiral_lightning.core.plan import Shard
from spiral_lightning.core.state import State
from spiral_lightning.planning.lineage import Lineage, RowLineage


class MixtureStart(NamedTuple):
    """Where every consumer of a re-planned mixture epoch ``epoch`` starts: table ``t`` at pass
    ``passes[t]``, the saved consumers having delivered ``rows[t]`` of its rows in all, and each
    rank at ``step`` (the batches a saved rank had delivered in the epoch, their mean over ranks)."""

    epoch: int
    passes: tuple[int, ...]
    rows: tuple[int, ...]
    step: int = 0

    def progress(self, shard: Shard) -> list[Progress]:
        """Consumer ``shard``'s progress: each table's pass, and an equal share of its rows."""
        consumers = shard.world_size * shard.workers
        consumer = shard.rank * shard.workers + shard.worker
        return [
            Progress(passes, (consumer + 1) * rows // consumers - consumer * rows // consumers)
            for passes, rows in zip(self.passes, self.rows, strict=True)
        ]


@dataclass(frozen=True)
class MixtureLineage(Lineage):
    """What makes the remainders of a re-planned mixture epoch again: each table's lineage of
    the first pass the re-plan shared, ``start``, where the re-plan's consumers began, and
    ``later``, each table's lineages of the passes after it that saved consumers had begun
    (``stop="cycle"``; empty when none had)."""

    KIND: ClassVar[str] = "Mixture re-plan"

    start: MixtureStart
    tables: tuple[RowLineage, ...]
    later: tuple[tuple[RowLineage, ...], ...] = ()

    def passes_of(self, table: int) -> tuple[RowLineage, ...]:
        """Table ``table``'s lineages, one for each pass the re-plan shared, in pass order."""
        return (self.tables[table], *(self.later[table] if self.later else ()))

    def of(self, table: int, epoch: int) -> RowLineage | None:
        """Table ``table``'s lineage of table epoch ``epoch``, if the re-plan shared that pass."""
        return next((found for found in self.passes_of(table) if found.epoch == epoch), None)

    def _digest_parts(self) -> Iterator[bytes]:
        start = ",".join(str(value) for value in (self.start.epoch, *self.start.passes, *self.start.rows))
        yield ";".join([start, *(table.digest for table in self.tables)]).encode()
        if self.later:
            yield b";later:"
            yield "|".join(",".join(found.digest for found in table) for table in self.later).encode()
        if self.start.step:
            yield f";step={self.start.step}".encode()

    def _fields(self) -> dict[str, Any]:
        fields = {
            "epoch": self.start.epoch,
            "passes": list(self.start.passes),
            "rows": list(self.start.rows),
            "tables": [table.to_dict() for table in self.tables],
        }
        if self.later:
            fields["later"] = [[found.to_dict() for found in table] for table in self.later]
        return fields | ({"step": self.start.step} if self.start.step else {})

    @classmethod
    def _parse(cls, data: Mapping[str, Any]) -> Self:
        passes, rows = tuple(int(v) for v in data["passes"]), tuple(int(v) for v in data["rows"])
        start = MixtureStart(int(data["epoch"]), passes, rows, int(data.get("step", 0)))
        later = tuple(tuple(RowLineage.from_dict(found) for found in table) for table in data.get("later", ()))
        return cls(start, tuple(RowLineage.from_dict(table) for table in data["tables"]), later)

    def _check(self) -> None:
        if (
            len(self.start.passes) != len(self.start.rows)
            or len(self.tables) > len(self.start.passes)
            or (self.later and len(self.later) != len(self.tables))
        ):
            raise ValueError(
                f"the Mixture re-plan lineage holds {len(self.start.passes)} passes, {len(self.start.rows)} row counts "
                f"and {len(self.tables)} table lineages; it was edited or damaged"
            )


class TablePass(NamedTuple):
    """What re-plans one table of a mixture: every saved consumer's ``TableDataset`` state for
    the pass in progress (made for consumers that had not begun it), the consumers finished with
    it, and the lineage of that pass's earlier re-plan, if any."""

    states: list[dict[str, Any]]
    finished: list[Shard]
    lineage: dict[str, Any] | None


class TableOf(NamedTuple):
    """The settings of one table that its ``TableDataset`` states record: its ``version`` and
    its ``policy`` by name."""

    version: str
    policy: str


def table_passes(
    saved: Sequence[MixtureState], lineage: Mapping[str, Any] | None, tables: Sequence[TableOf]
) -> tuple[list[list[TablePass]], MixtureStart]:
    """Each table's re-plans for the mixture consumers ``saved`` (every consumer of one topology,
    one epoch), one for each pass from the earliest any of them was in to the latest (one pass
    under ``stop="first_exhausted"``), given the ``lineage`` saved beside them when they name
    one, and where the new consumers start: each table at its earliest pass."""
    if not saved:
        raise ValueError("an elastic resume needs the states of every consumer of the saved epoch, and got none")
    first = saved[0]
    for state in saved:
        if (state.epoch, state.remainder) != (first.epoch, first.remainder):
            raise ValueError(
                f"the Mixture states of {first.shard} and {state.shard} are of other epochs or re-plans "
                f"(epoch {first.epoch}, lineage {first.remainder}; epoch {state.epoch}, lineage {state.remainder})"
            )
    earlier = _earlier(first, lineage)
    if earlier is not None and len(earlier.tables) != len(tables):
        raise ValueError(
            f"the Mixture re-plan lineage holds {len(earlier.tables)} tables, but the mixture has {len(tables)}; "
            "it belongs to another mixture"
        )
    finished = [state.shard for state in saved if first.stop == "first_exhausted" and ended(first.stop, state.tables)]
    passes: list[list[TablePass]] = []
    current: list[int] = []
    for index, table in enumerate(tables):
        found = sorted({state.tables[index].passes for state in saved})
        low, high = (found[0], found[-1]) if first.stop == "cycle" else (0, 0)
        if earlier is not None and first.stop == "cycle":
            # A pass the earlier re-plan shared stays a share of its remainder, begun or not.
            high = max(high, earlier.start.passes[index] + len(earlier.passes_of(index)) - 1)
        shared: list[TablePass] = []
        for number in range(low, high + 1):
            table_epoch = pass_epoch(first.epoch, number)
            before = None if earlier is None else earlier.of(index, table_epoch)
            made = State(
                table.version,
                first.shard,
                first.batch_size,
                table_epoch,
                table.policy,
                None,
                None,
                remainder=None if before is None else before.digest,
            )
            # A consumer behind this pass has not begun its list; one ahead delivered all of it.
            states = [
                (state.states[index] if state.tables[index].passes == number else None)
                or replace(made, shard=state.shard).to_dict()
                for state in saved
            ]
            ahead = [state.shard for state in saved if state.tables[index].passes > number]
            shared.append(TablePass(states, finished + ahead, None if before is None else before.to_dict()))
        passes.append(shared)
        current.append(low)
    rows = tuple(sum(state.tables[index].rows for state in saved) for index in range(len(tables)))
    return passes, MixtureStart(first.epoch, tuple(current), rows, _rank_step(saved, earlier))


def _rank_step(saved: Sequence[MixtureState], earlier: MixtureLineage | None) -> int:
    """The batches a saved rank had delivered in the epoch, as the mean over ranks: consumer ``w``
    of ``K`` takes its rank's steps ``w, w + K, ...`` from the step its epoch (or the re-plan
    ``earlier``) began at."""
    base = 0 if earlier is None else earlier.start.step
    ranks: dict[int, int] = {}
    for state in saved:
        delivered = (state.next_step - base - state.shard.worker) // state.shard.workers
        ranks[state.shard.rank] = ranks.get(state.shard.rank, 0) + max(0, delivered)
    return base + round(sum(ranks.values()) / len(ranks))


def _earlier(first: MixtureState, lineage: Mapping[str, Any] | None) -> MixtureLineage | None:
    """The lineage the saved states name, checked against ``lineage``; ``None`` when they name none."""
    if first.remainder is None:
        return None
    if lineage is None:
        raise ValueError(
            f"the Mixture states continue an epoch re-planned before (lineage {first.remainder}); pass the lineage "
            "saved beside them (Mixture.lineage()) as load_elastic(states, lineage=...)"
        )
    earlier = MixtureLineage.from_dict(lineage)
    if (earlier.digest, earlier.start.epoch) != (first.remainder, first.epoch):
        raise ValueError(
            f"the Mixture states name lineage {first.remainder} of epoch {first.epoch}; the lineage given is "
            f"{earlier.digest} of epoch {earlier.start.epoch}"
        )
    return earlier
