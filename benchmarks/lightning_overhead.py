"""Rows per second through ``Trainer.fit`` against a bare loop over the same loader.

Run ``.venv/bin/python benchmarks/lightning_overhead.py`` (``--rows 100000 --repeats 2`` for a
quick look). Both paths run in process (``--workers 0``) and through two DataLoader workers
(``--workers 2``), or the worker counts given. The table is the demo table
(``id``, ``features`` float32[16], ``label``), written to a temporary folder or kept at ``--root``.

Both paths read one epoch from the loader a ``SpiralDataModule`` builds and touch every batch the
same way (sum the features). The bare loop iterates the loader itself; the Lightning path runs
``Trainer.fit`` with a model whose training step only touches the batch (manual optimization, no
optimizer step), so the difference is the Trainer's own cost per batch: hooks, the batch-transfer
path, progress tracking and the per-rank loader bookkeeping of the DataModule. Each path reads
two epochs with persistent workers and times the second, so neither counts worker start-up (the
loader starts its workers on the first batch request, inside the epoch). A *rate* is the epoch's
rows divided by the time from the epoch's first batch request to its end; each path takes the
best of ``--repeats`` runs, the paths taking turns so load from other processes falls on both.
The target is a ratio of at least 0.8. The Trainer's cost is fixed per batch (a fraction of a
millisecond here), so the ratio depends on the batch size: ``--batch-size`` (default 4096) sets it.
In process the Trainer's Python runs between reads on the same thread; with workers it runs while
they read, so only a loader faster than the Trainer shows it.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from throughput import in_turns

from spiral_lightning import SpiralDataModule
from spiral_lightning.datasets.consumer import DEFAULT_READ_AHEAD
from spiral_lightning.demos.data import demo_table


class Touch(pl.LightningModule):
    """Touches each batch like the bare loop does and trains nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.total = torch.zeros(())

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.total += batch["features"].sum()

    def configure_optimizers(self) -> None:
        return None


class EpochTimer(pl.Callback):
    """The wall time of the last training epoch, from its start hook to its end hook."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._started = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seconds = time.perf_counter() - self._started


#: Epochs each path reads; only the last is timed.
EPOCHS = 2


def data(uri: str, workers: int, batch_size: int, read_ahead: int) -> SpiralDataModule:
    return SpiralDataModule(
        uri,
        columns=["features", "label"],
        batch_size=batch_size,
        num_workers=workers,
        persistent_workers=True,
        read_ahead=read_ahead,
    )


def bare(uri: str, workers: int, batch_size: int, read_ahead: int) -> tuple[int, float]:
    module = data(uri, workers, batch_size, read_ahead)
    module.setup("fit")
    loader = module.train_dataloader()
    total = torch.zeros(())
    for _ in range(EPOCHS):
        rows = 0
        # Trainer.fit creates the epoch's iterator before the epoch's start hook, where its clock
        # starts; the bare loop's clock starts at the same point.
        batches = iter(loader)
        started = time.perf_counter()
        for batch in batches:
            total += batch["features"].sum()
            rows += len(batch["label"])
        seconds = time.perf_counter() - started
    return rows, seconds


def lightning(uri: str, workers: int, batch_size: int, read_ahead: int) -> tuple[int, float]:
    module = data(uri, workers, batch_size, read_ahead)
    timer = EpochTimer()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[timer],
    )
    trainer.fit(Touch(), datamodule=module)
    rows = len(module.datasets["train"])
    return rows, timer.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="worker counts to measure")
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--root", type=Path, default=None, help="keep the table here between runs")
    parser.add_argument(
        "--read-ahead", type=int, default=DEFAULT_READ_AHEAD, help="read batches each consumer reads ahead (0: in line)"
    )
    args = parser.parse_args()
    # One intra-op thread for both paths: on a shared 2-core machine a second thread waits for a
    # core inside each batch's sum, which adds milliseconds of noise to whichever path it hits.
    torch.set_num_threads(1)
    root = args.root or Path(tempfile.mkdtemp(prefix="lightning-overhead-")) / "demo"
    uri = demo_table(root, rows=args.rows, split_rows=max(1, args.rows // 20)).uri
    paths = {"bare loop over the loader": bare, "Trainer.fit": lightning}
    best: dict[tuple[str, int], tuple[int, float]] = {}
    for workers in args.workers:
        for round_number in range(args.repeats):
            order = in_turns(list(paths), round_number)
            for name in order:
                rows, seconds = paths[name](uri, workers, args.batch_size, args.read_ahead)
                if (name, workers) not in best or seconds < best[name, workers][1]:
                    best[name, workers] = (rows, seconds)
    print(
        f"\n{args.rows:,} rows, batches of {args.batch_size}, read_ahead={args.read_ahead}, "
        f"best of {args.repeats} epochs per path\n"
    )
    print("| path | workers | rows | seconds | rows/s | vs bare loop |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for workers in args.workers:
        bare_rows, bare_seconds = best["bare loop over the loader", workers]
        for name in paths:
            rows, seconds = best[name, workers]
            ratio = (rows / seconds) / (bare_rows / bare_seconds)
            print(f"| {name} | {workers} | {rows:,} | {seconds:.3f} | {rows / seconds:,.0f} | {ratio:.2f}x |")
    print("\ntarget: Trainer.fit at least 0.80x the bare loop")


if __name__ == "__main__":
    main()
