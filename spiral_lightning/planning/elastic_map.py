"""Elastic re-plans of map-style access: the row numbers a sampler's epoch had not delivered,
dealt to another number of ranks.

Under ``access="map"`` rank ``r`` of ``W`` reads the indices of torchdata's
``StatefulDistributedSampler``: the epoch's permutation of the row numbers (``torch.randperm``
seeded with ``seed + epoch``), cut to a multiple of ``W`` when ``W > 1`` and dealt ``r, r + W,
...``. A rank's position is the batches it delivered, so its undelivered indices are its list
after ``batches * batch_size``, whatever its worker count. A *map link* records one re-plan: the
saved world size and the indices each rank had delivered. The *remainder*, every rank's
undelivered indices rank after rank, is dealt to the new ranks the same way, cut to a multiple of
their number (fewer rows than ranks left out, as in every map epoch). A *map lineage* (the table's
rows, the seed, the epoch and the links) makes the remainder again, so a re-planned epoch can be
saved and re-planned again; it holds one int per saved rank of each re-plan.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Self

import numpy as np
import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from spiral_lightning.planning.lineage import Lineage


class MapLink(NamedTuple):
    """One re-plan's input: ``world_size`` saved ranks and the indices ``delivered[r]`` that
    rank ``r`` had delivered from the front of its list."""

    world_size: int
    delivered: tuple[int, ...]


def permutation(rows: int, seed: int, epoch: int) -> np.ndarray:
    """The order of ``rows`` row numbers that ``StatefulDistributedSampler`` draws in ``epoch``
    with ``seed`` (``torch.randperm`` seeded with ``seed + epoch``), as int64 indices."""
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    indices: np.ndarray = torch.randperm(rows, generator=generator).numpy()
    return indices


def dealt(indices: np.ndarray, world_size: int) -> list[np.ndarray]:
    """Each of ``world_size`` ranks' share of ``indices``, as ``DistributedSampler(drop_last=
    world_size > 1)`` deals them: cut to a multiple of the ranks, then every ``world_size``-th."""
    total = indices.size - indices.size % world_size if world_size > 1 else indices.size
    return [indices[rank:total:world_size] for rank in range(world_size)]


@dataclass(frozen=True)
class MapLineage(Lineage):
    """What makes a re-planned map epoch's remainder again: the sampler's lists of ``rows``
    indices in ``epoch`` with ``seed``, then one ``MapLink`` per re-plan, in order. ``batches``
    counts the batches each rank had delivered in the epoch when the last re-plan began its lists
    (0 with no link), so that a rank's position, which counts the whole epoch, gives what it
    delivered from its list."""

    KIND: ClassVar[str] = "map re-plan"

    rows: int
    seed: int
    epoch: int
    links: tuple[MapLink, ...] = ()
    batches: int = 0

    def remainder(self) -> np.ndarray:
        """The indices no rank of the last link delivered, rank after rank."""
        indices = permutation(self.rows, self.seed, self.epoch)
        for link in self.links:
            lists = dealt(indices, link.world_size)
            indices = np.concatenate(
                [mine[min(done, mine.size) :] for mine, done in zip(lists, link.delivered, strict=True)]
            )
        return indices

    def then(self, link: MapLink, batches: int) -> MapLineage:
        """This lineage continued by a re-plan of ``link``, made when the epoch had delivered
        ``batches`` batches on each rank."""
        return MapLineage(self.rows, self.seed, self.epoch, (*self.links, link), batches)

    def _digest_parts(self) -> Iterator[bytes]:
        yield f"{self.rows};{self.seed};{self.epoch};{self.batches}".encode()
        for link in self.links:
            yield f";{link.world_size}:{','.join(map(str, link.delivered))}".encode()

    def _fields(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "seed": self.seed,
            "epoch": self.epoch,
            "links": [{"world_size": link.world_size, "delivered": list(link.delivered)} for link in self.links],
            "batches": self.batches,
        }

    @classmethod
    def _parse(cls, data: Mapping[str, Any]) -> Self:
        links = tuple(
            MapLink(int(link["world_size"]), tuple(int(done) for done in link["delivered"])) for link in data["links"]
        )
        return cls(int(data["rows"]), int(data["seed"]), int(data["epoch"]), links, int(data["batches"]))

    def _check(self) -> None:
        for link in self.links:
            if link.world_size < 1 or len(link.delivered) != link.world_size or min(link.delivered) < 0:
                raise ValueError(
                    f"the map re-plan lineage's link of {link.world_size} ranks holds {list(link.delivered)}; "
                    "it was edited or damaged"
                )


class ReplannedSampler(StatefulDistributedSampler):  # type: ignore[misc]  # torchdata ships no type hints
    """torchdata's ``StatefulDistributedSampler`` (shuffled, ``drop_last`` on more than one rank)
    that, in the epoch of its ``lineage`` (see ``replan``), yields this rank's share of that
    lineage's remainder instead, with the same resumable position; every other epoch is the
    sampler's own."""

    def __init__(self, dataset: Dataset[Any], *, world_size: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=world_size > 1)
        self.lineage: MapLineage | None = None
        self._share: np.ndarray | None = None

    def replan(self, lineage: MapLineage) -> int:
        """Read this rank's share of ``lineage``'s remainder in its epoch; the rows the cut to a
        multiple of the ranks leaves out of it."""
        self.lineage = lineage
        remainder = lineage.remainder()
        self._share = dealt(remainder, self.num_replicas)[self.rank]
        return int(remainder.size - self._share.size * self.num_replicas)

    def drawn(self) -> np.ndarray:
        """This rank's row numbers of the epoch set, in the order it reads them: its share of a
        re-planned remainder, or its deal of the epoch's permutation (as the sampler draws it)."""
        share = self._replanned()
        if share is not None:
            return share
        return dealt(permutation(len(self.dataset), self.seed, self.epoch), self.num_replicas)[self.rank]

    def _replanned(self) -> np.ndarray | None:
        """This rank's share of the remainder while its epoch is read, else ``None``."""
        if self.lineage is None or self.lineage.epoch != self.epoch:
            return None
        return self._share

    def __iter__(self) -> Iterator[int]:
        share = self._replanned()
        if share is None:
            yield from super().__iter__()
            return
        # StatefulDistributedSampler's position, kept the same way over the share.
        resumed: int | None = getattr(self, "next_yielded", None)
        self.yielded, self.next_yielded = resumed or 0, None
        for index in itertools.islice(share.tolist(), self.yielded, None):
            self.yielded += 1
            yield index

    def __len__(self) -> int:
        share = self._replanned()
        return int(self.num_samples if share is None else share.size)
