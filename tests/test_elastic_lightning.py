"""Elastic resume through SpiralDataModule checkpoints: a run stopped under one number of ranks,
workers or rows a batch resumes under another, and the epoch still delivers every row exactly once."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spiral_lightning import SpiralDataModule, TableSpec
from tests import lightning_job
from tests.lightning_job import Recorder
from tests.ranks import torchrun
from tests.test_datamodule import checkpoints, ids_in, trainer

ROOT = Path(__file__).resolve().parent.parent
SIZES = [300, 40, 500, 160]


@pytest.mark.slow
@pytest.mark.parametrize(("workers", "batch_size"), [(0, 50), (1, 35), (2, 80)])
def test_a_run_resumes_under_another_worker_count_or_batch_size(
    make_table: Callable[..., TableSpec], tmp_path: Path, workers: int, batch_size: int
) -> None:
    spec = make_table(SIZES, columns=["id", "x"])
    every = list(range(sum(SIZES)))
    first = Recorder()
    # Two workers of 500 rows: 20 batches of 50 an epoch; stop 7 batches into the first epoch.
    run = trainer(tmp_path, max_epochs=2, max_steps=7, callbacks=[checkpoints(tmp_path, 7)])
    run.fit(first, datamodule=SpiralDataModule(spec, batch_size=50, num_workers=2))
    resumed = Recorder()
    data = SpiralDataModule(spec, batch_size=batch_size, num_workers=workers)
    trainer(tmp_path, max_epochs=2).fit(resumed, datamodule=data, ckpt_path=tmp_path / "step=7.ckpt")
    assert len(ids_in(first.seen, 0)) == 350
    assert sorted(ids_in(first.seen, 0) + ids_in(resumed.seen, 0)) == every
    # The rest of the epoch comes in the new batches, only each consumer's last one shorter, and
    # the step count goes on from the checkpoint's.
    rest = [ids for epoch, _, ids in resumed.seen if epoch == 0]
    assert max(len(ids) for ids in rest) == batch_size
    assert len([ids for ids in rest if len(ids) < batch_size]) <= max(1, workers)
    assert [step for epoch, step, _ in resumed.seen if epoch == 0] == list(range(7, 7 + len(rest)))
    # The epoch after the re-planned one reads the whole table under the new workers and batches.
    assert sorted(ids_in(resumed.seen, 1)) == every
    assert max(len(ids) for epoch, _, ids in resumed.seen if epoch == 1) == batch_size


def run(out: Path, phase: str, uri: str, devices: int, *extra: str) -> list[dict[str, Any]]:
    argv = ["--uri", uri, "--out", str(out), "--phase", phase, "--devices", str(devices), *extra]
    torchrun(lightning_job.main, argv, devices, out)
    return [json.loads((out / f"{phase}-rank{rank}.json").read_text()) for rank in range(devices)]


def stopped_and_resumed(out: Path, uri: str, steps: int, *options: str) -> tuple[list[int], list[int]]:
    """The row ids a 2-rank DDP job of ``lightning_job`` read before it stopped at ``steps`` (each
    rank read ``steps`` batches), and those one process read resuming from that checkpoint."""
    first = run(out, "first", uri, 2, *options, "--max-steps", str(steps), "--checkpoint-every", str(steps))
    assert [len(record["seen"]) for record in first] == [steps, steps]
    ckpt = str(out / "checkpoints" / f"step={steps}.ckpt")
    (resumed,) = run(out, "resumed", uri, 1, *options, "--workers", "0", "--ckpt-path", ckpt)
    before = [row for record in first for _, _, ids in record["seen"] for row in ids]
    return before, [row for _, _, ids in resumed["seen"] for row in ids]


@pytest.mark.slow
def test_a_ddp_run_resumes_as_one_process(make_table: Callable[..., TableSpec], tmp_path: Path) -> None:
    spec = make_table(SIZES).resolve()
    # 2 ranks x 2 workers read 250 rows each: 20 batches of 25 per rank. Stop after 9.
    before, after = stopped_and_resumed(tmp_path, spec.uri, 9, "--batch-size", "25")
    assert len(before) == 2 * 9 * 25
    assert sorted(before + after) == list(range(sum(SIZES)))
