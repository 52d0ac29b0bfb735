"""A SpiralDataModule's entry in a Lightning checkpoint: found whatever the DataModule class is
called, sealed with a digest, checked when loaded, and required when the fit loop resumes
mid-epoch.

Lightning files a DataModule's ``state_dict`` under the class's qualified name and restores it
only into a class of that name, so a run resumed under a subclass or a renamed class would read
its epoch from the start while the fit loop continues mid-epoch. ``lightning.callbacks``'s
``CheckpointPosition`` (which the DataModule adds to the Trainer when fitting) also files the
entry under ``CHECKPOINT_KEY``, finds it there (or by its ``ENTRY_KIND``, with this module's
``find_entry``) when Lightning did not, and refuses a mid-epoch resume that finds none.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping
from typing import Any

from spiral_lightning.core import integrity
from spiral_lightning.core.checks import is_count
from spiral_lightning.datasets.job import Layout

#: The version of the dictionary ``SpiralDataModule.state_dict`` writes.
STATE_FORMAT = 1

#: The key every SpiralDataModule's entry is also filed under, whatever its class is called (a
#: qualified name never holds a ``/``). The same object as the class-named entry: saved once.
CHECKPOINT_KEY = "spiral_lightning/datamodule"

#: The entry's ``kind``: what finds an entry filed under another class name without the key.
ENTRY_KIND = "spiral_lightning.SpiralDataModule"

#: The fields of an entry, by which one saved before it had a ``kind`` is found.
ENTRY_FIELDS = frozenset({"format", "version", "world_size", "num_workers", "ranks"})

#: What ``SpiralDataModule(missing_position=...)`` takes: refuse a mid-epoch resume without a
#: position, or read that epoch's data from its start on purpose.
MISSING_POSITION = ("refuse", "restart_epoch")


def seal_entry(
    version: str, layout: Layout, ranks: list[Any], lineage: dict[str, Any] | None, skipped: int = 0
) -> dict[str, Any]:
    """The entry ``SpiralDataModule.state_dict`` writes: the ``version`` read, the ``layout`` and
    every rank's position under it, the ``lineage`` of a re-planned epoch (kept once here, its
    consumers' states name it by digest) and the training steps ``skipped`` so far (see
    ``skips``), with its format and ``ENTRY_KIND``, sealed with a digest."""
    state = {
        "format": STATE_FORMAT,
        "version": version,
        "world_size": layout.world_size,
        "num_workers": layout.workers,
        "batch_size": layout.batch_size,
        "ranks": ranks,
    }
    if lineage is not None:
        state["lineage"] = lineage
    if skipped:
        state["skipped"] = skipped
    return integrity.sealed({**state, "kind": ENTRY_KIND})


def check_entry(state: Any, *, iterable: bool, rank: int) -> None:
    """``ValueError`` naming the field unless ``state`` is an entry ``SpiralDataModule.state_dict``
    wrote: its format, a position (or ``None``) for each of its ranks, every consumer's dataset
    state in each position (``iterable`` access), and fields that match its digest.

    A dataset state of ``rank``'s own that no longer matches its own digest is left to that
    dataset's ``load_state_dict``, which refuses it before any row and names the field it can
    (a cursor out of range, a setting that differs); another rank's is refused here, so that
    every rank refuses a damaged checkpoint."""
    if not isinstance(state, Mapping):
        raise ValueError(f"the SpiralDataModule checkpoint entry must be a mapping, not {type(state).__name__}")
    try:
        _check_fields(state, iterable)
    except (TypeError, KeyError, ValueError) as error:
        if not integrity.intact(state):
            raise integrity.damaged("SpiralDataModule", "the checkpoint entry", str(error)) from error
        raise
    if integrity.intact(state):
        return
    for saved_rank, saved in enumerate(state["ranks"] if iterable else ()):
        states = [] if saved["position"] is None else integrity.dataset_states(saved["position"]["loader"])
        for worker, consumer in enumerate(states):
            if not integrity.intact(consumer) and saved_rank == rank:
                return
            if not integrity.intact(consumer):
                found = f"the dataset state of rank {saved_rank}, worker {worker} no longer matches its own digest"
                raise integrity.damaged("SpiralDataModule", "the checkpoint entry", found)
    raise integrity.damaged("SpiralDataModule", "the checkpoint entry")


def _check_fields(state: Mapping[str, Any], iterable: bool) -> None:
    if state.get("format") != STATE_FORMAT:
        raise ValueError(
            f"unknown SpiralDataModule state format {state.get('format')!r}; this version reads {STATE_FORMAT}"
        )
    missing = sorted(ENTRY_FIELDS - state.keys())
    if missing:
        raise ValueError(f"the SpiralDataModule checkpoint entry lacks the fields {missing}")
    ranks, world_size = state["ranks"], state["world_size"]
    if not isinstance(ranks, list | tuple) or not is_count(world_size) or len(ranks) != world_size:
        raise ValueError(
            f"the checkpoint holds {len(ranks) if isinstance(ranks, list | tuple) else ranks!r} positions for "
            f"{world_size!r} ranks"
        )
    if not isinstance(state["version"], str) or not is_count(state["num_workers"]):
        raise ValueError("the SpiralDataModule checkpoint entry's version or num_workers is not one it writes")
    if not is_count(state.get("skipped", 0)):
        raise ValueError(
            f"the SpiralDataModule checkpoint entry's skipped {state['skipped']!r} is not a count of steps"
        )
    batch_size = state.get("batch_size", 1)
    if not is_count(batch_size) or batch_size < 1:
        raise ValueError(f"the SpiralDataModule checkpoint entry's batch_size {batch_size!r} is not a positive int")
    for rank, saved in enumerate(ranks):
        if not isinstance(saved, Mapping) or saved.get("rank") != rank or "position" not in saved:
            raise ValueError(f"the checkpoint's ranks[{rank}] is not rank {rank}'s position: {str(saved)[:100]}")
        position = saved["position"]
        if position is None:
            continue
        if not isinstance(position, Mapping) or {"epoch", "batches", "loader"} - position.keys():
            raise ValueError(f"the checkpoint's position of rank {rank} must hold epoch, batches and loader")
        for name in ("epoch", "batches"):
            if not is_count(position[name]):
                raise ValueError(
                    f"the checkpoint's position of rank {rank} has {name} {position[name]!r}, not a non-negative int"
                )
        if iterable:
            integrity.dataset_states(position["loader"], f"rank {rank}")
        elif not isinstance(position["loader"], Mapping):
            raise ValueError(f"the checkpoint's position of rank {rank} has a loader state that is no mapping")


def consumers(state: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Every consumer's dataset state in a SpiralDataModule entry, rank by rank."""
    return [
        consumer
        for rank, saved in enumerate(state["ranks"])
        if saved["position"] is not None
        for consumer in integrity.dataset_states(saved["position"]["loader"], f"rank {rank}")
    ]


def find_entry(checkpoint: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The SpiralDataModule entry of ``checkpoint`` whatever class saved it: under
    ``CHECKPOINT_KEY``, else the one entry marked ``ENTRY_KIND`` or (saved before entries had a
    kind) holding an entry's fields; ``None`` when there is none."""
    entry = checkpoint.get(CHECKPOINT_KEY)
    if isinstance(entry, Mapping):
        return entry
    found = {
        key: value
        for key, value in checkpoint.items()
        if isinstance(value, Mapping) and (value.get("kind") == ENTRY_KIND or value.keys() >= ENTRY_FIELDS)
    }
    if len(found) > 1:
        raise ValueError(
            f"the checkpoint holds SpiralDataModule positions under several keys {sorted(found)}; keep the one of "
            f"the run to resume (or copy it to {CHECKPOINT_KEY!r}) and delete the others"
        )
    return next(iter(found.values()), None)


def mid_epoch(checkpoint: Mapping[str, Any]) -> tuple[int, int] | None:
    """The epoch and the batches of it the fit loop of ``checkpoint`` had trained when it was
    saved inside an epoch, else ``None`` (saved after an epoch's last batch, or holding no loop)."""
    loops = checkpoint.get("loops")
    fit = loops.get("fit_loop") if isinstance(loops, Mapping) else None
    progress = fit.get("epoch_loop.batch_progress") if isinstance(fit, Mapping) else None
    if not isinstance(progress, Mapping) or progress.get("is_last_batch"):
        return None
    current = progress.get("current")
    batches = current.get("ready", 0) if isinstance(current, Mapping) else 0
    return (int(checkpoint.get("epoch", 0)), int(batches)) if batches else None


def __getattr__(name: str) -> Any:
    """``CheckpointPosition``, which moved to ``lightning.callbacks`` in 0.2 (so that this module,
    which Ray Train's loaders import, does not import Lightning), for one release. Looked up by
    name, as ``spiral_lightning._moved`` looks up the names of moved modules: the new module
    imports this one."""
    if name == "CheckpointPosition":
        warnings.warn(
            f"{__name__}.CheckpointPosition moved to spiral_lightning.lightning.callbacks; import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module("spiral_lightning.lightning.callbacks"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
