"""SpiralDataModule under a real Lightning Trainer: exactly once across a mid-epoch stop and
resume (one process, and two DDP processes with two workers each), equal batches per rank on
uneven tables, the Trainer's epoch reaching the workers, and the errors of bad checkpoints."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from spiral_lightning import Shard, SpiralDataModule, Split, TableDataset, TableSpec, balanced, send_by_name
from tests import lightning_job
from tests.lightning_job import Recorder, reversed_on_odd_epochs
from tests.ranks import torchrun
from tests.tables import KEEP, kept_ids

ROOT = Path(__file__).resolve().parent.parent
SIZES = [300, 40, 500, 160]


def trainer(root: Path, **options: Any) -> pl.Trainer:
    """A CPU Trainer that writes only under ``root`` (its default checkpoints included)."""
    settings: dict[str, Any] = {
        "default_root_dir": root,
        "accelerator": "cpu",
        "devices": 1,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
        "num_sanity_val_steps": 0,
    }
    settings.update(options)
    return pl.Trainer(**settings)


def checkpoints(folder: Path, every: int) -> ModelCheckpoint:
    return ModelCheckpoint(folder, "{step}", every_n_train_steps=every, save_top_k=-1)


def ids_in(seen: list[tuple[int, int, list[int]]], epoch: int, before_step: int | None = None) -> list[int]:
    return [
        i
        for seen_epoch, step, ids in seen
        if seen_epoch == epoch and (before_step is None or step < before_step)
        for i in ids
    ]


@pytest.mark.slow
def test_mid_epoch_resume_delivers_every_row_once(make_table: Callable[..., TableSpec], tmp_path: Path) -> None:
    spec = make_table(SIZES, columns=["id", "x"])
    every = list(range(sum(SIZES)))

    def data() -> SpiralDataModule:
        return SpiralDataModule(spec, batch_size=50, num_workers=2)

    # Two workers of 500 rows each: 20 batches an epoch. Stop 5 batches into the second epoch.
    first = Recorder()
    run = trainer(tmp_path, max_epochs=2, max_steps=25, callbacks=[checkpoints(tmp_path, 5)])
    run.fit(first, datamodule=data())
    assert run.num_training_batches == 20
    assert sorted(ids_in(first.seen, 0)) == every
    assert len(ids_in(first.seen, 1)) == 250

    resumed = Recorder()
    trainer(tmp_path, max_epochs=2).fit(resumed, datamodule=data(), ckpt_path=tmp_path / "step=25.ckpt")
    assert ids_in(resumed.seen, 0) == []
    assert sorted(ids_in(first.seen, 1) + ids_in(resumed.seen, 1)) == every

    # A checkpoint on the last batch of an epoch resumes into a whole next epoch.
    after_epoch = Recorder()
    trainer(tmp_path, max_epochs=2).fit(after_epoch, datamodule=data(), ckpt_path=tmp_path / "step=20.ckpt")
    assert sorted(ids_in(after_epoch.seen, 1)) == every
    assert ids_in(after_epoch.seen, 0) == []


@pytest.mark.slow
def test_trainer_epoch_reaches_persistent_workers(make_table: Callable[..., TableSpec], tmp_path: Path) -> None:
    spec = make_table([100, 100], columns=["id", "x"])
    model = Recorder()
    data = SpiralDataModule(spec, batch_size=100, num_workers=1, persistent_workers=True, policy=reversed_on_odd_epochs)
    fitted = trainer(tmp_path, max_epochs=3)
    fitted.fit(model, datamodule=data)
    # Epochs 0 and 2 read split 0 first; epoch 1 reads the plan reversed.
    assert [ids[0] for _, _, ids in model.seen] == [0, 100, 100, 0, 0, 100]
    # Workers keep torch's sharing strategy: sending by name can time out on a loaded machine.
    # (Lightning sets a worker_init_fn of its own when a test before this one seeded workers.)
    assert fitted.train_dataloader.worker_init_fn is not send_by_name


def run_ddp(out: Path, phase: str, uri: str, *extra: str) -> list[dict[str, Any]]:
    torchrun(lightning_job.main, ["--uri", uri, "--out", str(out), "--phase", phase, *extra], 2, out)
    return [json.loads((out / f"{phase}-rank{rank}.json").read_text()) for rank in range(2)]


def rank_ids(record: dict[str, Any]) -> list[int]:
    return [i for _, _, ids in record["seen"] for i in ids]


@pytest.mark.slow
def test_ddp_mid_epoch_resume_restores_every_rank(make_table: Callable[..., TableSpec], tmp_path: Path) -> None:
    spec = make_table(SIZES).resolve()
    # 2 ranks x 2 workers read 250 rows each: 20 batches of 25 per rank. Stop after 13.
    first = run_ddp(tmp_path, "first", spec.uri, "--batch-size", "25", "--max-steps", "13", "--checkpoint-every", "13")
    assert [len(record["seen"]) for record in first] == [13, 13]
    ckpt = str(tmp_path / "checkpoints" / "step=13.ckpt")
    resumed = run_ddp(tmp_path, "resumed", spec.uri, "--batch-size", "25", "--ckpt-path", ckpt)
    assert [len(record["seen"]) for record in resumed] == [7, 7]
    shares = []
    for rank in range(2):
        share = rank_ids(first[rank]) + rank_ids(resumed[rank])
        expected = [
            row
            for worker in range(2)
            for item in balanced([Split(i, 0, n) for i, n in enumerate(SIZES)], Shard(rank, 2, worker, 2))
            for row in range(sum(SIZES[: item.split]) + item.start, sum(SIZES[: item.split]) + item.end)
        ]
        assert sorted(share) == sorted(expected)
        shares += share
    assert sorted(shares) == list(range(sum(SIZES)))


@pytest.mark.slow
def test_ddp_on_uneven_filtered_splits_gives_ranks_equal_batches(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    sizes = [2000, 30, 700, 5, 1200, 64]
    spec = make_table(sizes, seed=3).resolve()
    kept = set(kept_ids(sizes, seed=3))
    filtered = TableDataset(TableSpec(spec.uri, filter=KEEP), policy=balanced, rank=0, world_size=2)
    # The filter empties the splits of 5 and 64 rows, and the scan leaves them out of its plan.
    assert len(filtered.source().splits) == len(sizes) - 2
    counts = [
        sum(filtered.source().count(filtered.work(Shard(rank, 2, worker, 2))))
        for rank in range(2)
        for worker in range(2)
    ]
    quota = min(counts)
    assert quota < max(counts)
    records = run_ddp(tmp_path, "uneven", spec.uri, "--batch-size", "32", "--filtered")
    assert [len(record["seen"]) for record in records] == [2 * -(-quota // 32)] * 2
    delivered = [rank_ids(record) for record in records]
    assert [len(rows) for rows in delivered] == [2 * quota, 2 * quota]
    every = delivered[0] + delivered[1]
    assert len(set(every)) == len(every)
    assert set(every) <= kept


def test_checkpoint_from_another_table_version_is_refused(make_table: Callable[..., TableSpec], tmp_path: Path) -> None:
    saved_on = make_table([120], columns=["id", "x"])
    trainer(tmp_path, max_steps=2, callbacks=[checkpoints(tmp_path, 2)]).fit(
        Recorder(), datamodule=SpiralDataModule(saved_on, batch_size=10)
    )
    other = make_table([120], columns=["id", "x"]).resolve()
    with pytest.raises(ValueError, match=rf"saved reading table version {saved_on.resolve().version}.*reads version"):
        trainer(tmp_path, max_steps=4).fit(
            Recorder(), datamodule=SpiralDataModule(other, batch_size=10), ckpt_path=tmp_path / "step=2.ckpt"
        )


def test_read_ahead_reaches_the_dataset_of_every_stage(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([300, 200])
    for depth in (0, 4):
        module = SpiralDataModule(spec.uri, val=spec.uri, batch_size=64, read_ahead=depth)
        module.setup("fit")
        assert {stage: dataset.read_ahead for stage, dataset in module.datasets.items()} == {
            "train": depth,
            "val": depth,
        }


def test_bad_arguments_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'fork' is not supported.*forkserver"):
        SpiralDataModule("spiral:x", num_workers=2, multiprocessing_context="fork")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown policy 'shuffle'"):
        SpiralDataModule("spiral:x", policy="shuffle")
    with pytest.raises(ValueError, match="read_ahead must be a non-negative int"):
        SpiralDataModule("spiral:x", read_ahead=-1)
    with pytest.raises(FileNotFoundError, match="no Spiral table at"):
        trainer(tmp_path, max_steps=1).fit(Recorder(), datamodule=SpiralDataModule(f"spiral:{tmp_path / 'missing'}"))
