"""Lineages: what makes an elastic remainder again from the plan alone (see
``spiral_lightning.planning.elastic``), as values with a digest and a plain-dict form."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from spiral_lightning.core.plan import Plan, Shard
from spiral_lightning.core.state import State
from spiral_lightning.planning.policies import balanced, policy_name

#: The share of a remainder among consumers that read rows: ``balanced`` cuts.
BALANCED = policy_name(balanced)

#: The version of the dictionary ``Lineage.to_dict`` writes.
LINEAGE_FORMAT = 1


class Link(NamedTuple):
    """One re-plan's input: ``world_size`` x ``workers`` saved consumers and, for consumer ``c``
    (``rank * workers + worker``), the index ``items[c]`` of the first item of its work list
    with undelivered rows and the stored row ``rows[c]`` they begin at (``items[c]`` is the
    list's length when the consumer was done). A consumer inside a shuffle window begins its
    window there: ``windows[c]`` numbers the window and ``taken[c]`` counts its rows delivered
    (0 outside a window). ``leads[c]`` is the lead of a windowed consumer (0 for rows)."""

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
class Lineage:
    """What makes an epoch's remainder again from the plan of ``version``: the ``policy`` (by
    name) and ``epoch`` of the first lists, one ``Link`` per re-plan since, in order, and the
    ``share`` (by name) each re-plan's consumers cut their remainder with."""

    version: str
    policy: str
    epoch: int
    links: tuple[Link, ...]
    share: str = BALANCED

    @property
    def digest(self) -> str:
        """A short digest of the whole lineage, which consumer states name it by."""
        digest = hashlib.sha256(f"{self.version};{self.policy};{self.epoch}".encode())
        if self.share != BALANCED:
            digest.update(f";{self.share}".encode())
        for link in self.links:
            digest.update(f";{link.world_size}x{link.workers}:".encode())
            digest.update(link.items.astype("<i8").tobytes())
            digest.update(link.rows.astype("<i8").tobytes())
            if link.inside_windows:
                digest.update(link.windows.astype("<i8").tobytes())
                digest.update(link.taken.astype("<i8").tobytes())
            if link.leads.any():
                digest.update(b";leads")
                digest.update(link.leads.astype("<i8").tobytes())
        return digest.hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        """Plain values only, so a lineage survives ``torch.save`` and JSON alike."""
        data: dict[str, Any] = {
            "format": LINEAGE_FORMAT,
            "version": self.version,
            "policy": self.policy,
            "epoch": self.epoch,
            "links": [_link_dict(link) for link in self.links],
        }
        if self.share != BALANCED:
            data["share"] = self.share
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Lineage:
        """The lineage ``to_dict`` wrote; ``ValueError`` naming the field when ``data`` is not one."""
        if not isinstance(data, Mapping) or data.get("format") != LINEAGE_FORMAT:
            raise ValueError(f"not a re-plan lineage of format {LINEAGE_FORMAT}: {str(data)[:200]}")
        try:
            links = tuple(_link_of(link) for link in data["links"])
            share = str(data.get("share", BALANCED))
            lineage = cls(str(data["version"]), str(data["policy"]), int(data["epoch"]), links, share)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"the re-plan lineage is damaged: {error!r}") from None
        for link in links:
            consumers = Shard(0, link.world_size, 0, link.workers).check().world_size * link.workers
            if any(
                column.shape != (consumers,) for column in (link.items, link.rows, link.windows, link.taken, link.leads)
            ):
                raise ValueError(
                    f"the re-plan lineage's link of {link.world_size}x{link.workers} consumers holds "
                    f"{link.items.size} and {link.rows.size} positions; it was edited or damaged"
                )
        return lineage


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
