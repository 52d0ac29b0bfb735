"""A training job for the fault tests: it writes every step's row ids to disk before the step
trains, and can kill itself, lose a DataLoader worker or see its table change on cue.

Its ``main`` runs in each rank that ``tests.ranks.torchrun_ended`` starts (or run it as
``python -m tests.fault_job --uri ... --out ...``). Each rank appends one JSON line per
training step to ``<out>/<phase>-rank<r>.jsonl`` (epoch, global step before the step, the batch's
ids) and syncs it to disk, so the record survives a SIGKILL that comes right after. The options:

- ``--kill-at-step k``: after recording the batch of global step ``k`` (counted from 0), the
  process sends SIGKILL to itself; under DDP every rank does so at the same step, before that
  step's gradients are exchanged.
- ``--policy tests.fault_job.dies_in_worker``: the policy ends the DataLoader worker process
  that asks it for a work list, as a crash in a worker would.
- ``--rewrite-after-epoch FILE``: at the end of each training epoch the model writes the bytes
  of the Parquet file ``FILE`` again, as a job that rewrites a table in place would: the rows are
  the same, the modification time is not.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import get_worker_info

from spiral_lightning import Shard, SpiralDataModule, Split, TableSpec, WorkItem, balanced
from tests.lightning_job import job_trainer

#: The exit status of a worker ended by ``dies_in_worker``, as a crashed worker would leave one.
WORKER_EXIT = 17


class StepLog(pl.LightningModule):
    """Trains one weight on column ``x`` and logs each step's ids durably before training on them.

    Each rank appends to ``<out>/<phase>-rank<r>.jsonl``. ``kill_at`` is the global step after
    whose record the process kills itself (``None``: never); ``rewrite`` a Parquet file rewritten
    at each epoch's end (``None``: none).
    """

    def __init__(self, out: Path, phase: str, kill_at: int | None, rewrite: Path | None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.out = out
        self.phase = phase
        self.kill_at = kill_at
        self.rewrite = rewrite

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        record = {"epoch": self.current_epoch, "step": self.global_step, "ids": batch["id"].tolist()}
        # The rank is known only once the Trainer has started this process's strategy.
        with (self.out / f"{self.phase}-rank{self.global_rank}.jsonl").open("a") as file:
            file.write(json.dumps(record) + "\n")
            file.flush()
            # The record must be on disk before the kill below, or the test would miss a batch.
            os.fsync(file.fileno())
        if self.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        loss: torch.Tensor = self.layer(batch["x"][:, None]).pow(2).mean()
        return loss

    def on_train_epoch_end(self) -> None:
        if self.rewrite is not None:
            self.rewrite.write_bytes(self.rewrite.read_bytes())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6)


def dies_in_worker(plan: Sequence[Split], shard: Shard, epoch: int) -> list[WorkItem]:
    """``balanced``, except that a DataLoader worker asking for its list exits on the spot."""
    if get_worker_info() is not None:
        os._exit(WORKER_EXIT)
    return balanced(plan, shard, epoch)


def read_log(path: Path) -> list[dict[str, Any]]:
    """The step records of one rank, oldest first; none when the rank recorded nothing."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--uri", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--phase", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=1)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--kill-at-step", type=int, default=None)
    parser.add_argument("--policy", default="balanced")
    parser.add_argument("--rewrite-after-epoch", type=Path, default=None)
    args = parser.parse_args(argv)
    out = Path(args.out)
    trainer = job_trainer(out, args.devices, args.max_epochs, args.checkpoint_every)
    data = SpiralDataModule(
        TableSpec(args.uri, columns=["id", "x"]),
        batch_size=args.batch_size,
        num_workers=args.workers,
        policy=args.policy,
    )
    model = StepLog(out, args.phase, args.kill_at_step, args.rewrite_after_epoch)
    trainer.fit(model, datamodule=data, ckpt_path=args.ckpt_path)


if __name__ == "__main__":
    main()
