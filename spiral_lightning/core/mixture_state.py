"""The saved state of one consumer of a ``Mixture``: where each table stands, and the settings
the state is valid for."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from spiral_lightning.core import integrity
from spiral_lightning.core.checks import is_count
from spiral_lightning.core.plan import Shard
from spiral_lightning.core.state import check_saved

#: The version of the dictionary ``Mixture.state_dict`` writes.
MIXTURE_FORMAT = 1

#: The settings a mixture state must match to be restored: of the consumer, and of the mixture.
#: Not the weights: a mixture given new ones applies them from the saved position on.
MIXTURE_SETTINGS = ("seed", "stop", "batch_size", "shard")


def pass_epoch(epoch: int, passes: int) -> int:
    """The epoch a table is read in for its pass ``passes`` (0 first) of mixture epoch ``epoch``.

    Cantor's pairing of the two numbers: every (epoch, pass) reads its own table epoch, so a
    shuffling policy orders every pass differently and a restarted pass is the same everywhere.
    """
    total = epoch + passes
    return total * (total + 1) // 2 + passes


class Progress(NamedTuple):
    """Where one table of a mixture stands in the epoch on one consumer.

    ``passes`` counts the passes read to the end (the current pass is number ``passes``), ``rows``
    the rows delivered from the table this epoch over all passes, and ``empty`` says a pass gave
    this consumer no rows, so ``stop="cycle"`` never chooses the table again this epoch.
    """

    passes: int = 0
    rows: int = 0
    empty: bool = False


@dataclass(frozen=True)
class MixtureState:
    """One consumer's position in a mixture and the settings it is valid for.

    ``tables`` holds each table's progress and ``states`` each table's ``TableDataset`` state for
    its current pass, ``None`` for a pass not begun. ``remainder`` is the digest of the lineage of
    an epoch re-planned from another topology (see ``spiral_lightning.elastic_mixture``).
    ``weights`` are those in force and ``since`` each table's rows when they took effect (empty:
    at the epoch's start), so that a change of weights shapes only the rows after it. ``step`` is
    the rank's step of the consumer's next batch (``core.schedule``); ``None`` in a state saved
    before steps were kept, which ``next_step`` estimates from its rows in whole batches.
    """

    seed: int
    stop: str
    weights: tuple[float, ...]
    batch_size: int
    shard: Shard
    epoch: int
    tables: tuple[Progress, ...]
    states: tuple[dict[str, Any] | None, ...]
    remainder: str | None = None
    since: tuple[int, ...] = ()
    step: int | None = None
    #: Whether the dictionary ``from_dict`` read still matched its digest (or had none).
    intact: bool = field(default=True, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """Plain values only, so a state survives ``torch.save`` and JSON alike; the lineage's
        digest only in a re-planned epoch, so other states keep their form."""
        data: dict[str, Any] = {
            "format": MIXTURE_FORMAT,
            "seed": self.seed,
            "stop": self.stop,
            "weights": list(self.weights),
            "batch_size": self.batch_size,
            "shard": list(self.shard),
            "epoch": self.epoch,
            "tables": [
                {"passes": progress.passes, "rows": progress.rows, "empty": progress.empty, "state": state}
                for progress, state in zip(self.tables, self.states, strict=True)
            ],
        }
        if self.remainder is not None:
            data["remainder"] = self.remainder
        if any(self.since):
            data["since"] = list(self.since)
        if self.step is not None:
            data["step"] = self.step
        return integrity.sealed(data)

    def widened(self, tables: int) -> MixtureState:
        """This state for a mixture of ``tables`` tables: the saved ones first, in their order, and
        each table added after them at the start of its first pass. ``ValueError`` when the
        mixture has fewer tables than the state."""
        added = tables - len(self.tables)
        if added < 0:
            raise ValueError(
                f"the Mixture state holds {len(self.tables)} tables, but the mixture has {tables}: a table can be "
                "added on resume (after the saved ones), not removed"
            )
        if added == 0:
            return self
        # An added table had weight 0 so far: the weights in force differ, so they restart at the stop.
        return replace(
            self,
            weights=(*self.weights, *[0.0] * added),
            tables=(*self.tables, *[Progress()] * added),
            states=(*self.states, *[None] * added),
            since=(*self.since, *[0] * added) if self.since else (),
        )

    @property
    def next_step(self) -> int:
        """The rank's step of this consumer's next batch (see ``step``)."""
        if self.step is not None:
            return self.step
        delivered = sum(table.rows for table in self.tables) // self.batch_size
        return self.shard.worker + delivered * self.shard.workers

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, check_digest: bool = True) -> MixtureState:
        """The state ``to_dict`` wrote; ``ValueError``, ``TypeError`` or ``KeyError`` naming the
        field when ``data`` is not one, ``ValueError`` when it no longer matches its digest
        (``check_digest=False`` leaves that to the caller: ``check_intact``)."""
        try:
            state = cls._parsed(data)
        except (TypeError, KeyError, ValueError) as error:
            if isinstance(data, Mapping) and not integrity.intact(data):
                raise integrity.damaged("Mixture", found=str(error)) from error
            raise
        if check_digest:
            state.check_intact()
        return state

    def check_intact(self) -> None:
        """``ValueError`` when the dictionary this state was read from no longer matched its digest."""
        if not self.intact:
            raise integrity.damaged("Mixture", f"rank {self.shard.rank}, worker {self.shard.worker}")

    @classmethod
    def _parsed(cls, data: Mapping[str, Any]) -> MixtureState:
        check_saved(
            data, "Mixture", MIXTURE_FORMAT, ("seed", "stop", "weights", "batch_size", "shard", "epoch", "tables")
        )
        for name in ("seed", "batch_size", "epoch"):
            if not is_count(data[name]):
                raise ValueError(f"the Mixture state's {name} must be a non-negative int, not {data[name]!r}")
        shard = data["shard"]
        if not isinstance(shard, list | tuple) or len(shard) != 4 or not all(is_count(v) for v in shard):
            raise ValueError(f"the Mixture state's shard must be 4 ints, not {shard!r}")
        weights = data["weights"]
        if not isinstance(weights, list | tuple) or not all(isinstance(w, float) for w in weights):
            raise TypeError(f"the Mixture state's weights must be a list of floats, not {weights!r}")
        tables = data["tables"]
        if not isinstance(tables, list | tuple) or len(tables) != len(weights):
            raise ValueError(f"the Mixture state's tables must be a list of {len(weights)} entries, one per weight")
        progress: list[Progress] = []
        states: list[dict[str, Any] | None] = []
        for index, table in enumerate(tables):
            if not isinstance(table, Mapping) or {"passes", "rows", "empty", "state"} - table.keys():
                raise ValueError(
                    f"the Mixture state's tables[{index}] must hold passes, rows, empty and state, not {table!r}"
                )
            for name in ("passes", "rows"):
                if not is_count(table[name]):
                    raise ValueError(
                        f"the Mixture state's tables[{index}].{name} must be a non-negative int, not {table[name]!r}"
                    )
            if not isinstance(table["empty"], bool):
                raise TypeError(f"the Mixture state's tables[{index}].empty must be a bool, not {table['empty']!r}")
            if table["state"] is not None and not isinstance(table["state"], Mapping):
                raise TypeError(f"the Mixture state's tables[{index}].state must be a mapping or None")
            progress.append(Progress(table["passes"], table["rows"], table["empty"]))
            states.append(None if table["state"] is None else dict(table["state"]))
        remainder = data.get("remainder")
        if remainder is not None and not isinstance(remainder, str):
            raise TypeError(f"the Mixture state's remainder must be a lineage digest, not {str(remainder)[:100]!r}")
        since = data.get("since", [])
        if not isinstance(since, list | tuple) or len(since) not in (0, len(tables)) or not all(map(is_count, since)):
            raise ValueError(f"the Mixture state's since must be {len(tables)} non-negative ints, not {since!r}")
        step = data.get("step")
        if step is not None and not is_count(step):
            raise ValueError(f"the Mixture state's step must be a non-negative int, not {step!r}")
        return cls(
            seed=data["seed"],
            stop=str(data["stop"]),
            weights=tuple(weights),
            batch_size=data["batch_size"],
            shard=Shard(*shard).check(),
            epoch=data["epoch"],
            tables=tuple(progress),
            states=tuple(states),
            remainder=remainder,
            since=tuple(since),
            step=step,
            intact=integrity.intact(data),
        )

    def check_matches(self, current: MixtureState, fields: tuple[str, ...] = MIXTURE_SETTINGS) -> None:
        """``ValueError`` naming every setting of ``fields`` under which this saved state differs
        from ``current``."""
        differ = [
            f"{name}: saved {getattr(self, name)!r}, now {getattr(current, name)!r}"
            for name in fields
            if getattr(self, name) != getattr(current, name)
        ]
        if differ and not self.intact:
            raise integrity.damaged("Mixture", found="; ".join(differ))
        if differ:
            raise ValueError(
                "the Mixture state was saved under other settings ("
                + "; ".join(differ)
                + "); restore it into a mixture built like the one that saved it"
            )


def ended(stop: str, tables: tuple[Progress, ...] | list[Progress]) -> bool:
    """Whether a consumer whose tables stand at ``tables`` has ended its epoch under ``stop``:
    a table read to its end under ``"first_exhausted"``, every table under ``"cycle"``."""
    passes = [progress.passes > 0 for progress in tables]
    return any(passes) if stop == "first_exhausted" else all(passes)
