"""A model that records what every validation, test and predict step sees, and ``main``, which
runs it in each rank of a two-process DDP Trainer (gloo on CPU): fit with validation, then test,
then predict.

Every evaluation step logs the rows its batch marks valid with ``sync_dist=True`` on each step, a
collective per step that waits forever when one rank has fewer batches than the other. Each rank
writes its record to ``<out>/rank<r>.json``: per stage, every step's valid ids and the ids of the
rows it marks padding, and the logged totals.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from spiral_lightning import SpiralDataModule, TableSpec
from tests.lightning_job import Recorder, job_trainer

VALID = "valid"


class EvalRecorder(Recorder):
    """``Recorder``, plus for every evaluation step the ids of its valid rows and of its padding
    rows, kept per stage; each step logs its valid rows, summed over steps and ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: dict[str, list[tuple[list[int], list[int]]]] = {"val": [], "test": [], "predict": []}

    def _evaluate(self, batch: dict[str, Any], stage: str) -> None:
        valid = batch[VALID]
        self.steps[stage].append((batch["id"][valid].tolist(), batch["id"][~valid].tolist()))
        self.log(f"{stage}_rows", valid.sum().float(), on_step=True, on_epoch=True, sync_dist=True, reduce_fx="sum")

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: dict[str, Any], batch_idx: int) -> dict[str, torch.Tensor]:
        valid = batch[VALID]
        self.steps["predict"].append((batch["id"][valid].tolist(), batch["id"][~valid].tolist()))
        return {"id": batch["id"], VALID: valid}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", required=True)
    parser.add_argument("--val", required=True)
    parser.add_argument("--test", required=True)
    parser.add_argument("--predict", required=True)
    parser.add_argument("--predict-filter", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    out = Path(args.out)
    data = SpiralDataModule(
        train=args.train,
        val=args.val,
        test=args.test,
        predict=TableSpec(args.predict, filter=args.predict_filter),
        columns=["id", "x"],
        batch_size=args.batch_size,
        num_workers=args.workers,
    )
    model = EvalRecorder()
    trainer = job_trainer(out, devices=2, max_epochs=1, checkpoint_every=0)
    trainer.fit(model, datamodule=data)
    fitted = {name: float(value) for name, value in trainer.callback_metrics.items()}
    tested = trainer.test(model, datamodule=data, verbose=False)
    # One dataloader: a list of predict_step's outputs, one per batch.
    predicted: list[dict[str, torch.Tensor]] = trainer.predict(model, datamodule=data) or []  # type: ignore[assignment]
    record = {
        "rank": trainer.global_rank,
        "steps": model.steps,
        "val_rows": fitted["val_rows_epoch"],
        "test_rows": tested[0]["test_rows_epoch"],
        "predicted": [(batch["id"].tolist(), batch[VALID].tolist()) for batch in predicted],
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
