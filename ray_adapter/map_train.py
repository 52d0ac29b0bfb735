"""Ray Train through random access, ``train_loader(..., access="map")``: a rank's batches of rows
drawn by a sampler that shuffles the table with ``(seed, epoch)``, as ``SpiralDataModule(access=
"map")`` draws them, and the position a rank saves and a run of another world size re-plans."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ray_adapter.files import FINISHED, STATE_FILES, STATE_FORMAT
from spiral_lightning.core.integrity import damaged, intact
from spiral_lightning.datasets.loader import Loader
from spiral_lightning.datasets.mapstyle import TableMapDataset
from spiral_lightning.lightning.map_access import MapTraining


class MapLoader(Loader):
    """A ``StatefulDataLoader`` of one rank's batches under ``access="map"``: ``training``'s
    sampler draws the rank's row numbers of each epoch and the dataset reads them. Set the epoch
    with ``set_epoch`` (``epoch`` is the one to read next after a restore).

        loader = train_loader("spiral:data/demo", access="map", batch_size=64)
        for epoch in range(loader.epoch, 3):
            loader.set_epoch(epoch)
    """

    def __init__(self, dataset: TableMapDataset, training: MapTraining, **options: Any) -> None:
        super().__init__(dataset, **training.options(None), **options)
        self.training = training
        # The batches of the epoch delivered before a re-plan, which a position counts too.
        self.before = 0

    @property
    def epoch(self) -> int:
        """The epoch the sampler draws."""
        epoch: int = self.training.sampler.epoch
        return epoch

    def set_epoch(self, epoch: int) -> None:
        """Draw ``epoch``'s order (a re-planned epoch keeps its share of the remainder)."""
        if epoch != self.epoch:
            self.before = 0
        self.training.prepare(epoch)

    def position(self) -> dict[str, Any]:
        """This rank's place in its epoch: the epoch and the batches delivered in it."""
        return {"epoch": self.epoch, "batches": self.before + int(self.state_dict().get("_num_yielded", 0))}

    def replan(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Deal the row numbers the ranks of ``states`` (every rank's saved state, rank 0's with the
        lineage of an epoch re-planned before) had not delivered to this run's ranks."""
        entry: dict[str, Any] = {
            "ranks": [{"position": state["position"]} for state in states],
            "world_size": states[0]["world_size"],
            "batch_size": states[0]["batch_size"],
        }
        lineage = next((state["lineage"] for state in states if "lineage" in state), None)
        if lineage is not None:
            entry["lineage"] = lineage
        replanned = self.training.replan(entry)
        if replanned is not None:
            self.training.sampler.set_epoch(replanned.epoch)
            self.before = replanned.batches

    def lineage(self) -> dict[str, Any] | None:
        """The lineage of the epoch read when a re-plan made it, else ``None``."""
        return self.training.lineage()


def map_state(loader: MapLoader) -> dict[str, Any]:
    """What an ``access="map"`` rank saves: its position (epoch, batches) beside the loader's own
    state, and in rank 0's file the lineage of a re-planned epoch."""
    sampler = loader.training.sampler
    state = {
        "format": STATE_FORMAT,
        "access": "map",
        "version": loader.dataset.spec.version,
        "rank": sampler.rank,
        "world_size": sampler.num_replicas,
        "num_workers": loader.num_workers,
        "batch_size": loader.training.batch_size,
        "epoch": loader.epoch,
        "loader": loader.state_dict(),
        "position": loader.position(),
    }
    lineage = loader.lineage()
    if lineage is not None and sampler.rank == 0:
        state["lineage"] = lineage
    return state


def restore_map(loader: MapLoader, folder: str | Path) -> None:
    """``restore_loader_state`` for an ``access="map"`` loader: its own position under the saved
    world size and batch size, else every rank's undelivered row numbers re-planned."""
    sampler = loader.training.sampler
    states = [torch.load(path, weights_only=True) for path in sorted(Path(folder).glob(STATE_FILES))]
    for state in states:
        if not isinstance(state, Mapping) or state.get("access") != "map" or "position" not in state:
            raise ValueError(f"{str(folder)!r} holds loader states not saved by an access='map' train_loader")
        if not intact(state):
            raise damaged("Ray loader", f"rank {state.get('rank')!r} in {str(folder)!r}")
        if state["version"] != loader.dataset.spec.version:
            raise ValueError(
                f"cannot resume rank {sampler.rank}: the checkpoint read version {state['version']}, this run reads "
                f"{loader.dataset.spec.version}; resume on the saving run's version, or pass resume=False"
            )
    if not states:
        raise FileNotFoundError(f"the checkpoint {str(folder)!r} holds no loader state; save it with save_loader_state")
    # In rank order: a re-plan deals what each rank delivered by its place (rank 10 sorts before 2 by name).
    states.sort(key=lambda state: int(state["rank"]))
    first = states[0]
    if (first["world_size"], first["batch_size"]) != (sampler.num_replicas, loader.training.batch_size) or any(
        "lineage" in state for state in states
    ):
        if len(states) != first["world_size"]:
            raise ValueError(
                f"the checkpoint holds {len(states)} rank states of {first['world_size']}; re-planning needs all"
            )
        loader.replan(states)
        return
    own = next(state for state in states if state["rank"] == sampler.rank)
    if own["loader"].get(FINISHED, False):
        loader.set_epoch(own["epoch"] + 1)
        return
    loader.set_epoch(own["epoch"])
    loader.load_state_dict(own["loader"])
