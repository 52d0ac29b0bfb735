"""Cursors, the saved state of one consumer, and the checks that keep a state on its own work."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from spiral_lightning.core import integrity
from spiral_lightning.core.checks import is_int
from spiral_lightning.core.integrity import damaged, sealed
from spiral_lightning.core.plan import Shard, WorkItem

#: The version of the dictionary ``State.to_dict`` writes.
STATE_FORMAT = 1


class Cursor(NamedTuple):
    """The next undelivered row of a consumer: output row ``skip`` counted from stored row ``row``
    of work item ``item``. Every row before it has been delivered.

    A cursor at ``item == len(work list)`` means the consumer's work is done. A consumer that
    shuffles its rows in windows (``Shuffled(buffer_rows=...)``) points at the first row of its
    current window instead: ``window`` numbers that window and ``taken`` counts its rows already
    delivered, in the window's shuffled order.
    """

    item: int
    row: int
    skip: int = 0
    window: int = 0
    taken: int = 0


@dataclass(frozen=True)
class State:
    """One consumer's cursor and the settings it is valid for.

    ``version`` names the table version, ``shard`` the consumer, ``policy`` the policy function
    and ``work`` the fingerprint of the work list the cursor points into. ``cursor`` is ``None``
    before the consumer delivered its first row of the epoch. ``rows_per_consumer`` is the quota of
    rows the consumer stops after (``None``: no quota) and ``delivered`` the rows it delivered this
    epoch, so a resumed consumer stops at the same row as an uninterrupted one. ``skipped`` counts
    the rows of the epoch whose media could not be decoded and were dropped (``on_error="skip"``).
    ``remainder`` is the digest of the lineage of an epoch re-planned from another topology (see
    ``spiral_lightning.elastic``): its consumers share that remainder instead of the policy's
    lists, and the lineage itself is kept once per checkpoint, not in every state.
    """

    version: str
    shard: Shard
    batch_size: int | None
    epoch: int
    policy: str
    work: str | None
    cursor: Cursor | None
    rows_per_consumer: int | None = None
    delivered: int = 0
    skipped: int = 0
    remainder: str | None = None
    intact: bool = field(default=True, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """Plain values only, so a state survives ``torch.save`` and JSON alike.

        The quota fields are written only for a consumer with a quota, so the states of every
        other dataset keep the exact form they had before quotas existed.
        """
        data: dict[str, Any] = {
            "format": STATE_FORMAT,
            "version": self.version,
            "shard": list(self.shard),
            "batch_size": self.batch_size,
            "epoch": self.epoch,
            "policy": self.policy,
            "work": self.work,
            "cursor": None if self.cursor is None else _cursor_list(self.cursor),
        }
        if self.rows_per_consumer is not None:
            data["rows_per_consumer"] = self.rows_per_consumer
            data["delivered"] = self.delivered
        if self.skipped:
            data["skipped"] = self.skipped
        if self.remainder is not None:
            data["remainder"] = self.remainder
        return sealed(data)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, check_digest: bool = True) -> State:
        """The state ``to_dict`` wrote; ``ValueError``, ``TypeError`` or ``KeyError`` naming the
        field when ``data`` is not one, and ``ValueError`` when its fields do not match its digest
        (a field it cannot read named in it). With ``check_digest=False`` a digest that does not
        match is left to the caller, in ``intact``: a load that names the field out of range first,
        then calls ``check_intact``."""
        try:
            state = cls._parsed(data)
        except (TypeError, KeyError, ValueError) as error:
            if isinstance(data, Mapping) and not integrity.intact(data):
                raise damaged("TableDataset", found=str(error)) from error
            raise
        if check_digest:
            state.check_intact("TableDataset")
        return state

    def where(self) -> str:
        """The consumer this state is of, as errors name it."""
        return f"rank {self.shard.rank}, worker {self.shard.worker}"

    def check_intact(self, kind: str) -> None:
        """``ValueError`` when the dictionary this state was read from no longer matched its digest."""
        if not self.intact:
            raise damaged(kind, self.where())

    @classmethod
    def _parsed(cls, data: Mapping[str, Any]) -> State:
        check_saved(
            data, "TableDataset", STATE_FORMAT, ("version", "shard", "batch_size", "epoch", "policy", "work", "cursor")
        )
        shard = _ints(data["shard"], "shard", 4)
        cursor = None if data["cursor"] is None else _ints(data["cursor"], "cursor", 3, 5)
        if cursor is not None and min(cursor) < 0:
            raise ValueError(f"the state's cursor {cursor} has a negative position")
        batch_size = data["batch_size"]
        if batch_size is not None and not is_int(batch_size):
            raise TypeError(f"the state's batch_size must be an int or None, not {batch_size!r}")
        if not is_int(data["epoch"]) or data["epoch"] < 0:
            raise ValueError(f"the state's epoch must be a non-negative int, not {data['epoch']!r}")
        quota, delivered = data.get("rows_per_consumer"), data.get("delivered", 0)
        if quota is not None and (not is_int(quota) or quota < 0):
            raise ValueError(f"the state's rows_per_consumer must be a non-negative int or None, not {quota!r}")
        if not is_int(delivered) or delivered < 0:
            raise ValueError(f"the state's delivered must be a non-negative int, not {delivered!r}")
        if cursor is None and delivered:
            raise ValueError(
                f"the state's cursor is None, but its delivered says {delivered} rows of the epoch were delivered; "
                "the state was edited or damaged"
            )
        skipped = data.get("skipped", 0)
        if not is_int(skipped) or skipped < 0:
            raise ValueError(f"the state's skipped must be a non-negative int, not {skipped!r}")
        for name in ("version", "policy"):
            if not isinstance(data[name], str):
                raise TypeError(f"the state's {name} must be a string, not {data[name]!r}")
        if data["work"] is not None and not isinstance(data["work"], str):
            raise TypeError(f"the state's work fingerprint must be a string or None, not {data['work']!r}")
        remainder = data.get("remainder")
        if remainder is not None and not isinstance(remainder, str):
            raise ValueError(
                "the state's remainder must be the digest of a re-plan lineage, not "
                f"{str(remainder)[:100]!r}; a state that holds its remainder's rows was saved by an earlier "
                "spiral-lightning: finish that epoch with it, or start the epoch afresh"
            )
        return cls(
            version=data["version"],
            shard=Shard(*shard).check(),
            batch_size=batch_size,
            epoch=data["epoch"],
            policy=data["policy"],
            work=data["work"],
            cursor=None if cursor is None else Cursor(*cursor),
            rows_per_consumer=quota,
            delivered=delivered,
            skipped=skipped,
            remainder=remainder,
            intact=integrity.intact(data),
        )

    def check_matches(self, current: State) -> None:
        """``ValueError`` naming every setting under which this saved state differs from ``current``.

        The epoch, work fingerprint, cursor and delivered rows are what a state carries, not what
        it must match.
        """
        fields = ("version", "shard", "batch_size", "policy", "rows_per_consumer")
        differ = [
            f"{name}: saved {getattr(self, name)!r}, now {getattr(current, name)!r}"
            for name in fields
            if getattr(self, name) != getattr(current, name)
        ]
        if differ and not self.intact:
            raise damaged("TableDataset", self.where(), "; ".join(differ))
        if differ:
            other_batch = self.batch_size != current.batch_size
            raise ValueError(
                "the TableDataset state was saved under other settings ("
                + "; ".join(differ)
                + "); restore it into a dataset built like the one that saved it"
                + (
                    ", or continue its epoch in batches of another size with load_elastic(every saved consumer's "
                    "state), which re-plans the rows none of them delivered"
                    if other_batch and len(differ) == 1
                    else ""
                )
            )


def check_cursor(cursor: Cursor, items: Sequence[WorkItem]) -> None:
    """``ValueError`` unless ``cursor`` points into ``items``: at a stored row of its work item,
    or at the end of the list, with no more output rows to skip than its item has stored rows
    from there. A cursor elsewhere would read rows of another consumer or none."""
    if cursor.item < len(items):
        item = items[cursor.item]
        if item.start <= cursor.row <= item.end and cursor.skip <= item.end - cursor.row:
            return
        if item.start <= cursor.row <= item.end:
            raise ValueError(
                f"the state's cursor {tuple(cursor)} skips {cursor.skip} rows from stored row {cursor.row}, but its "
                f"work item (stored rows {item.start}..{item.end} of split {item.split}) has {item.end - cursor.row} "
                "left; the state was edited or damaged"
            )
        where = f"stored rows {item.start}..{item.end} of split {item.split}"
    elif cursor.item == len(items) and cursor.row == 0 and cursor.skip == 0:
        return
    else:
        where = f"the {len(items)} work items, or their end (a cursor of ({len(items)}, 0, 0))"
    raise ValueError(
        f"the state's cursor {tuple(cursor)} points outside this consumer's work: expected a position in {where}; "
        "the state was edited or damaged"
    )


def check_same_topology(kind: str, saved: Shard, current: Shard) -> None:
    """``ValueError`` when a ``kind`` state saved by consumer ``saved`` meets a consumer of
    another number of ranks or workers: one consumer's state cannot continue there, so the error
    names ``load_elastic``, which re-plans the epoch from every saved consumer's state."""
    if (saved.world_size, saved.workers) == (current.world_size, current.workers):
        return
    raise ValueError(
        f"the {kind} state was saved by a consumer of {saved.world_size} ranks x {saved.workers} workers, and is "
        f"restored into one of {current.world_size} ranks x {current.workers} workers; one consumer's state "
        f"continues only under its own ranks and workers: re-plan the epoch with {kind}.load_elastic(every saved "
        "consumer's state, lineage=the lineage() saved beside them), or resume under the saved ranks and workers"
    )


def check_saved(data: Any, kind: str, format: int, fields: Iterable[str]) -> None:
    """Check that ``data`` is a state a ``kind`` dataset saved in ``format`` with ``fields``:
    ``TypeError`` when it is no mapping, ``ValueError`` for another format, ``KeyError`` naming
    the fields it lacks."""
    if not isinstance(data, Mapping):
        raise TypeError(f"a {kind} state is a mapping, not {type(data).__name__}")
    if data.get("format") != format:
        raise ValueError(f"unknown {kind} state format {data.get('format')!r}; this version reads format {format}")
    missing = sorted(set(fields) - data.keys())
    if missing:
        raise KeyError(f"the {kind} state lacks the fields {missing}")


def _ints(value: Any, name: str, *lengths: int) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or len(value) not in lengths or not all(is_int(v) for v in value):
        counts = " or ".join(str(length) for length in lengths)
        raise ValueError(f"the state's {name} must be {counts} ints, not {value!r}")
    return tuple(value)


def _cursor_list(cursor: Cursor) -> list[int]:
    """A cursor as plain ints; a cursor outside any shuffle window keeps the three of its form."""
    return list(cursor) if cursor.window or cursor.taken else list(cursor[:3])
