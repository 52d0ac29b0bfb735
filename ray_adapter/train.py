"""Ray Train: each worker's resumable loader over its rank's rows, and its position in checkpoints.

A worker of a Ray Train run is one rank. ``train_loader`` gives it the loader ``TableDataset``
would give that rank; ``save_loader_state`` writes the loader's position into the folder the worker
reports as a checkpoint, one file per rank, so the reported checkpoint holds every rank's
position; the next ``train_loader`` of a restarted run reads its own file back.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import ray.train
import torch
import torch.distributed
from torchdata.stateful_dataloader import StatefulDataLoader

from ray_adapter.files import FINISHED, STATE_FILES, STATE_FORMAT, state_file
from ray_adapter.map_train import MapLoader, map_state, restore_map
from ray_adapter.recording import Recording
from spiral_lightning.core.budget import TokenBudget
from spiral_lightning.core.integrity import damaged, dataset_states, intact, sealed
from spiral_lightning.core.plan import Policy
from spiral_lightning.core.spec import TableSpec, as_spec
from spiral_lightning.core.storage import StorageOptions
from spiral_lightning.datasets.consumer import DEFAULT_READ_AHEAD
from spiral_lightning.datasets.groups import group_size
from spiral_lightning.datasets.job import (
    Layout,
    distributed,
    even_epoch,
    fewest_batches,
    needs_replan,
    pinned,
    torch_broadcast,
)
from spiral_lightning.datasets.loader import Loader, loader_options, without_set_vital_warning, workers_for
from spiral_lightning.datasets.mapstyle import TableMapDataset
from spiral_lightning.datasets.mixture import Mixture, Stop
from spiral_lightning.datasets.packing import PackedDataset
from spiral_lightning.datasets.table import TableDataset
from spiral_lightning.datasets.token_batches import TokenBatchDataset
from spiral_lightning.datasets.windows import WindowDataset, Windows
from spiral_lightning.lightning.loader import consumer_states
from spiral_lightning.lightning.map_access import MapTraining
from spiral_lightning.lightning.positions import tables_of, version_of
from spiral_lightning.planning.policies import stripe
from spiral_lightning.reading.frames import Last
from spiral_lightning.reading.packing import Packing
from spiral_lightning.reading.tensors import to_torch

_log = logging.getLogger(__name__)

#: What ``_CountedLoader._limited`` gets from a finished iteration.
_NONE = object()

#: The iterable datasets ``train_loader`` reads: rows (plain or packed), a mixture, windows or
#: token budgets (``access="map"`` reads through ``map_train.MapLoader``).
Streamed = TableDataset | Mixture | WindowDataset | TokenBatchDataset


def train_loader(
    spec: TableSpec | str | Sequence[tuple[TableSpec | str, float]],
    *,
    batch_size: int | None = None,
    num_workers: int | None = None,
    policy: Policy | str | None = None,
    shuffle: bool = False,
    seed: int = 0,
    last: Last = "keep_partial",
    collate: Callable[[pa.RecordBatch], Any] | None = to_torch,
    rows_per_consumer: int | None = None,
    multiprocessing_context: Literal["forkserver", "spawn"] = "forkserver",
    pin_memory: bool = False,
    resume: bool = True,
    even_batches: bool = True,
    read_ahead: int = DEFAULT_READ_AHEAD,
    read_threads: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    packing: Packing | None = None,
    windows: Windows | None = None,
    stop: Stop = "first_exhausted",
    table_key: str | None = None,
    access: Literal["iterable", "map"] = "iterable",
    tokens: TokenBudget | None = None,
    record: str | None = None,
) -> StatefulDataLoader:
    """This Ray Train worker's loader: a ``StatefulDataLoader`` over the ``TableDataset`` of its
    rank, in frames of ``batch_size`` rows, read by ``num_workers`` DataLoader workers (by default
    ``workers_for``'s: none for plain columns, processes for a transform or media; persistent,
    and started as ``TableDataset.loader`` starts them), each ``read_ahead`` read batches ahead of
    ``read_threads`` work items read at once (see ``TableDataset``); ``storage_options`` reach a
    Parquet table in an object store (see ``TableSpec``).

    ``policy`` deals the work lists (``balanced`` by default); ``shuffle=True`` reads a new order
    every epoch from ``seed`` instead (see ``TableDataset``). With ``packing`` the loader reads a
    ``PackedDataset``: batches of ``batch_size`` blocks of the packing's token column (``collate``
    does not apply), with the same even batches, checkpoints and re-plans. ``spec`` as a list of
    ``(table, weight)`` pairs reads a ``Mixture`` of them (``stop`` and ``table_key`` as there),
    and ``windows`` a ``WindowDataset`` of the table; such kinds count their own batches, so with
    ``even_batches`` every rank reads the fewest batches any rank has in each epoch.
    ``tokens`` batches whole documents by a token budget (a ``TokenBatchDataset``); ``record`` (a
    folder or uri) notes each batch's stored rows at the rank's step, its batches since the run
    began (``spiral_lightning.record``).
    ``access="map"`` reads rows by index, drawn by a sampler that shuffles the table with ``seed``
    and the epoch (``map_train.MapLoader``: set its epoch with ``loader.set_epoch``).

    Call it inside the train loop: rank and world size come from ``ray.train.get_context()``, and
    every rank reads the version rank 0 resolved. With ``resume`` and a checkpoint from
    ``ray.train.get_checkpoint()``, the loader continues at the position this rank saved there
    with ``save_loader_state``, and ``loader.dataset.epoch`` is the epoch to read next, so a loop
    ``for epoch in range(loader.dataset.epoch, epochs)`` that calls ``loader.dataset.set_epoch``
    picks up where the stopped run was. ``ValueError`` when that state belongs to another table
    version or other settings.

    With ``even_batches`` and more than one rank, every consumer of every rank reads the same
    number of rows in each epoch (``TableDataset.even_rows``, at most ``rows_per_consumer``), so
    ranks that synchronize every step (DDP) take the same number of steps instead of one waiting
    forever; the rows past the quota are left out of that epoch, and rank 0 logs how many at the
    start of every epoch, with a warning when that is more than a batch per consumer. The default
    policy ``"balanced"`` gives every consumer the same stored rows, so it leaves out at most one
    row per consumer (more only under a filter that keeps unevenly); ``even_batches=False`` reads
    every row, in batch counts that may differ between ranks.
    """
    if (batch_size is None) != (tokens is not None):
        raise ValueError(
            "train_loader takes batch_size (rows, blocks or windows a batch), or tokens= (a TokenBudget that sizes "
            f"each batch), not both: got batch_size={batch_size!r}, tokens={tokens!r}"
        )
    mixed = not isinstance(spec, TableSpec | str)
    given = (("a mixture", mixed), ("packing", packing), ("windows", windows), ("tokens", tokens))
    kinds = [kind for kind, on in given if on]
    if len(kinds) > 1:
        raise ValueError(f"train_loader reads one kind of dataset, but {' and '.join(kinds)} were given: choose one")
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    settings: dict[str, Any] = {
        "batch_size": batch_size,
        "last": last,
        "policy": policy,
        "shuffle": shuffle,
        "seed": seed,
        "rank": rank,
        "world_size": world_size,
        "rows_per_consumer": rows_per_consumer,
        "read_ahead": read_ahead,
        "read_threads": read_threads,
    }
    broadcast = torch_broadcast if distributed() else None
    if access == "map":
        if kinds or not isinstance(spec, TableSpec | str) or batch_size is None or record is not None:
            raise ValueError(
                "access='map' reads one table's rows by index in batches of batch_size, not recorded yet: leave "
                f"packing, windows, tokens and record unset and give one table (given: {', '.join(kinds) or 'record'})"
            )
        mapped = TableMapDataset(pinned(as_spec(spec, storage_options), rank, broadcast), read_threads=read_threads)
        training = MapTraining(mapped, rank=rank, world_size=world_size, seed=seed, batch_size=batch_size, last=last)
        started = {"multiprocessing_context": multiprocessing_context} if num_workers else {}
        with without_set_vital_warning():
            map_loader = MapLoader(mapped, training, num_workers=num_workers or 0, pin_memory=pin_memory, **started)
        return _restored(map_loader, resume)
    dataset = _dataset(spec, settings, storage_options, broadcast, collate, packing, windows, tokens, stop, table_key)
    num_workers = workers_for(dataset, num_workers)
    for table in tables_of(dataset):
        table.check_shares(num_workers)
    options: dict[str, Any] = {"pin_memory": pin_memory, "batch_size": None, "group": group_size(dataset)}
    if num_workers:
        options["multiprocessing_context"] = multiprocessing_context
    with without_set_vital_warning():
        made = loader_options(num_workers, options, dataset)
        if not isinstance(dataset, TableDataset):
            loader: _Recorded = _CountedLoader(dataset, even=even_batches, **made)
        else:
            loader = (_EvenLoader if even_batches and world_size > 1 else _Recorded)(dataset, **made)
    if record is not None:
        stores = None if storage_options is None else StorageOptions(storage_options)
        loader.recording = Recording(record, dataset, rank, stores)
    return _restored(loader, resume)


def _restored(loader: Loader, resume: bool) -> Loader:
    """``loader`` at the position of the checkpoint Ray Train restarts from, if asked and any."""
    checkpoint = ray.train.get_checkpoint() if resume else None
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            restore_loader_state(loader, folder)
    return loader


def _dataset(
    spec: TableSpec | str | Sequence[tuple[TableSpec | str, float]],
    settings: dict[str, Any],
    storage_options: Mapping[str, Any] | None,
    broadcast: Any,
    collate: Callable[[pa.RecordBatch], Any] | None,
    packing: Packing | None,
    windows: Windows | None,
    tokens: TokenBudget | None,
    stop: Stop,
    table_key: str | None,
) -> Streamed:
    """The dataset ``train_loader`` reads for this rank (one kind, see there), every table pinned."""
    rank = settings["rank"]
    if not isinstance(spec, TableSpec | str):
        pairs = [(pinned(as_spec(table, storage_options), rank, broadcast), weight) for table, weight in spec]
        mixed = {name: settings[name] for name in ("batch_size", "policy", "shuffle", "seed", "rank", "world_size")}
        return Mixture(
            pairs, stop=stop, table_key=table_key, collate=collate, read_ahead=settings["read_ahead"], **mixed
        )
    table = pinned(as_spec(spec, storage_options), rank, broadcast)
    if windows is not None:
        own = {name: settings[name] for name in ("batch_size", "last", "rank", "world_size", "read_ahead")}
        return WindowDataset(table, windows=windows, policy=settings["policy"] or stripe, collate=collate, **own)
    if tokens is not None:
        own = {name: settings[name] for name in ("policy", "shuffle", "seed", "rank", "world_size", "read_ahead")}
        return TokenBatchDataset(table, budget=tokens, read_threads=settings["read_threads"], **own)
    if packing is not None:
        layout: dict[str, Any] = {"column": packing.column, "length": packing.length, "separator": packing.separator}
        return PackedDataset(table, **layout, **settings)
    return TableDataset(table, collate=collate, **settings)


class _Recorded(Loader):
    """A loader whose batches its ``recording`` (when set) notes as they are handed on."""

    recording: Recording | None = None

    def __iter__(self) -> Any:
        batches = super().__iter__()
        return batches if self.recording is None else self.recording.noted(self, batches)


class _CountedLoader(_Recorded):
    """A loader over a dataset that counts its own batches (a ``Mixture``, a ``WindowDataset``):
    each epoch yields the rank's batches (``batches(workers)``), with ``even`` batches the fewest
    any rank has (``fewest_batches``, which every rank calls at each epoch's start), so ranks
    that synchronize every step stay in step. ``delivered`` counts the epoch's batches yielded;
    ``save_loader_state`` keeps it, and ``resume_at`` restores it."""

    def __init__(self, dataset: Streamed, *, even: bool, **options: Any) -> None:
        super().__init__(dataset, **options)
        self.even = even
        self.delivered = 0
        self.epoch_batches: int | None = None
        self._resumed: tuple[int, int] | None = None

    def resume_at(self, epoch: int, delivered: int) -> None:
        """Continue ``epoch`` after its first ``delivered`` batches (those of a restored position)."""
        self._resumed = (epoch, delivered)

    def __iter__(self) -> Any:
        dataset = self.table
        batches, note = fewest_batches(dataset, self.num_workers, self.even)
        if note is not None and dataset.shard().rank == 0:
            _log.info("train_loader: %s", note)
        resumed, self._resumed = self._resumed, None
        # A restored position's batches count toward the epoch's (a re-planned epoch counts from its re-plan).
        self.delivered = resumed[1] if resumed is not None and resumed[0] == dataset.epoch else 0
        self.epoch_batches = batches
        return self._limited(super().__iter__(), batches)

    def _limited(self, batches: Any, limit: int) -> Any:
        # Stop before taking a batch past the limit: a recording notes each batch taken.
        while self.delivered < limit:
            batch = next(batches, _NONE)
            if batch is _NONE:
                return
            self.delivered += 1
            yield batch


class _EvenLoader(_Recorded):
    """A loader that gives its dataset the even quota of the epoch it is about to read."""

    def __init__(self, dataset: TableDataset, **options: Any) -> None:
        super().__init__(dataset, **options)
        # The quota caps the caller's own one, which is kept to apply in every epoch.
        self._limit = dataset.rows_per_consumer

    def __iter__(self) -> Any:
        dataset: TableDataset = self.table
        # Every worker of the Ray Train group starts each epoch, so the counts can be shared.
        even = even_epoch(dataset, self.num_workers, dataset.batch_size, self._limit)
        if dataset.rank == 0:
            if even.warn:
                warnings.warn(f"train_loader: {even.note}", stacklevel=2)
            else:
                _log.info("train_loader: %s", even.note)
        return super().__iter__()


def save_loader_state(loader: StatefulDataLoader, folder: str | Path) -> Path:
    """Write the position of a ``train_loader`` loader into ``folder`` (the folder this worker
    then reports with ``ray.train.report(..., checkpoint=Checkpoint.from_directory(folder))``),
    named for its rank so every rank's file lands in the same checkpoint. The path written."""
    if isinstance(loader, MapLoader):
        return _save(map_state(loader), folder)
    dataset = _table(loader)
    shard = dataset.shard()
    state = {
        "format": STATE_FORMAT,
        "version": version_of(dataset),
        "rank": shard.rank,
        "world_size": shard.world_size,
        "num_workers": loader.num_workers,
        "batch_size": _batch_size(dataset),
        "epoch": dataset.epoch,
        "loader": loader.state_dict(),
    }
    if isinstance(loader, _CountedLoader):
        # The epoch's batches delivered and its length: a counted epoch ends at its length.
        state |= {"batches": loader.delivered, "epoch_batches": loader.epoch_batches}
    lineage = dataset.lineage()
    if lineage is not None and shard.rank == 0:
        # Once per checkpoint, in rank 0's file: every consumer's state names it by digest.
        state["lineage"] = lineage
    if isinstance(loader, _Recorded) and loader.recording is not None:
        loader.recording.flush()
        state["step"] = loader.recording.step
    return _save(state, folder)


def _save(state: dict[str, Any], folder: str | Path) -> Path:
    path = Path(folder) / state_file(state["rank"])
    torch.save(sealed(state), path)
    return path


def restore_loader_state(loader: StatefulDataLoader, folder: str | Path) -> None:
    """Put a ``train_loader`` loader back at the position its rank saved into ``folder``.

    A checkpoint saved by another number of ranks, DataLoader workers or rows a batch is
    re-planned: the rows no saved consumer delivered are shared among this run's
    (``TableDataset.load_elastic``), in this run's batches.
    ``FileNotFoundError`` when the folder holds no state for this rank, ``ValueError`` naming
    every setting that differs from the saving run's.
    """
    if isinstance(loader, MapLoader):
        restore_map(loader, folder)
        return
    dataset = _table(loader)
    shard = dataset.shard()
    paths = sorted(Path(folder).glob(STATE_FILES))
    first = torch.load(paths[0], weights_only=True) if paths else None
    if isinstance(first, Mapping) and needs_replan(
        Layout(first.get("world_size", -1), first.get("num_workers", -1), first.get("batch_size", -1)),
        Layout(shard.world_size, loader.num_workers, _batch_size(dataset)),
        inside_replan="lineage" in first,
    ):
        _replan(dataset, loader.num_workers, paths)
        if isinstance(loader, _Recorded) and loader.recording is not None:
            loader.recording.restore(int(first.get("step", 0)), [])
        return
    path = Path(folder) / state_file(shard.rank)
    if not path.is_file():
        saved = sorted(entry.name for entry in Path(folder).glob(STATE_FILES))
        raise FileNotFoundError(
            f"cannot resume rank {shard.rank}: save every rank's state with save_loader_state before reporting, "
            "or pass resume=False to start the epoch afresh. The checkpoint "
            f"{str(folder)!r} holds {', '.join(saved) or 'no loader state'}"
        )
    state = torch.load(path, weights_only=True)
    _check(state, dataset, loader.num_workers, path)
    counted = state.get("epoch_batches")
    finished = state["loader"].get(FINISHED, False) or (counted is not None and state.get("batches", 0) >= counted)
    if isinstance(loader, _Recorded) and loader.recording is not None:
        loader.recording.restore(int(state.get("step", 0)), [] if finished else consumer_states(state["loader"]))
    if finished:
        # Saved after the epoch's last batch: torchdata would start a fresh epoch, so it is the next one.
        dataset.set_epoch(state["epoch"] + 1)
        return
    dataset.set_epoch(state["epoch"])
    loader.load_state_dict(state["loader"])
    if isinstance(loader, _CountedLoader):
        loader.resume_at(state["epoch"], int(state.get("batches", 0)))


def _replan(dataset: Streamed, num_workers: int, paths: list[Path]) -> None:
    """Share what the ranks that wrote ``paths`` had not delivered among this run's consumers."""
    states = [torch.load(path, weights_only=True) for path in paths]
    for path, state in zip(paths, states, strict=True):
        _check(state, dataset, num_workers, path, layout=False)
    if len(states) != states[0]["world_size"]:
        raise ValueError(
            f"the checkpoint holds {len(states)} rank states of {states[0]['world_size']}; re-planning needs all"
        )
    lineage = next((state["lineage"] for state in states if "lineage" in state), None)
    dataset.load_elastic(
        [consumer for state in states for consumer in consumer_states(state["loader"])], lineage=lineage
    )


def _check(state: Mapping[str, Any], dataset: Streamed, num_workers: int, path: Path, *, layout: bool = True) -> None:
    if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
        raise ValueError(f"{str(path)!r} is not a loader state written by save_loader_state (format {STATE_FORMAT})")
    missing = sorted({"version", "rank", "world_size", "num_workers", "batch_size", "epoch", "loader"} - state.keys())
    where = f"rank {state.get('rank')!r} in {str(path)!r}"
    try:
        if missing:
            raise ValueError(f"the loader state of {where} lacks the fields {missing}")
        consumers = dataset_states(state["loader"], where)
    except ValueError as error:
        if not intact(state):
            raise damaged("Ray loader", where, str(error)) from error
        raise
    # A dataset state that no longer matches its own digest is refused by the dataset's
    # load_state_dict before any row, naming the field it can.
    if not intact(state) and all(intact(consumer) for consumer in consumers):
        raise damaged("Ray loader", where)
    shard = dataset.shard()
    now: dict[str, Any] = {"version": version_of(dataset)}
    if layout:
        now |= {"world_size": shard.world_size, "num_workers": num_workers, "batch_size": _batch_size(dataset)}
    differ = [f"{name} (saved {state[name]!r}, now {value!r})" for name, value in now.items() if state[name] != value]
    if differ:
        # The differences come last: Ray Train shortens a worker's error from the middle.
        raise ValueError(
            f"cannot resume rank {shard.rank} from {str(path)!r}: a loader position is only valid under the "
            "settings it was saved with; resume with the saving run's table version and settings, or pass "
            "resume=False to start the epoch afresh. This run differs in " + ", ".join(differ)
        )


def _batch_size(dataset: Streamed) -> int | None:
    """The rows (blocks, windows) of a batch; ``None`` for token budgets, which have none."""
    return None if isinstance(dataset, TokenBatchDataset) else dataset.batch_size


def _table(loader: StatefulDataLoader) -> Streamed:
    # A Loader's dataset may be the Grouped that reads it in groups; its table is the dataset.
    dataset = getattr(loader, "table", loader.dataset)
    if not isinstance(dataset, TableDataset | Mixture | WindowDataset | TokenBatchDataset):
        raise TypeError(
            f"expected a loader made by train_loader, over a TableDataset, Mixture, WindowDataset or "
            "TokenBatchDataset, not "
            f"{type(dataset).__name__}"
        )
    return dataset
