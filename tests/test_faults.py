"""Faults in real processes: a training job killed mid-epoch and restarted from its last
checkpoint (one process, and two DDP processes), a DataLoader worker that dies, checkpoints that
are cut short, edited or from elsewhere, and Parquet files rewritten under a running job.

Every job's rank runs in its own process group with a timeout, and the group is killed afterwards,
so a hang fails the test instead of stalling the suite and no process outlives it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from spiral_lightning import SpiralDataModule, TableSpec, write_table
from tests import fault_job
from tests.fault_job import read_log
from tests.lightning_job import Recorder
from tests.ranks import Ended, torchrun_ended
from tests.tables import layout_table, write_layout

pytestmark = pytest.mark.slow

SIZES = [300, 40, 500, 160]
#: Seconds a job may take before the test calls it hung; a healthy one takes well under a minute.
JOB_TIMEOUT = 240
#: Seconds what is left of a finished job's group may take to end by itself before it is killed.
GROUP_GRACE = 20


def run_job(out: Path, phase: str, uri: str, *options: str) -> Ended:
    """Runs ``tests.fault_job`` in its ranks (``--devices``, 1 by default), each leading a process
    group of its own, kills whatever of the groups is left when they end, and fails the test on a
    timeout.

    What is left matters: DataLoader workers started by a forkserver have the server as parent and
    keep it alive, so when the training process is SIGKILLed neither notices, and they would hold
    the job's output open (and the machine's memory) forever.

    What is left is given time to end by itself first: the job's multiprocessing resource tracker
    is in the group, and only when it ends on its own does it unlink the named semaphores of a
    killed process (``/dev/shm/sem.mp-*``), which a SIGKILL would leave behind for good.
    """
    devices = int(options[options.index("--devices") + 1]) if "--devices" in options else 1
    argv = ["--uri", uri, "--out", str(out), "--phase", phase, *options]
    ended = torchrun_ended(fault_job.main, argv, devices, out, JOB_TIMEOUT, own_group=True)
    for group in ended.pids:
        _end_group(group)
    if None in ended.codes:
        pytest.fail(f"the {phase} job did not end within {JOB_TIMEOUT} s: a hang\n{ended.printed[-4000:]}")
    return ended


def _end_group(group: int) -> None:
    """Waits up to ``GROUP_GRACE`` seconds for every process of ``group`` to end, then kills the rest."""
    deadline = time.monotonic() + GROUP_GRACE
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    _kill_group(group)


def _kill_group(group: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)


def last_checkpoint(out: Path) -> tuple[int, Path]:
    """The step and path of the newest ``step=<n>.ckpt`` the job left."""
    saved = {int(re.fullmatch(r"step=(\d+)\.ckpt", path.name)[1]): path for path in (out / "checkpoints").iterdir()}  # type: ignore[index]
    step = max(saved)
    return step, saved[step]


def ids(records: list[dict[str, Any]], epoch: int, before_step: int | None = None) -> list[int]:
    """The ids of ``epoch``'s recorded steps, only those before ``before_step`` when given."""
    return [
        i
        for record in records
        if record["epoch"] == epoch and (before_step is None or record["step"] < before_step)
        for i in record["ids"]
    ]


@pytest.mark.parametrize(
    ("devices", "batch_size", "epochs", "every", "kill_at", "epoch"),
    [
        # One process, 2 workers of 500 rows, 20 batches an epoch: checkpoints at steps 8, 16, 24
        # and 32, killed after step 35, in the middle of the second epoch.
        (1, 50, 2, 8, 35, 1),
        # Two DDP ranks of 2 workers each, 250 rows a worker, 20 batches a rank: checkpoints at
        # steps 6 and 12, both ranks killed after step 14.
        (2, 25, 1, 6, 14, 0),
    ],
    ids=["one-process", "ddp-2-ranks"],
)
def test_sigkill_mid_epoch_then_resume_delivers_the_epoch_once(
    make_table: Callable[..., TableSpec],
    tmp_path: Path,
    devices: int,
    batch_size: int,
    epochs: int,
    every: int,
    kill_at: int,
    epoch: int,
) -> None:
    spec = make_table(SIZES)
    common = ["--devices", str(devices), "--batch-size", str(batch_size), "--max-epochs", str(epochs)]
    faults = ["--checkpoint-every", str(every), "--kill-at-step", str(kill_at)]
    killed = run_job(tmp_path, "killed", spec.uri, *common, *faults)
    assert killed.codes == [-signal.SIGKILL] * devices, killed.printed[-4000:]
    step, checkpoint = last_checkpoint(tmp_path)
    assert step == kill_at // every * every
    before = [read_log(tmp_path / f"killed-rank{rank}.jsonl") for rank in range(devices)]
    # Every rank trained past the checkpoint before it died: those steps are lost and must come back.
    assert [max(record["step"] for record in records) for records in before] == [kill_at] * devices

    resumed = run_job(tmp_path, "resumed", spec.uri, *common, "--ckpt-path", str(checkpoint))
    assert resumed.codes == [0] * devices, resumed.printed[-4000:]
    after = [read_log(tmp_path / f"resumed-rank{rank}.jsonl") for rank in range(devices)]
    assert all(record["epoch"] >= epoch and record["step"] >= step for records in after for record in records)
    delivered = [i for rank in range(devices) for i in ids(before[rank], epoch, step) + ids(after[rank], epoch)]
    assert sorted(delivered) == list(range(sum(SIZES)))


def test_a_dead_dataloader_worker_fails_the_fit(make_table: Callable[..., TableSpec], tmp_path: Path) -> None:
    spec = make_table(SIZES)
    job = run_job(
        tmp_path, "dies", spec.uri, "--batch-size", "50", "--workers", "1", "--policy", "tests.fault_job.dies_in_worker"
    )
    assert job.codes[0] not in (0, -signal.SIGKILL), job.printed[-4000:]
    dead = r"RuntimeError: DataLoader worker \(pid\(s\) \d+\) exited unexpectedly"
    assert re.search(dead, job.printed), job.printed[-4000:]
    assert read_log(tmp_path / "dies-rank0.jsonl") == []


def test_parquet_files_rewritten_between_epochs_stop_the_fit(tmp_path: Path) -> None:
    spec = write_table(f"parquet:{tmp_path / 'table'}", layout_table([250] * 4), split_rows=250)
    part = tmp_path / "table" / "part-00000.parquet"
    assert part.exists()
    job = run_job(
        tmp_path,
        "rewritten",
        spec.uri,
        *("--batch-size", "50", "--workers", "1", "--max-epochs", "2", "--rewrite-after-epoch", str(part)),
    )
    assert job.codes[0] not in (0, -signal.SIGKILL), job.printed[-4000:]
    assert f"changed {str(part)!r}" in job.printed, job.printed[-4000:]
    assert "rows of another version are never mixed in" in job.printed
    records = read_log(tmp_path / "rewritten-rank0.jsonl")
    # The first epoch read the pinned files whole; the second delivered no row of the rewritten ones.
    assert sorted(ids(records, 0)) == list(range(1000))
    assert ids(records, 1) == []


def trainer(root: Path, **options: Any) -> pl.Trainer:
    """A one-process CPU Trainer writing under ``root`` only."""
    return pl.Trainer(
        default_root_dir=root,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        num_sanity_val_steps=0,
        **options,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TableSpec, Path]]:
    """A table of 120 rows and a checkpoint saved 3 batches of 10 into its first epoch."""
    root = tmp_path_factory.mktemp("saved")
    spec = write_layout(root / "table", [60, 60], 0, "spiral")
    callback = ModelCheckpoint(root / "checkpoints", "{step}", every_n_train_steps=3, save_top_k=-1)
    trainer(root, max_steps=3, callbacks=[callback]).fit(
        Recorder(), datamodule=SpiralDataModule(spec, columns=["id", "x"], batch_size=10)
    )
    yield spec, root / "checkpoints" / "step=3.ckpt"


def resume(spec: TableSpec, checkpoint: Path, root: Path, **options: Any) -> Recorder:
    """Fits on ``spec`` from ``checkpoint`` (DataModule options as given) and returns the model."""
    model = Recorder()
    settings: dict[str, Any] = {"columns": ["id", "x"], "batch_size": 10, **options}
    trainer(root, max_steps=6).fit(model, datamodule=SpiralDataModule(spec, **settings), ckpt_path=checkpoint)
    return model


def edited(checkpoint: Path, folder: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of ``checkpoint`` whose SpiralDataModule entry ``edit`` changed in place."""
    content = torch.load(checkpoint, weights_only=True)
    edit(content["SpiralDataModule"])
    path = folder / "edited.ckpt"
    torch.save(content, path)
    return path


def dataset_state(entry: dict[str, Any]) -> dict[str, Any]:
    """The one consumer's TableDataset state in a one-rank, no-worker DataModule entry."""
    state: dict[str, Any] = entry["ranks"][0]["position"]["loader"]["dataset_state"]
    return state


def test_the_saved_checkpoint_resumes(saved: tuple[TableSpec, Path], tmp_path: Path) -> None:
    spec, checkpoint = saved
    model = resume(spec, checkpoint, tmp_path)
    assert [ids[0] for _, _, ids in model.seen] == [30, 40, 50]


def test_a_truncated_checkpoint_is_refused(saved: tuple[TableSpec, Path], tmp_path: Path) -> None:
    spec, checkpoint = saved
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])
    with pytest.raises(RuntimeError, match="failed finding central directory"):
        resume(spec, cut, tmp_path)


def set_field(name: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(entry: dict[str, Any]) -> None:
        dataset_state(entry)[name] = value

    return edit


def set_format(entry: dict[str, Any]) -> None:
    entry["format"] = 99


def drop_rank(entry: dict[str, Any]) -> None:
    entry["ranks"] = []


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        (set_format, ValueError, "unknown SpiralDataModule state format 99"),
        (drop_rank, ValueError, "the checkpoint holds 0 positions for 1 ranks"),
        (set_field("cursor", [0, -5, 0]), ValueError, r"cursor \(0, -5, 0\) has a negative position"),
        (set_field("cursor", "far"), ValueError, "cursor must be 3 or 5 ints, not 'far'"),
        (set_field("format", 2), ValueError, "unknown TableDataset state format 2"),
        (set_field("version", "another"), ValueError, r"version: saved 'another', now '"),
        (set_field("batch_size", 7), ValueError, "batch_size: saved 7, now 10"),
        (set_field("epoch", -1), ValueError, "epoch must be a non-negative int, not -1"),
        (set_field("work", "0" * 16), ValueError, "another work list in epoch 0"),
    ],
    ids=["format", "ranks", "negative-cursor", "cursor-type", "state-format", "version", "batch", "epoch", "work"],
)
def test_an_edited_checkpoint_is_refused_naming_the_field(
    saved: tuple[TableSpec, Path],
    tmp_path: Path,
    edit: Callable[[dict[str, Any]], None],
    error: type[Exception],
    message: str,
) -> None:
    spec, checkpoint = saved
    # The loader's own error reaches the caller, not an error of Lightning's clean-up after it.
    with pytest.raises(error, match=message):
        resume(spec, edited(checkpoint, tmp_path, edit), tmp_path)


def test_a_checkpoint_of_another_table_is_refused(saved: tuple[TableSpec, Path], tmp_path: Path) -> None:
    spec, checkpoint = saved
    other = write_layout(tmp_path / "other", [60, 60], 0, "spiral")
    with pytest.raises(ValueError, match=rf"saved reading table version {spec.version}, but this run reads version"):
        resume(other, checkpoint, tmp_path)


def test_a_checkpoint_of_another_policy_is_refused(saved: tuple[TableSpec, Path], tmp_path: Path) -> None:
    spec, checkpoint = saved
    policies = r"policy: saved 'spiral_lightning\.work\.balanced', now 'spiral_lightning\.work\.stripe'"
    with pytest.raises(ValueError, match=policies):
        resume(spec, checkpoint, tmp_path, policy="stripe")
