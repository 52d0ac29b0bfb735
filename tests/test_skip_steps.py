"""Rolling a run back to a checkpoint and skipping the data of some steps: the resumed run reads
exactly the batches the first run read after the checkpoint, less those of the skipped steps, a
second resume inside the rolled-back run keeps numbering the steps as the first run did, and two
DDP ranks leave out the same steps and stay in step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from spiral_lightning import SpiralDataModule, TableSpec
from spiral_lightning.lightning.skips import StepSkips
from spiral_lightning.record import rows
from tests.lightning_job import Recorder
from tests.test_elastic_lightning import run

SKIPS = [(12, 15), (22, 25)]


def fit(root: Path, spec: TableSpec, ckpt_path: Path | None, skip_steps: Any = None, **options: Any) -> Recorder:
    """Two epochs of 20 batches each, a checkpoint every 5 steps under ``root``."""
    model = Recorder()
    data = SpiralDataModule(spec, batch_size=50, num_workers=0, shuffle=True, skip_steps=skip_steps)
    saves = ModelCheckpoint(root, "{step}", every_n_train_steps=5, save_top_k=-1)
    settings: dict[str, Any] = {"enable_progress_bar": False, "enable_model_summary": False, "logger": False}
    trainer = pl.Trainer(max_epochs=2, callbacks=[saves], default_root_dir=root, **settings, **options)
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    return model


def test_a_rolled_back_run_reads_every_batch_but_the_skipped_steps(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    spec = make_table([1000], columns=["id", "x"])
    first = fit(tmp_path / "first", spec, None)
    steps = {step: ids for _, step, ids in first.seen}
    assert sorted(steps) == list(range(40))

    rolled = fit(tmp_path / "rolled", spec, tmp_path / "first" / "step=10.ckpt", SKIPS)
    kept = [step for step in range(10, 40) if not any(low <= step < high for low, high in SKIPS)]
    assert [ids for _, _, ids in rolled.seen] == [steps[step] for step in kept]
    # Each epoch is shorter by its skipped steps: epoch 0 ends after step 19 of the first run.
    assert [epoch for epoch, _, _ in rolled.seen].count(0) == 20 - 10 - 3

    # The rolled-back run's step 15 is the first run's step 18 (steps 12-14 were skipped before
    # it); resumed from there with the same skips, it reads the first run's steps from 18 on.
    again = fit(tmp_path / "again", spec, tmp_path / "rolled" / "step=15.ckpt", SKIPS)
    assert [ids for _, _, ids in again.seen] == [steps[step] for step in kept if step >= 18]


def test_skips_that_cannot_be_honoured_are_refused(make_table: Callable[..., TableSpec], tmp_path: Path) -> None:
    spec = make_table([200], columns=["id", "x"])
    for bad in ([(5, 5)], [(3,)], [(-1, 4)], [("a", 4)]):
        with pytest.raises(ValueError, match=r"skip_steps\[0\] must be a pair \(start, end\)"):
            StepSkips.of(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="accumulates 2 batches a step"):
        fit(tmp_path, spec, None, SKIPS, accumulate_grad_batches=2)
    fit(tmp_path / "first", spec, None, max_steps=6)
    data = SpiralDataModule(spec, batch_size=40, num_workers=0, shuffle=True, skip_steps=SKIPS)
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="only a resume under that run's world size, num_workers and batch_size"):
        trainer.fit(Recorder(), datamodule=data, ckpt_path=tmp_path / "first" / "step=5.ckpt")


@pytest.mark.slow
def test_two_ddp_ranks_skip_the_same_steps_and_record_them(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    spec = make_table([400, 400]).resolve()
    # Each rank reads 400 rows in batches of 20: 20 steps. Roll back to step 4 and skip steps 6-8.
    options = ["--batch-size", "20", "--workers", "0", "--record", str(tmp_path / "record")]
    first = run(tmp_path, "first", spec.uri, 2, *options, "--checkpoint-every", "4")
    resumed = str(tmp_path / "checkpoints" / "step=4.ckpt")
    rolled = run(tmp_path, "rolled", spec.uri, 2, *options, "--ckpt-path", resumed, "--skip-steps", "6:9")
    kept = [step for step in range(4, 20) if not 6 <= step < 9]
    for rank in range(2):
        steps = {step: ids for _, step, ids in first[rank]["seen"]}
        assert sorted(steps) == list(range(20))
        assert [ids for _, _, ids in rolled[rank]["seen"]] == [steps[step] for step in kept]
    recorded = rows(tmp_path / "record")
    assert sorted(recorded) == [step for step in range(20) if not 6 <= step < 9]
    assert all(sorted(ranks) == [0, 1] for ranks in recorded.values())
