"""Lineages: what makes an elastic remainder again from the plan alone, as values with a
digest and a plain-dict form.

``Lineage`` is the one type of every re-plan's lineage: it owns the digest a consumer state
names a lineage by, the dictionary a checkpoint keeps and the check of a dictionary read back.
A kind of re-plan says only what its lineage holds: ``RowLineage`` (below) for the stored rows
of ``TableDataset``, ``WindowDataset`` and ``PackedDataset`` (see
``spiral_lightning.planning.elastic``), ``MixtureLineage`` for a mixture's tables, and
``MapLineage`` for a sampler's row numbers under ``access="map"``.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Self

import numpy as np

from spiral_lightning.core.plan import Plan, Shard
from spiral_lightning.core.state import State
from spiral_lightning.planning.policies import balanced, policy_name

#: The share of a remainder among consumers that read rows: ``balanced`` cuts.
BALANCED = policy_name(balanced)


class Lineage(ABC):
    """A re-planned epoch's lineage: what makes its *remainder* (the rows no saved consumer
    delivered) again from the plan alone, so that the epoch can be saved and re-planned again.
    Subclasses are frozen dataclasses that say what they hold (``_fields``, ``_parse``,
    ``_digest_parts``); their dictionaries and digests are pinned: checkpoints keep them."""

    #: The kind's name in errors about its dictionaries.
    KIND: ClassVar[str]
    #: The version of the dictionary ``to_dict`` writes.
    FORMAT: ClassVar[int] = 1

    @abstractmethod
    def _fields(self) -> dict[str, Any]:
        """The lineage as plain values, beside the format."""

    @classmethod
    @abstractmethod
    def _parse(cls, data: Mapping[str, Any]) -> Self:
        """The lineage ``_fields`` wrote; ``KeyError``, ``TypeError`` or ``ValueError`` when a field is wrong."""

    @abstractmethod
    def _digest_parts(self) -> Iterator[bytes]:
        """What the digest hashes, in order."""

    @abstractmethod
    def _check(self) -> None:
        """``ValueError`` when the parsed values cannot belong together (an edited dictionary)."""

    @property
    def digest(self) -> str:
        """A short digest of the whole lineage, which consumer states name it by."""
        digest = hashlib.sha256()
        for part in self._digest_parts():
            digest.update(part)
        return digest.hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """Plain values only, so a lineage survives ``torch.save`` and JSON alike."""
        return {"format": self.FORMAT, **self._fields()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """The lineage ``to_dict`` wrote; ``ValueError`` naming the field when ``data`` is not one."""
        if not isinstance(data, Mapping) or data.get("format") != cls.FORMAT:
            raise ValueError(f"not a {cls.KIND} lineage of format {cls.FORMAT}: {str(data)[:200]}")
        try:
            lineage = cls._parse(data)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"the {cls.KIND} lineage is damaged: {error!r}") from None
        lineage._check()
        return lineage


class Link(NamedTuple):
    """One re-plan's input: ``world_size`` x ``workers`` saved consumers and, for consumer ``c``
    (``rank * workers + worker``), the index ``items[c]`` of the first item of its work list
    with undelivered rows and the stored row ``rows[c]`` they begin at (``items[c]`` is the
    list's length when the consumer was done). A consumer inside a window (of shuffled rows, or
    of a token budget's documents) begins its window there: ``windows[c]`` numbers the window
    and ``taken[c]`` counts its progress there (rows, or batches, delivered; 0 outside a
    window). ``leads[c]`` is the lead of a windowed consumer (0 for rows)."""

    world_size: int
    workers: int
    items: np.ndarray
    rows: np.ndarray
    windows: np.ndarray
    taken: np.ndarray
    leads: np.ndarray

    @property
    def inside_windows(self) -> bool:
        """Whether a consumer of the link had delivered part of a shuffle window."""
        return bool(self.taken.any())


class Remainder(NamedTuple):
    """The rows of an epoch no saved consumer delivered, as a plan of stored ranges in saved
    consumer order, and each range's lead (see ``Link``; 0 but where a windowed consumer resumes)."""

    plan: Plan
    leads: np.ndarray


@dataclass(frozen=True)
class RowLineage(Lineage):
    """The lineage of a re-plan of stored rows: the plan of ``version`` by the ``policy`` (by
    name) and ``epoch`` of the first lists, one ``Link`` per re-plan since, in order, and the
    ``share`` (by name) each re-plan's consumers cut their remainder with. ``windows`` names the
    kind of window a link's ``windows`` and ``taken`` count in (``WindowHoles.name``): empty for
    shuffle windows of rows."""

    KIND: ClassVar[str] = "re-plan"

    version: str
    policy: str
    epoch: int
    links: tuple[Link, ...]
    share: str = BALANCED
    windows: str = ""

    def _digest_parts(self) -> Iterator[bytes]:
        yield f"{self.version};{self.policy};{self.epoch}".encode()
        if self.share != BALANCED:
            yield f";{self.share}".encode()
        if self.windows:
            yield f";windows {self.windows}".encode()
        for link in self.links:
            yield f";{link.world_size}x{link.workers}:".encode()
            yield link.items.astype("<i8").tobytes()
            yield link.rows.astype("<i8").tobytes()
            if link.inside_windows:
                yield link.windows.astype("<i8").tobytes()
                yield link.taken.astype("<i8").tobytes()
            if link.leads.any():
                yield b";leads"
                yield link.leads.astype("<i8").tobytes()

    def _fields(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "version": self.version,
            "policy": self.policy,
            "epoch": self.epoch,
            "links": [_link_dict(link) for link in self.links],
        }
        if self.share != BALANCED:
            data["share"] = self.share
        if self.windows:
            data["windows"] = self.windows
        return data

    @classmethod
    def _parse(cls, data: Mapping[str, Any]) -> Self:
        links = tuple(_link_of(link) for link in data["links"])
        return cls(
            str(data["version"]),
            str(data["policy"]),
            int(data["epoch"]),
            links,
            str(data.get("share", BALANCED)),
            str(data.get("windows", "")),
        )

    def _check(self) -> None:
        for link in self.links:
            consumers = Shard(0, link.world_size, 0, link.workers).check().world_size * link.workers
            if any(
                column.shape != (consumers,) for column in (link.items, link.rows, link.windows, link.taken, link.leads)
            ):
                raise ValueError(
                    f"the re-plan lineage's link of {link.world_size}x{link.workers} consumers holds "
                    f"{link.items.size} and {link.rows.size} positions; it was edited or damaged"
                )


def _link_dict(link: Link) -> dict[str, Any]:
    """A link as plain values; the window columns only when a consumer was inside a window, the
    leads only when a windowed consumer had one."""
    data: dict[str, Any] = {
        "world_size": link.world_size,
        "workers": link.workers,
        "items": link.items.tolist(),
        "rows": link.rows.tolist(),
    }
    if link.inside_windows:
        data["windows"] = link.windows.tolist()
        data["taken"] = link.taken.tolist()
    if link.leads.any():
        data["leads"] = link.leads.tolist()
    return data


def _link_of(data: Mapping[str, Any]) -> Link:
    """The link ``_link_dict`` wrote."""
    items = np.asarray(data["items"], dtype=np.int64)
    outside = np.zeros(items.shape, dtype=np.int64)
    return Link(
        int(data["world_size"]),
        int(data["workers"]),
        items,
        np.asarray(data["rows"], dtype=np.int64),
        np.asarray(data.get("windows", outside), dtype=np.int64),
        np.asarray(data.get("taken", outside), dtype=np.int64),
        np.asarray(data.get("leads", outside), dtype=np.int64),
    )


def check_lineage(kind: str, saved: State, lineage: Lineage | None, epoch: int) -> None:
    """``ValueError`` when ``saved`` (a ``kind`` state) names a lineage other than ``lineage``, the
    one this dataset re-planned ``epoch`` with: its remainder is not the one the state points into."""
    if saved.remainder is None or (lineage is not None and lineage.digest == saved.remainder and epoch == saved.epoch):
        return
    raise ValueError(
        f"the {kind} state continues epoch {saved.epoch} re-planned from another topology (lineage "
        f"{saved.remainder}), which this dataset has not re-planned; restore it with "
        "load_elastic(every consumer's state, lineage=the lineage() saved beside them)"
    )
