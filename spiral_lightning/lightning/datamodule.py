"""SpiralDataModule: Lightning training on exact table versions, with every rank's position in the
checkpoint and equal batches on every rank."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch.distributed

from spiral_lightning.core.budget import TokenBudget
from spiral_lightning.core.checks import check_count
from spiral_lightning.core.plan import Policy
from spiral_lightning.core.spec import TableSpec, as_spec, with_selection
from spiral_lightning.datasets.consumer import DEFAULT_READ_AHEAD
from spiral_lightning.datasets.job import Layout, pinned
from spiral_lightning.datasets.loader import WORKER_TIMEOUT, default_workers
from spiral_lightning.datasets.mapstyle import TableMapDataset
from spiral_lightning.datasets.mixture import Mixture, Stop
from spiral_lightning.datasets.packing import PackedDataset
from spiral_lightning.datasets.record import StepRecord, check_recordable
from spiral_lightning.datasets.table import TableDataset
from spiral_lightning.datasets.token_batches import TokenBatchDataset
from spiral_lightning.datasets.windows import WindowDataset, Windows
from spiral_lightning.lightning import positions
from spiral_lightning.lightning.callbacks import add_fit_callbacks
from spiral_lightning.lightning.checkpoint import check_entry, seal_entry
from spiral_lightning.lightning.loader import Position, SpiralLoader
from spiral_lightning.lightning.map_access import MapTraining
from spiral_lightning.lightning.mixing import MixedTable, mixed_tables, train_mixture
from spiral_lightning.lightning.padding import WithValid, check_unmasked, evaluation_loader
from spiral_lightning.lightning.settings import check_settings, check_tokens, check_train_kind
from spiral_lightning.lightning.skips import StepSkips, check_skips
from spiral_lightning.lightning.train_kinds import counted_train, prepare_epoch
from spiral_lightning.planning.policies import as_policy, balanced, stripe
from spiral_lightning.reading.frames import Last
from spiral_lightning.reading.packing import Packing
from spiral_lightning.sources import open_source

#: The stages a DataModule serves, each read from its own table.
Stage = Literal["train", "val", "test", "predict"]

_STAGES: dict[str, tuple[Stage, ...]] = {
    "fit": ("train", "val"),
    "validate": ("val",),
    "test": ("test",),
    "predict": ("predict",),
}


class SpiralDataModule(pl.LightningDataModule):
    """Train, validation, test and predict tables, read by every rank and worker exactly once.

        data = SpiralDataModule(train="spiral:data/train", val="spiral:data/val", batch_size=256, shuffle=True)
        pl.Trainer(max_epochs=2).fit(model, datamodule=data)  # model sees {"x": [256, ...], ...}
        pl.Trainer().fit(model, datamodule=data, ckpt_path="last")  # every rank resumes its rows

    ``setup`` takes rank and world size from the Trainer and pins each table to the version rank
    0 resolved. Even batches give every training consumer the same quota of rows, the fewest any
    has, so DDP never waits on a rank that ran out (the rest is left out and logged); evaluation
    leaves out nothing, its batches carry ``valid`` (see ``padding``). The checkpoint holds every
    rank's position; on resume each rank restores its own, or re-plans under another topology.
    Without a ``val`` table ``val_dataloader`` is ``None``, so Lightning fits without validating.

    Args:
        train: The train table: a ``TableSpec`` or a uri such as ``spiral:data/demo``; or a
            ``Mixture`` of tables by weight, a list of ``MixedTable(table, weight)``.
        val: The validation table, read in stored order (``balanced``).
        test: The test table, read as ``val``.
        predict: The predict table, read as ``val``.
        columns: The columns every stage reads (each spec's own when ``None``).
        filter: The rows every stage keeps: text such as ``"label < 2"`` or a spiral expression.
        batch_size: Rows a batch (packed blocks a batch with ``packing``).
        num_workers: DataLoader workers a rank, started by ``forkserver``; 0 reads in process;
            ``None`` (the default): 0 for plain columns, processes with a transform or media.
        policy: ``"balanced"`` (the default), ``"stripe"``, ``"shuffled"``, ``"module.function"``.
        shuffle: Read the train table in a new, well-mixed order every epoch, drawn from
            ``seed`` (see ``TableDataset``); the other stages keep ``policy``.
        seed: The seed of ``shuffle``, ``"shuffled"`` and ``access="map"``'s order.
        last: What a consumer does with the rows after its last full batch.
        pin_memory: Pin each batch's tensors for a faster copy to the GPU.
        persistent_workers: Keep the workers from one epoch to the next.
        multiprocessing_context: How workers start: ``"forkserver"`` (the default) or ``"spawn"``.
        even_batches: Give every rank the same batches when there is more than one (see above).
        access: ``"map"`` trains through a ``TableMapDataset`` in a new order every epoch.
        read_ahead: Read batches each consumer reads ahead, on a thread (0 reads in line).
        read_threads: Work items each consumer reads at once (``None``: from the cores).
        storage_options: Settings of the object store of Parquet tables (secrets: environment).
        transform: Called on each batch in the worker that reads it, after decoding.
        packing: Train on packed blocks of tokens (a ``PackedDataset``); other stages read rows.
        stall_meter: Add a ``DataStallMeter``: each step logs its wait for data; long waits warn.
        missing_position: A fit resumed mid-epoch from a checkpoint that holds no position:
            ``"refuse"`` (the default), or ``"restart_epoch"`` to read that epoch from its start.
        timeout: Seconds a loader waits for a worker's batch before it gives the worker up (0: ever).
        stop: What ends a train mixture's epoch (see ``Mixture``): ``"first_exhausted"`` or ``"cycle"``.
        table_key: With a train mixture, the key each batch holds its table's index under.
        windows: Train on windows of consecutive rows (a ``WindowDataset``, ``stripe`` unless a
            ``policy`` is given); other stages read rows.
        tokens: Train on batches of whole documents sized by a ``TokenBudget`` (a ``TokenBatchDataset``).
        skip_steps: Ranges ``(start, end)`` of training steps whose batches a rolled-back run leaves out.
        record: A folder where each rank notes the stored rows of every training step (see ``record.rows``).
    """

    def __init__(
        self,
        train: TableSpec | str | list[MixedTable] | None = None,
        val: TableSpec | str | None = None,
        test: TableSpec | str | None = None,
        predict: TableSpec | str | None = None,
        *,
        columns: list[str] | None = None,
        filter: Any = None,
        batch_size: int = 256,
        num_workers: int | None = None,
        policy: str | Policy | None = None,
        shuffle: bool = False,
        seed: int = 0,
        last: Last = "keep_partial",
        pin_memory: bool = False,
        persistent_workers: bool = False,
        multiprocessing_context: Literal["forkserver", "spawn"] | None = None,
        even_batches: bool = True,
        access: Literal["iterable", "map"] = "iterable",
        read_ahead: int = DEFAULT_READ_AHEAD,
        read_threads: int | None = None,
        storage_options: dict[str, Any] | None = None,
        transform: Callable[[Any], Any] | None = None,
        packing: Packing | None = None,
        stall_meter: bool = True,
        missing_position: Literal["refuse", "restart_epoch"] = "refuse",
        timeout: float = WORKER_TIMEOUT,
        stop: Stop = "first_exhausted",
        table_key: str | None = None,
        windows: Windows | None = None,
        tokens: TokenBudget | None = None,
        skip_steps: list[tuple[int, int]] | None = None,
        record: str | None = None,
    ) -> None:
        super().__init__()
        check_settings(
            batch_size=batch_size,
            last=last,
            read_ahead=read_ahead,
            read_threads=read_threads,
            multiprocessing_context=multiprocessing_context,
            access=access,
            missing_position=missing_position,
            packing=packing,
            shuffle=shuffle,
            policy=policy,
        )
        others = {"transform": transform, "shuffle": shuffle}
        check_train_kind(
            mixture=isinstance(train, list), windows=windows, packing=packing, access=access, last=last, others=others
        )
        check_tokens(tokens, mixture=isinstance(train, list), windows=windows, packing=packing, access=access)
        self.packing, self.windows, self.tokens, self.skips = packing, windows, tokens, StepSkips.of(skip_steps)
        self.tables: dict[Stage, TableSpec] = {}
        self.mixture = None if not isinstance(train, list) else mixed_tables(train, storage_options, columns, filter)
        for stage, table in zip(get_args(Stage), (train, val, test, predict), strict=True):
            if table is not None and not isinstance(table, list):
                self.tables[stage] = with_selection(as_spec(table, storage_options), columns, filter)
        self.stop, self.table_key = stop, table_key
        mixed = [spec for spec, _ in self.mixture or ()]
        self.batch_size = batch_size
        runs_python = transform is not None or any(spec.media for spec in [*self.tables.values(), *mixed])
        self.num_workers = num_workers = default_workers(runs_python) if num_workers is None else num_workers
        check_count("num_workers", num_workers)
        self.policy = as_policy(balanced if policy is None else policy, seed)
        # Windows keep whole splits by default: balanced cuts them, and a window never crosses a cut.
        self.train_policy = as_policy(stripe, seed) if windows is not None and policy is None else self.policy
        self.shuffle = shuffle
        self.last: Last = last
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers and num_workers > 0
        self.multiprocessing_context = (multiprocessing_context or "forkserver") if num_workers else None
        self.even_batches = even_batches
        self.read_ahead = read_ahead
        self.read_threads = read_threads
        self.missing_position, self.timeout, self.access, self.seed = missing_position, timeout, access, seed
        self.transform = transform
        self.stall_meter = stall_meter
        # Lightning warns that an IterableDataset's length "could be inaccurate"; a SpiralLoader's is exact.
        warnings.filterwarnings("ignore", "Your `IterableDataset` has `__len__` defined", module="lightning")
        for spec in [*self.tables.values(), *mixed]:
            # Opened here so a bad column or filter fails in the building process, not in a rank or
            # worker; a table not written yet is prepare_data's to write, and setup opens it.
            try:
                open_source(spec.resolve())
            except FileNotFoundError:
                continue
        if "val" not in self.tables:
            # Lightning validates when val_dataloader is defined, and warns when it gives no loaders.
            self.val_dataloader = None  # type: ignore[method-assign,assignment]
        self.datasets: dict[Stage, TableDataset] = {}
        self.map_train: TableMapDataset | None = None
        # A train dataset that counts its own batches: ranks read the fewest any rank has.
        self.counted_train: Mixture | WindowDataset | TokenBatchDataset | None = None
        self._train_loader: SpiralLoader | None = None
        self._map_training: MapTraining | None = None
        self._restored: dict[str, Any] | None = None
        self._skipped = 0
        self.record = record

    def _rank(self) -> tuple[int, int]:
        if self.trainer is None:
            return 0, 1
        return self.trainer.global_rank, self.trainer.world_size

    def setup(self, stage: str) -> None:
        """Build the datasets of ``stage`` (fit, validate, test or predict) for this rank."""
        rank, world_size = self._rank()
        # What every stage's consumers read with, packed or not.
        settings: dict[str, Any] = {
            "batch_size": self.batch_size,
            "last": self.last,
            "policy": self.policy,
            "rank": rank,
            "world_size": world_size,
            "read_ahead": self.read_ahead,
            "read_threads": self.read_threads,
        }
        # The train table's order: a shuffle chooses its own policy.
        order: dict[str, Any] = {"policy": None, "shuffle": True, "seed": self.seed} if self.shuffle else {}
        packing = self.packing
        for name in _STAGES[stage]:
            if name not in self.tables:
                continue
            pinned = self._pinned(self.tables[name])
            if name == "train" and packing is not None:
                self.datasets[name] = PackedDataset(
                    pinned,
                    column=packing.column,
                    length=packing.length,
                    separator=packing.separator,
                    transform=self.transform,
                    **{**settings, **order},
                )
                continue
            if name == "train" and (self.windows is not None or self.tokens is not None):
                kinds: dict[str, Any] = {
                    "windows": self.windows,
                    "tokens": self.tokens,
                    "window_policy": self.train_policy,
                }
                self.counted_train = counted_train(
                    pinned, **kinds, settings=settings, order=order, transform=self.transform
                )
                continue
            evaluates = name != "train"
            transform = WithValid(self.transform) if evaluates else self.transform
            own = settings if evaluates else {**settings, **order}
            self.datasets[name] = TableDataset(pinned, transform=transform, **own)
            if evaluates:
                check_unmasked(self.datasets[name].source().schema, name, self.tables[name].uri)
        if stage == "fit" and self.mixture is not None:
            self.counted_train = self._train_mixture(settings, order)
        elif stage == "fit" and "train" not in self.tables:
            raise ValueError("SpiralDataModule has no train table to fit on; pass train='spiral:<root>'")
        trainer = self.trainer
        if stage == "fit" and trainer is not None:
            add_fit_callbacks(trainer, self.stall_meter)
            check_skips(self.skips, trainer)
            reloads = self.counted_train is not None or self.skips is not None
            if reloads and not trainer.reload_dataloaders_every_n_epochs:  # type: ignore[attr-defined]
                # Such epochs differ in length (a mixture's draw their phases, windows follow their
                # lists, skips shorten theirs), which Lightning learns only from a train loader made anew.
                trainer.reload_dataloaders_every_n_epochs = 1  # type: ignore[attr-defined]
        if stage == "fit" and self.access == "map":
            self.map_train = TableMapDataset(self.datasets["train"].spec)
        if stage == "fit" and self.record is not None:
            check_recordable(self.map_train or self._train(), self.record)
        if self._restored is not None and (train := self._train()) is not None:
            positions.check_version(self._restored, train)

    def _train_mixture(self, settings: dict[str, Any], order: dict[str, Any]) -> Mixture:
        """The train ``Mixture`` of this rank, its tables pinned as every rank reads them."""
        pairs = [(self._pinned(spec), weight) for spec, weight in self.mixture or ()]
        own = {name: settings[name] for name in ("batch_size", "policy", "rank", "world_size", "read_ahead")}
        return train_mixture(pairs, {**own, "seed": self.seed, **order}, self.stop, self.table_key, self.transform)

    def _train(self) -> positions.Train | None:
        return self.datasets.get("train") if self.counted_train is None else self.counted_train

    def _pinned(self, spec: TableSpec) -> TableSpec:
        """``spec`` pinned to the version rank 0 resolved, so every rank reads that version."""
        if self.trainer is None:
            return pinned(spec, 0, None)
        return pinned(spec, self.trainer.global_rank, self.trainer.strategy.broadcast)

    def _dataset(self, stage: Stage) -> TableDataset:
        if stage not in self.datasets:
            if stage not in self.tables:
                raise ValueError(f"SpiralDataModule has no {stage} table; pass {stage}='spiral:<root>'")
            raise RuntimeError(f"call setup() before asking for the {stage} dataloader")
        return self.datasets[stage]

    def _options(self) -> dict[str, Any]:
        return {
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "persistent_workers": self.persistent_workers,
            "multiprocessing_context": self.multiprocessing_context,
            "timeout": self.timeout,
        }

    def _train_options(self, dataset: positions.Train) -> dict[str, Any]:
        """A train loader's options: every loader's, its skips and its record (see ``SpiralLoader``)."""
        before = self._train_loader.skipped if self._train_loader is not None else self._skipped
        step = partial(getattr, self.trainer, "global_step")
        recording = None if self.record is None else partial(StepRecord, self.record, dataset, self._rank()[0])
        return {"skips": self.skips, "step": step, "skipped": before, "recording": recording, **self._options()}

    def train_dataloader(self) -> SpiralLoader:
        if self.map_train is not None:
            return self._map_loader(self.map_train)
        dataset = self._dataset("train") if self.counted_train is None else self.counted_train
        for table in positions.tables_of(dataset):
            table.check_shares(self.num_workers)
        replan = partial(positions.replanned_position, dataset, now=self._layout())
        return self._resumed_loader(dataset, self._prepare, replan, {})

    def _flush_record(self) -> None:
        """Write what the train loader's record noted since it last wrote (see ``SpiralLoader``)."""
        if self._train_loader is not None and self._train_loader.record is not None:
            self._train_loader.record.flush()

    def teardown(self, stage: str) -> None:
        self._flush_record()

    def _resumed_loader(
        self,
        dataset: positions.Train,
        prepare: Callable[[int], int],
        replan: Callable[[dict[str, Any]], Position | None],
        options: dict[str, Any],
    ) -> SpiralLoader:
        """The train loader of ``dataset``, its epochs set up by ``prepare``, continuing a loaded
        checkpoint's position (through ``replan`` when it was saved under another layout)."""
        epoch = self._epoch()
        self._flush_record()
        restored, replanned = self._take_restored(dataset, replan)
        done = replanned.batches if replanned is not None and replanned.epoch == epoch else 0
        batches = prepare(epoch) + done
        options |= self._train_options(dataset)
        loader = SpiralLoader(dataset, batches=batches, epoch=self._epoch, prepare=prepare, **options)
        if replanned is not None:
            loader.continue_replanned(replanned.epoch, replanned.batches)
        elif restored is not None and (position := positions.rank_position(restored, self._rank()[0])) is not None:
            loader.restore(position)
        self._train_loader = loader
        return loader

    def _take_restored(
        self, dataset: positions.Train, replan: Callable[[dict[str, Any]], Position | None]
    ) -> tuple[dict[str, Any] | None, Position | None]:
        """The checkpoint state the train loader resumes from, taken once, and ``replan``'s position of it."""
        restored, self._restored = self._restored, None
        if restored is None:
            return None, None
        positions.check_version(restored, dataset)
        return restored, replan(restored) if self._replans(restored) else None

    def _map_loader(self, dataset: TableMapDataset) -> SpiralLoader:
        """The train loader of ``access="map"`` (see ``MapTraining``); the sampler's position is
        part of the loader's state, so a resume continues the epoch's order."""
        rank, world_size = self._rank()
        self._map_training = training = MapTraining(
            dataset, rank=rank, world_size=world_size, seed=self.seed, batch_size=self.batch_size, last=self.last
        )
        return self._resumed_loader(dataset, training.prepare, training.replan, training.options(self.transform))

    def val_dataloader(self) -> SpiralLoader | list[SpiralLoader]:
        return self._eval_loader("val")

    def test_dataloader(self) -> SpiralLoader | list[SpiralLoader]:
        return self._eval_loader("test")

    def predict_dataloader(self) -> SpiralLoader | list[SpiralLoader]:
        return self._eval_loader("predict")

    def _eval_loader(self, stage: Stage) -> SpiralLoader | list[SpiralLoader]:
        """The loader of ``stage`` (see ``evaluation_loader``)."""
        even = self.even_batches and self.trainer is not None and self.trainer.world_size > 1
        strategy = self.trainer.strategy if even and self.trainer is not None else None
        return evaluation_loader(self._dataset(stage), stage, strategy, self.num_workers, self._options())

    def _epoch(self) -> int:
        return 0 if self.trainer is None else self.trainer.current_epoch

    def _prepare(self, epoch: int) -> int:
        """Set the train dataset up for ``epoch`` (see ``prepare_epoch``); the rank's batches in it."""
        train = self._dataset("train") if self.counted_train is None else self.counted_train
        return prepare_epoch(train, epoch, self.num_workers, even=self.even_batches, batch_size=self.batch_size)

    def state_dict(self) -> dict[str, Any]:
        """Every rank's training position with the settings it is valid for.

        A collective when there is more than one rank: Lightning calls it on every rank whenever
        it saves a checkpoint, and each rank contributes its own position.
        """
        loader = self._train_loader
        if loader is None:
            return {}
        rank, world_size = self._rank()
        position = loader.position()
        # Plain values only: checkpoints load with torch's weights-only unpickler.
        mine = {"rank": rank, "position": None if position is None else position._asdict()}
        ranks: list[Any] = [mine]
        if world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            ranks = [None] * world_size
            torch.distributed.all_gather_object(ranks, mine)
        self._flush_record()
        version, lineage = positions.version_of(loader.table), self._lineage(loader)
        return seal_entry(version, self._layout(), ranks, lineage, loader.skipped)

    def _lineage(self, loader: SpiralLoader) -> dict[str, Any] | None:
        """What makes the remainder of the epoch ``loader`` reads again, when it is re-planned."""
        if isinstance(loader.table, TableDataset | Mixture | WindowDataset | TokenBatchDataset):
            return loader.table.lineage()
        return None if self._map_training is None else self._map_training.lineage()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the positions of a checkpoint; each rank restores its own into its train loader.
        ``ValueError`` when they were saved under another table version, or were edited or damaged."""
        check_entry(state_dict, iterable=self.access == "iterable", rank=self._rank()[0])
        # The re-planned epoch has another length than the ones after it, which Lightning only
        # learns from a train loader made anew; the Trainer sets this attribute at run time.
        trainer: Any = self.trainer
        if self._replans(state_dict) and trainer is not None and not trainer.reload_dataloaders_every_n_epochs:
            trainer.reload_dataloaders_every_n_epochs = 1
        if (train := self._train()) is not None:
            positions.check_version(state_dict, train)
        self._restored = state_dict
        self._skipped = state_dict.get("skipped", 0)

    @property
    def position_loaded(self) -> bool:
        """Whether a checkpoint's position was loaded and waits for the next train loader."""
        return self._restored is not None

    def _layout(self) -> Layout:
        return Layout(self._rank()[1], self.num_workers, self.batch_size)

    def _replans(self, state: dict[str, Any]) -> bool:
        reweighted = self.counted_train.reweighted if isinstance(self.counted_train, Mixture) else None
        return positions.replans(state, self._layout(), map_access=self.access == "map", reweighted=reweighted)
