"""Elastic re-plans of a ``Mixture`` epoch: each table's pass in progress, re-planned for the
consumers of another topology.

A mixture consumer reads each table's work list pass after pass. A re-plan shares, table by
table, the rows of the pass in progress that no saved consumer delivered (``elastic.replan``
over that table's states), so each row of a pass is delivered once. That needs every saved
consumer in the same pass of the table: under ``stop="cycle"`` consumers in different passes
read lists of different table epochs, which one re-plan cannot join, so such states are refused.
Under ``stop="first_exhausted"`` every consumer reads pass 0 only, and one whose epoch has ended
counts as finished in every table: what it left stays out of the epoch, as it would have.

The new consumers start each table at the pass in progress, with an equal share of the rows all
saved consumers delivered of it, so the deficit choice keeps the epoch's proportions. A *mixture
lineage* is every table's lineage for the re-planned epoch; it is kept once per checkpoint and
each consumer's state names it by digest.
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
    the pass the re-plan shared, and ``start``, where the re-plan's consumers began."""

    KIND: ClassVar[str] = "Mixture re-plan"

    start: MixtureStart
    tables: tuple[RowLineage, ...]

    def _digest_parts(self) -> Iterator[bytes]:
        start = ",".join(str(value) for value in (self.start.epoch, *self.start.passes, *self.start.rows))
        yield ";".join([start, *(table.digest for table in self.tables)]).encode()
        if self.start.step:
            yield f";step={self.start.step}".encode()

    def _fields(self) -> dict[str, Any]:
        fields = {
            "epoch": self.start.epoch,
            "passes": list(self.start.passes),
            "rows": list(self.start.rows),
            "tables": [table.to_dict() for table in self.tables],
        }
        return fields | ({"step": self.start.step} if self.start.step else {})

    @classmethod
    def _parse(cls, data: Mapping[str, Any]) -> Self:
        passes, rows = tuple(int(v) for v in data["passes"]), tuple(int(v) for v in data["rows"])
        start = MixtureStart(int(data["epoch"]), passes, rows, int(data.get("step", 0)))
        return cls(start, tuple(RowLineage.from_dict(table) for table in data["tables"]))

    def _check(self) -> None:
        if len(self.start.passes) != len(self.start.rows) or len(self.tables) > len(self.start.passes):
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
) -> tuple[list[TablePass], MixtureStart]:
    """Each table's re-plan for the mixture consumers ``saved`` (every consumer of one topology,
    one epoch), given the ``lineage`` saved beside them when they name one, and where the new
    consumers start; ``ValueError`` naming the table when a table's passes differ under
    ``stop="cycle"``."""
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
    passes: list[TablePass] = []
    current: list[int] = []
    for index, table in enumerate(tables):
        found = sorted({state.tables[index].passes for state in saved})
        if first.stop == "cycle" and len(found) > 1:
            raise ValueError(
                f"the saved Mixture consumers are in different passes {found} of table {index} (stop='cycle'): "
                "their lists come from different table epochs, which one re-plan cannot share exactly. Resume under "
                "the saved ranks and workers (load_state_dict) and change them at the start of an epoch, or mix "
                "with stop='first_exhausted', whose consumers all read one pass"
            )
        number = found[0] if first.stop == "cycle" else 0
        table_epoch = pass_epoch(first.epoch, number)
        before = None if earlier is None else earlier.tables[index]
        if before is not None and before.epoch != table_epoch:
            before = None
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
        states = [state.states[index] or replace(made, shard=state.shard).to_dict() for state in saved]
        passes.append(TablePass(states, finished, None if before is None else before.to_dict()))
        current.append(number)
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
