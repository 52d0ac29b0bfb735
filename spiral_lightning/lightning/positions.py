"""Where a SpiralDataModule's train loader resumes: the checkpoint entry's version checked against
the run's, whether its positions continue as they are or through a re-plan, and the position a
re-plan leaves."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from spiral_lightning.datasets.consumer import Consumer
from spiral_lightning.datasets.job import Layout, needs_replan
from spiral_lightning.datasets.mapstyle import TableMapDataset
from spiral_lightning.datasets.mixture import Mixture
from spiral_lightning.datasets.table import TableDataset
from spiral_lightning.datasets.token_batches import TokenBatchDataset
from spiral_lightning.datasets.windows import WindowDataset
from spiral_lightning.lightning.checkpoint import consumers
from spiral_lightning.lightning.loader import Position

#: What a SpiralDataModule trains on.
Train = TableDataset | TableMapDataset | Mixture | WindowDataset | TokenBatchDataset


def log_on_rank_zero(message: str) -> None:
    """Lightning's ``rank_zero_info``, imported when first needed: Ray Train's loaders import this
    module, and a plain Ray loop should not import Lightning (2-3 s of each process's start)."""
    from lightning.pytorch.utilities import rank_zero_info

    rank_zero_info(message)


def tables_of(dataset: TableDataset | Mixture | WindowDataset | TokenBatchDataset) -> list[Consumer]:
    """The consumers a train dataset reads through: its own, a mixture's tables, a window's table."""
    if isinstance(dataset, Mixture):
        return list(dataset.tables)
    return [dataset.table if isinstance(dataset, WindowDataset) else dataset]


def version_of(dataset: Train) -> str:
    """The pinned version a train loader reads, as a checkpoint names it."""
    if isinstance(dataset, Mixture):
        return dataset.version
    return dataset.table.spec.version if isinstance(dataset, WindowDataset) else dataset.spec.version


def check_version(state: dict[str, Any], dataset: Train) -> None:
    """``ValueError`` when the checkpoint entry ``state`` was saved reading another version."""
    if state["version"] == version_of(dataset):
        return
    uris = (
        dataset.spec.uri if isinstance(dataset, TableMapDataset) else [table.spec.uri for table in tables_of(dataset)]
    )
    raise ValueError(
        f"the checkpoint was saved reading table version {state['version']}, but this run reads version "
        f"{version_of(dataset)} ({uris}); a position is only valid in the version it was saved in: train on "
        "that version, or start this one without ckpt_path"
    )


def replans(
    state: dict[str, Any],
    now: Layout,
    *,
    map_access: bool,
    reweighted: Callable[[Mapping[str, Any]], bool] | None = None,
) -> bool:
    """Whether ``state``'s positions continue through a re-planned remainder: saved under another
    world size, worker count or batch size than ``now``, inside an epoch re-planned before, or (a
    mixture's, whose epoch length follows its weights) under weights ``reweighted`` says changed."""
    if map_access:
        inside = "lineage" in state
    else:
        states = consumers(state)
        # A WindowDataset's state nests its table's.
        inside = any("remainder" in consumer.get("table", consumer) for consumer in states)
        inside |= reweighted is not None and any(map(reweighted, states))
    # Checkpoints of release 0.1 hold no batch size: they resume under the one given now.
    saved = Layout(state["world_size"], state["num_workers"], state.get("batch_size", now.batch_size))
    return needs_replan(saved, now, inside_replan=inside)


def replanned_position(
    dataset: TableDataset | Mixture | WindowDataset | TokenBatchDataset, state: dict[str, Any], now: Layout
) -> Position | None:
    """Share the rows that ``state``'s consumers had not delivered among this run's: the epoch and
    the batches it had delivered, or ``None`` when no rank had started reading."""
    positions = [rank["position"] for rank in state["ranks"]]
    if all(position is None for position in positions):
        return None
    if any(position is None for position in positions):
        raise ValueError("the checkpoint holds positions for some ranks only; it cannot be re-planned")
    dataset.load_elastic(consumers(state), lineage=state.get("lineage"))
    log_on_rank_zero(
        f"SpiralDataModule: re-planned epoch {dataset.epoch}, saved by {state['world_size']} ranks with "
        f"num_workers={state['num_workers']} and batch_size={state.get('batch_size', now.batch_size)}, for "
        f"{now.world_size} ranks with num_workers={now.workers} and batch_size={now.batch_size}"
    )
    return Position(dataset.epoch, positions[0]["batches"], {})


def rank_position(state: dict[str, Any], rank: int) -> Position | None:
    """Rank ``rank``'s position in the checkpoint entry ``state`` (``None`` before it read)."""
    saved = state["ranks"][rank]
    if saved["rank"] != rank:
        raise ValueError(f"the checkpoint's position {rank} belongs to rank {saved['rank']}")
    return None if saved["position"] is None else Position(**saved["position"])
