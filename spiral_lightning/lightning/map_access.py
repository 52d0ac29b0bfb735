"""Training through random access, ``SpiralDataModule(access="map")``: a rank's rows drawn by a
sampler that shuffles the table with ``(seed, epoch)``, and the re-plan of a position saved by
another number of ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import default_collate

from spiral_lightning.datasets.mapstyle import TableMapDataset
from spiral_lightning.lightning.loader import Position
from spiral_lightning.lightning.positions import log_on_rank_zero
from spiral_lightning.planning.elastic_map import MapLineage, MapLink, ReplannedSampler
from spiral_lightning.reading.frames import Last


class MapTraining:
    """The sampler of one rank's ``access="map"`` training and the epoch arithmetic around it.

    ``prepare(epoch)`` sets the sampler to ``epoch`` and returns the rank's batches in it;
    ``replan(state)`` continues a DataModule state saved under another topology; ``options`` are
    the DataLoader settings that draw batches through the sampler.

        training = MapTraining(TableMapDataset("spiral:data/demo"), rank=0, world_size=2, seed=0,
                               batch_size=64, last="keep_partial")
        batches = training.prepare(0)
    """

    def __init__(
        self, dataset: TableMapDataset, *, rank: int, world_size: int, seed: int, batch_size: int, last: Last
    ) -> None:
        # Dropping the last rows (fewer than one per rank) keeps ranks equal without the repeated
        # rows that DistributedSampler pads with otherwise.
        self.sampler = ReplannedSampler(dataset, world_size=world_size, rank=rank, seed=seed)
        self.seed = seed
        self.batch_size = batch_size
        self.last = last
        dropped = len(dataset) - len(self.sampler) * world_size
        if dropped:
            log_on_rank_zero(f"SpiralDataModule: access='map' leaves {dropped} rows out of each epoch for equal ranks")

    def prepare(self, epoch: int) -> int:
        """Draw ``epoch``'s order; the rank's batches in it."""
        self.sampler.set_epoch(epoch)
        if self.last == "require_full":
            return len(self.sampler) // self.batch_size
        return -(-len(self.sampler) // self.batch_size)

    def options(self, transform: Callable[[Any], Any] | None) -> dict[str, Any]:
        """The DataLoader settings that read batches of this sampler's rows, ``transform``
        applied to each collated batch in the worker that reads it."""
        return {
            "batch_size": self.batch_size,
            "sampler": self.sampler,
            "drop_last": self.last == "require_full",
            "collate_fn": None if transform is None else _TransformedCollate(transform),
        }

    def lineage(self) -> dict[str, Any] | None:
        """The lineage of the epoch the sampler reads when a re-plan made it, else ``None``."""
        lineage = self.sampler.lineage
        return lineage.to_dict() if lineage is not None and lineage.epoch == self.sampler.epoch else None

    def replan(self, state: dict[str, Any]) -> Position | None:
        """Deal the row numbers that ``state``'s ranks had not delivered in their sampler order
        to this run's ranks (see ``elastic_map``): the epoch and the batches it had delivered,
        or ``None`` when no rank had started reading."""
        positions = [rank["position"] for rank in state["ranks"]]
        if all(position is None for position in positions):
            return None
        if any(position is None for position in positions):
            raise ValueError("the checkpoint holds positions for some ranks only; it cannot be re-planned")
        epoch = positions[0]["epoch"]
        if any(position["epoch"] != epoch for position in positions):
            raise ValueError(
                f"the checkpoint's ranks stopped in different epochs {[p['epoch'] for p in positions]}; "
                "an access='map' position is re-planned only when every rank stopped in one epoch"
            )
        rows = len(self.sampler.dataset)
        lineage = MapLineage(rows, self.seed, epoch)
        if "lineage" in state:
            lineage = MapLineage.from_dict(state["lineage"])
            if (lineage.rows, lineage.seed, lineage.epoch) != (rows, self.seed, epoch):
                raise ValueError(
                    f"the checkpoint's map re-plan lineage is of {lineage.rows} rows, seed {lineage.seed} and epoch "
                    f"{lineage.epoch}; this run reads {rows} rows with seed {self.seed} in epoch {epoch}: resume "
                    "with the seed and table that saved it"
                )
        # Every batch since the last re-plan is of the saving run's size (release 0.1 saved none).
        saved_batch = state.get("batch_size", self.batch_size)
        delivered = tuple((position["batches"] - lineage.batches) * saved_batch for position in positions)
        link = MapLink(state["world_size"], delivered)
        dropped = self.sampler.replan(lineage.then(link, positions[0]["batches"]))
        left_out = f", leaving out {dropped} rows of it for equal ranks" if dropped else ""
        log_on_rank_zero(
            f"SpiralDataModule: re-planned access='map' epoch {epoch}, saved by {state['world_size']} ranks, for "
            f"{self.sampler.num_replicas} ranks{left_out}"
        )
        return Position(epoch, positions[0]["batches"], {})


class _TransformedCollate:
    """torch's default collate, then a DataModule's ``transform`` on the batch: what a worker
    does with the rows a sampler drew under ``access="map"`` (a class, so that it pickles)."""

    def __init__(self, transform: Callable[[Any], Any]) -> None:
        self.transform = transform

    def __call__(self, rows: list[Any]) -> Any:
        return self.transform(default_collate(rows))
