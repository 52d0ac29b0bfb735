"""A model that records the row ids it trains on, and a script that runs it under Lightning.

``main`` trains one phase of a DDP job (``--devices 2`` by default, gloo on CPU) in each rank
that ``tests.ranks.torchrun`` starts, and writes each rank's record to
``<out>/<phase>-rank<r>.json``; run as a script, Lightning starts rank 1 by running it again.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from spiral_lightning import MixedTable, Packing, SpiralDataModule, Split, TableSpec, WorkItem, balanced
from spiral_lightning.core.plan import Shard
from tests.tables import KEEP

#: What a mixture's table index adds to its row ids in a ``Recorder``.
TABLE_IDS = 1_000_000


class Recorder(pl.LightningModule):
    """Trains a one-weight model on column ``x`` and keeps, for every training batch, the epoch,
    the global step before it and the batch's ids."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[tuple[int, int, list[int]]] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        if "positions" in batch:
            # Packed blocks: the token ids (unique per token in the tests' corpora) stand for rows.
            ids, x = batch["tokens"].flatten(), batch["tokens"].float().mean(dim=1)
        else:
            # A mixture's batch names its table: its ids are told apart by TABLE_IDS a table.
            ids = batch["id"] + TABLE_IDS * batch["table"] if "table" in batch else batch["id"]
            x = batch["x"]
        self.seen.append((self.current_epoch, self.global_step, ids.tolist()))
        loss: torch.Tensor = self.layer(x[:, None]).pow(2).mean()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6)


def reversed_on_odd_epochs(plan: Sequence[Split], shard: Shard, epoch: int) -> list[WorkItem]:
    """``balanced`` over the plan, the plan reversed in odd epochs: an epoch-dependent policy."""
    return balanced(list(plan)[::-1] if epoch % 2 else plan, shard, epoch)


def job_trainer(out: Path, devices: int, max_epochs: int, checkpoint_every: int, max_steps: int = -1) -> pl.Trainer:
    """A CPU Trainer for a test job under ``out``: DDP over gloo when ``devices > 1``, and a
    checkpoint every ``checkpoint_every`` steps (none when 0) in ``out/checkpoints``."""
    callbacks: list[pl.Callback] = []
    if checkpoint_every:
        callbacks.append(
            ModelCheckpoint(out / "checkpoints", "{step}", every_n_train_steps=checkpoint_every, save_top_k=-1)
        )
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        default_root_dir=out,
        strategy="ddp" if devices > 1 else "auto",
        max_epochs=max_epochs,
        max_steps=max_steps,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        num_sanity_val_steps=0,
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--uri", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--phase", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--filtered", action="store_true")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=1)
    parser.add_argument("--access", choices=["iterable", "map"], default="iterable")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mixed-with", default=None, help="a second table: train on a mixture, weights 3 to 1")
    parser.add_argument("--stop", choices=["first_exhausted", "cycle"], default="first_exhausted")
    parser.add_argument("--skip-steps", default=None, help="START:END, the steps a rolled-back run leaves out")
    parser.add_argument("--record", default=None, help="the folder of the step record")
    parser.add_argument("--packed", type=int, default=None, help="train on blocks of this many tokens of 'tokens'")
    args = parser.parse_args(argv)
    out = Path(args.out)
    trainer = job_trainer(out, args.devices, args.max_epochs, args.checkpoint_every, args.max_steps)
    spec = TableSpec(args.uri, columns=["id", "x"], filter=KEEP if args.filtered else None)
    train: Any = spec
    if args.mixed_with is not None:
        train = [MixedTable(spec, 3.0), MixedTable(TableSpec(args.mixed_with, columns=["id", "x"]), 1.0)]
    if args.packed is not None:
        train = TableSpec(args.uri)
    data = SpiralDataModule(
        train,
        batch_size=args.batch_size,
        num_workers=args.workers,
        access=args.access,
        seed=args.seed,
        stop=args.stop,
        table_key=None if args.mixed_with is None else "table",
        skip_steps=None if args.skip_steps is None else [tuple(int(step) for step in args.skip_steps.split(":"))],
        record=args.record,
        packing=None if args.packed is None else Packing("tokens", args.packed, separator=-1),
    )
    model = Recorder()
    trainer.fit(model, datamodule=data, ckpt_path=args.ckpt_path)
    record = {"rank": trainer.global_rank, "seen": model.seen}
    (out / f"{args.phase}-rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
