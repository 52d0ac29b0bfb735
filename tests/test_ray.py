"""ray_adapter on a real local Ray: the datasource's rows, Ray Train workers reading their ranks'
rows, resuming a stopped run from its checkpoint, and the errors of bad input."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pytest
import torch

# Ray would otherwise wrap workers in a uv runtime environment when pytest runs under `uv run`.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import ray
import ray.train
from ray.train import Checkpoint

from ray_adapter import TableDatasource, read_table, save_loader_state, train_loader
from ray_adapter.cli import CHECKPOINT, parser, run_experiment
from spiral_lightning import Packing, Shard, TableDataset, TableSpec, TokenBudget, Windows, write_table
from spiral_lightning.demos.tabular import DemoModel
from spiral_lightning.record import rows as recorded_rows
from tests.objectstore import S3Server
from tests.tables import BACKENDS, KEEP_TEXT, kept_ids, write_uneven
from tests.test_packing import SEPARATOR, corpus
from tests.test_packing_elastic import LENGTH, check_re_planned, tokens_of

pytestmark = pytest.mark.slow

SPLITS = [300, 500, 200, 700, 300, 400]
TOTAL = sum(SPLITS)


@pytest.fixture(autouse=True)
def _ray(local_ray: None) -> None:
    """Every test here reads through the session's local Ray."""


def rank_ids(spec: TableSpec, rank: int, world_size: int, policy: str = "balanced") -> list[int]:
    """The ids ``TableDataset`` gives ``rank`` under ``policy``, in order: what every Ray reader
    must match."""
    dataset = TableDataset(spec, rank=rank, world_size=world_size, collate=None, policy=policy)
    return [int(i) for batch in dataset for i in batch.column("id").to_pylist()]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("filtered", [False, True])
def test_datasource_rows_are_the_table_and_each_shard_is_its_ranks(
    make_table: Callable[..., TableSpec], backend: str, filtered: bool
) -> None:
    spec = make_table(SPLITS, backend=backend, filter=KEEP_TEXT if filtered else None)
    expected = kept_ids(SPLITS) if filtered else list(range(TOTAL))

    rows = read_table(spec, override_num_blocks=4).take_all()
    assert sorted(row["id"] for row in rows) == expected

    context = ray.data.DataContext.get_current()
    ordered = context.execution_options.preserve_order
    context.execution_options.preserve_order = True
    try:
        for rank in range(2):
            shard = read_table(spec, shard=Shard(rank, 2)).take_all()
            assert [row["id"] for row in shard] == rank_ids(spec, rank, 2)
    finally:
        context.execution_options.preserve_order = ordered


def test_datasource_plans_tasks_from_the_work_items(make_table: Callable[..., TableSpec]) -> None:
    source = TableDatasource(make_table(SPLITS))
    row_bytes = source.estimate_inmemory_data_size() // TOTAL
    assert row_bytes == 8 + 8 + 4 + 16  # id, score, x, v: float32[4]

    one_per_item = source.get_read_tasks(len(SPLITS) * 2)
    assert [task.metadata.num_rows for task in one_per_item] == SPLITS
    grouped = source.get_read_tasks(2)
    assert len(grouped) == 2
    assert sum(task.metadata.num_rows for task in grouped) == TOTAL
    assert [len(task.read_fn.items) for task in grouped] == [3, 3]

    filtered = TableDatasource(make_table(SPLITS, filter=KEEP_TEXT)).get_read_tasks(2)
    assert all(task.metadata.num_rows is None for task in filtered)


def read_ids(config: dict[str, Any]) -> None:
    """A Ray Train loop: read this rank's rows through ``train_loader``, append each batch's ids
    to ``<out>/<run>-rank<r>.txt``, and with ``stop_at`` report a checkpoint after that batch
    and fail, as a job killed mid-epoch would."""
    loader = train_loader(
        config["spec"],
        batch_size=config["batch_size"],
        num_workers=config["workers"],
        even_batches=config.get("even", True),
        **({"policy": config["policy"]} if "policy" in config else {}),
    )
    rank = ray.train.get_context().get_world_rank()
    out = Path(config["out"]) / f"{config['run']}-rank{rank}.txt"
    for epoch in range(loader.dataset.epoch, 1):
        loader.dataset.set_epoch(epoch)
        for step, batch in enumerate(loader):
            with out.open("a") as file:
                file.write("".join(f"{i}\n" for i in batch["id"].tolist()))
            if step == config.get("stop_at"):
                with tempfile.TemporaryDirectory() as folder:
                    save_loader_state(loader, folder)
                    ray.train.report({"step": step}, checkpoint=Checkpoint.from_directory(folder))
                raise RuntimeError("stopped on purpose after the checkpoint")


class FakeContext(NamedTuple):
    """What ``train_loader`` asks of Ray Train's context: this worker's rank in a world. It stands
    in for a TorchTrainer worker so that a rank's reading and resuming are checked in this process,
    in seconds; the real TorchTrainer runs (the CLI's below, which Ray Train restarts from its
    checkpoint, and the README's plain loop) check the same through Ray Train itself."""

    rank: int
    world_size: int

    def get_world_rank(self) -> int:
        return self.rank

    def get_world_size(self) -> int:
        return self.world_size


def read_in_process(
    config: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    world_size: int = 2,
    checkpoint: Checkpoint | None = None,
    ranks: Sequence[int] | None = None,
) -> None:
    """Run ``read_ids`` once for each of ``ranks`` (default: every rank) in this process, each
    under a context of that rank that resumes from ``checkpoint``."""
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: checkpoint)
    for rank in range(world_size) if ranks is None else ranks:
        monkeypatch.setattr(ray.train, "get_context", partial(FakeContext, rank, world_size))
        read_ids(config)


def ids_of(out: Path, run: str, rank: int) -> list[int]:
    path = out / f"{run}-rank{rank}.txt"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def test_trainer_workers_read_exactly_their_ranks_rows(
    make_table: Callable[..., TableSpec], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = make_table(SPLITS, backend="parquet", filter=KEEP_TEXT)
    out = tmp_path / "ids"
    out.mkdir()
    config = {"spec": spec, "batch_size": 64, "workers": 1, "out": str(out), "run": "all", "even": False}
    config["policy"] = "stripe"
    read_in_process(config, monkeypatch)
    for rank in range(2):
        assert ids_of(out, "all", rank) == rank_ids(spec, rank, 2, "stripe")


def test_a_run_stopped_mid_epoch_resumes_every_row_once(
    make_table: Callable[..., TableSpec], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank reports a checkpoint and fails mid-epoch; a run restarted from that checkpoint
    reads the rest of each rank's rows once (in this process: Ray Train's own restart is the
    CLI test's)."""
    # Striped, rank 0 has 800 rows and rank 1 1600: even batches give each 800, 8 batches of 100,
    # and the resume keeps that quota.
    spec = make_table(SPLITS)
    out = tmp_path / "ids"
    out.mkdir()
    saved = tmp_path / "checkpoint"
    saved.mkdir()
    config = {"spec": spec, "batch_size": 100, "workers": 1, "out": str(out), "policy": "stripe"}

    def report(metrics: dict[str, Any], checkpoint: Checkpoint) -> None:
        # As Ray Train keeps one folder per checkpoint, into which every rank reports its files.
        shutil.copytree(checkpoint.path, saved, dirs_exist_ok=True)

    monkeypatch.setattr(ray.train, "report", report)
    for rank in range(2):
        with pytest.raises(RuntimeError, match="stopped on purpose"):
            read_in_process({**config, "run": "first", "stop_at": 2}, monkeypatch, ranks=[rank])
    assert sorted(path.name for path in saved.iterdir()) == ["spiral-loader-rank0.pt", "spiral-loader-rank1.pt"]

    read_in_process({**config, "run": "second"}, monkeypatch, checkpoint=Checkpoint(str(saved)))
    quota = min(len(rank_ids(spec, rank, 2, "stripe")) for rank in range(2))
    assert quota == 800
    for rank in range(2):
        first, second = ids_of(out, "first", rank), ids_of(out, "second", rank)
        assert len(first) == 3 * 100
        assert first + second == rank_ids(spec, rank, 2, "stripe")[:quota]

    # The checkpoint refuses another version of the table.
    other = make_table(SPLITS, seed=1)
    with pytest.raises(ValueError, match="differs in version"):
        read_in_process({**config, "spec": other, "run": "other"}, monkeypatch, checkpoint=Checkpoint(str(saved)))
    assert not list(out.glob("other-*"))


def test_missing_table_fails_in_the_driver_and_in_a_train_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = TableSpec(f"spiral:{tmp_path / 'nowhere'}")
    with pytest.raises(FileNotFoundError, match="no Spiral table"):
        read_table(missing)
    config = {"spec": missing, "batch_size": 10, "workers": 0, "out": str(tmp_path), "run": "missing"}
    with pytest.raises(FileNotFoundError, match="no Spiral table"):
        read_in_process(config, monkeypatch)


class RecordingModel(DemoModel):
    """The demo model, appending each training batch's ids to ``<out>/<attempt>-rank<r>.txt``
    (``first``, or ``resumed`` once restored from a checkpoint); the first attempt fails as step
    ``fail_at`` starts, as a preempted worker would."""

    def __init__(self, out: str, fail_at: int | None = None) -> None:
        super().__init__()
        self.out = Path(out)
        self.fail_at = fail_at
        self.attempt = "first"

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.attempt = "resumed"

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.attempt == "first" and self.trainer.global_step == self.fail_at:
            raise RuntimeError("stopped on purpose after the checkpoint")

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        with (self.out / f"{self.attempt}-rank{self.global_rank}.txt").open("a") as file:
            file.write("".join(f"{i}\n" for i in batch["id"].tolist()))
        return super().training_step(batch, batch_idx)


@pytest.mark.xdist_group("ray_train")
def test_command_fits_the_datamodule_on_ray_train_workers_and_resumes_a_restarted_run(tmp_path: Path) -> None:
    """``spiral-lightning-ray``'s run: the SpiralDataModule under RayDDPStrategy takes its ranks
    from the Trainer, the reported checkpoints hold both ranks' positions, and when the workers
    fail after one, Ray Train restarts them from it and each rank reads on from its position."""
    out = tmp_path / "ids"
    out.mkdir()
    config = tmp_path / "ray_train.yaml"
    config.write_text(
        f"""
ray: {{num_workers: 2, storage_path: {tmp_path / "runs"}, name: demo, checkpoint_every_n_steps: 2, max_failures: 1}}
trainer:
  max_epochs: 1
  limit_val_batches: 0
  enable_progress_bar: false
  enable_model_summary: false
  logger: false
model: {{class_path: tests.test_ray.RecordingModel, init_args: {{out: {out}, fail_at: 3}}}}
data:
  class_path: spiral_lightning.demos.tabular.DemoDataModule
  init_args: {{root: {tmp_path / "demo"}, rows: 2000, val_from: 1600, batch_size: 100, policy: balanced}}
"""
    )
    parse = parser()
    settings = parse.parse_args(["--config", str(config)])
    result = run_experiment(settings, parse.dump(settings))

    assert result.error is None
    assert result.checkpoint is not None
    saved = torch.load(Path(result.checkpoint.path, CHECKPOINT), weights_only=False)
    positions = saved["DemoDataModule"]
    assert positions["world_size"] == 2
    assert [entry["rank"] for entry in positions["ranks"]] == [0, 1]
    # One split of 2000 stored rows, cut in halves: rank 0 trains on ids 0-999 and rank 1 on 1000-1599,
    # and even batches hold both to 600 rows; the latest checkpoint is the epoch's end.
    assert [entry["position"]["batches"] for entry in positions["ranks"]] == [6, 6]
    # The first attempt trained batches 0-2 and failed; the checkpoint after batch 1 put each
    # rank back at batch 2, which it trained again, and on to the end of its rows.
    for rank, rows in enumerate([range(600), range(1000, 1600)]):
        first, resumed = ids_of(out, "first", rank), ids_of(out, "resumed", rank)
        assert len(first) == 300
        assert first[:200] + resumed == list(rows)


def test_a_table_in_an_object_store_reads_in_tasks_and_train_workers(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_server.make_bucket("ray-table")
    store = {
        "aws_endpoint": s3_server.endpoint,
        "allow_http": True,
        "aws_access_key_id": s3_server.access_key,
        "aws_secret_access_key": s3_server.secret_key,
    }
    rows = pa.table({"id": list(range(TOTAL)), "x": [float(i) for i in range(TOTAL)]})
    spec = write_table("parquet:s3://ray-table/t", rows, split_rows=300, storage_options=store)
    assert sorted(row["id"] for row in read_table(spec.uri, storage_options=store).take_all()) == list(range(TOTAL))

    out = tmp_path / "ids"
    out.mkdir()
    config = {"spec": spec, "batch_size": 64, "workers": 1, "out": str(out), "run": "s3", "even": False}
    config["policy"] = "stripe"
    read_in_process(config, monkeypatch)
    for rank in range(2):
        assert ids_of(out, "s3", rank) == rank_ids(spec, rank, 2, "stripe")


def test_train_loader_balances_uneven_splits_by_default_and_leaves_out_at_most_a_row_per_consumer(
    make_table: Callable[..., TableSpec], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Striped, these splits gave the two ranks 7,200 and 4,900 rows, and even batches left out 4,600.
    sizes = [3000, 700, 4100, 2500, 1800]
    spec = make_table(sizes, backend="parquet")
    out = tmp_path / "ids"
    out.mkdir()
    read_in_process({"spec": spec, "batch_size": 100, "workers": 1, "out": str(out), "run": "default"}, monkeypatch)
    read = [ids_of(out, "default", rank) for rank in range(2)]
    assert len(read[0]) == len(read[1]) == sum(sizes) // 2
    assert sorted(read[0] + read[1]) == list(range(sum(sizes)))
    for rank in range(2):
        assert read[rank] == [
            int(i) for batch in TableDataset(spec, policy="balanced", rank=rank, world_size=2) for i in batch["id"]
        ]


def test_train_loader_packs_blocks_and_resumes_them_under_another_world_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lengths = [int(n) for n in np.random.default_rng(5).integers(0, 40, 300)]
    spec = write_uneven(tmp_path / "t", corpus(lengths), [100, 120, 80])
    packing = Packing("tokens", LENGTH, separator=SEPARATOR)
    saved = tmp_path / "checkpoint"
    saved.mkdir()
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    before: list[int] = []
    for rank in range(2):
        monkeypatch.setattr(ray.train, "get_context", partial(FakeContext, rank, 2))
        loader = train_loader(spec, batch_size=4, num_workers=0, packing=packing)
        reading = iter(loader)
        batches = [next(reading) for _ in range(3)]
        assert all(batch["tokens"].shape == (4, LENGTH) == batch["positions"].shape for batch in batches)
        before += tokens_of(batches)
        save_loader_state(loader, saved)
    # One rank goes on: the documents neither rank began once, each one's partial document whole.
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: Checkpoint(str(saved)))
    monkeypatch.setattr(ray.train, "get_context", partial(FakeContext, 0, 1))
    after = tokens_of(train_loader(spec, batch_size=4, num_workers=0, packing=packing))
    check_re_planned(lengths, before, after, saved=2, new_consumers=1)


def saved_and_resumed(
    loader: Callable[[int, int, Path | None], Any], delivered: Callable[[Any], list[Any]], stop: int, saved: Path
) -> tuple[list[list[Any]], list[list[Any]]]:
    """Each of two ranks' uninterrupted epoch, and what each delivered in its first ``stop``
    batches before saving its state into ``saved``; checks that under the saved layout each rank
    then goes on with the rest of its uninterrupted epoch. ``loader(rank, world_size, checkpoint)``
    makes a rank's loader, ``delivered`` lists what batches delivered."""
    whole = [delivered(loader(rank, 2, None)) for rank in range(2)]
    before = []
    for rank in range(2):
        saving = loader(rank, 2, None)
        reading = iter(saving)
        before.append(delivered([next(reading) for _ in range(stop)]))
        save_loader_state(saving, saved)
    for rank in range(2):
        assert before[rank] + delivered(loader(rank, 2, saved)) == whole[rank], rank
    return whole, before


@pytest.mark.parametrize("kind", ["mixture", "windows"])
def test_train_loader_reads_a_mixture_and_windows_and_resumes_them(
    make_table: Callable[..., TableSpec], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    pairs = [(make_table([300, 200], columns=["id"]), 3.0), (make_table([120], seed=1, columns=["id"]), 1.0)]
    options: dict[str, Any] = (
        {"spec": pairs, "table_key": "table"}
        if kind == "mixture"
        else {"spec": make_table([300, 200], columns=["id"]), "windows": Windows(4, 2)}
    )
    saved = tmp_path / "checkpoint"
    saved.mkdir()

    def loader(rank: int, world_size: int, checkpoint: Path | None) -> Any:
        found = None if checkpoint is None else Checkpoint(str(checkpoint))
        monkeypatch.setattr(ray.train, "get_checkpoint", lambda: found)
        monkeypatch.setattr(ray.train, "get_context", partial(FakeContext, rank, world_size))
        return train_loader(batch_size=20, num_workers=0, **options)

    def rows_of(batches: Any) -> list[Any]:
        if kind == "mixture":
            return [(int(batch["table"]), batch["id"].tolist()) for batch in batches]
        return [tuple(window) for batch in batches for window in batch["id"].tolist()]

    whole, before = saved_and_resumed(loader, rows_of, 3, saved)
    # One rank re-plans what neither had delivered: no row (window) of a table twice.
    after = rows_of(loader(0, 1, saved))
    delivered = before[0] + before[1] + after
    if kind == "mixture":
        for table in (0, 1):
            ids = [row for index, rows in delivered if index == table for row in rows]
            assert len(ids) == len(set(ids)), f"a row of table {table} came twice"
        assert {index for index, _ in after} == {0, 1}
    else:
        assert sorted(delivered) == sorted(whole[0] + whole[1])


def test_train_loader_reads_by_index_and_resumes_under_the_saved_and_another_world_size(
    make_table: Callable[..., TableSpec], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = make_table([300, 250, 151], columns=["id"])
    saved = tmp_path / "checkpoint"
    saved.mkdir()

    def loader(rank: int, world_size: int, checkpoint: Path | None, batch_size: int = 20) -> Any:
        found = None if checkpoint is None else Checkpoint(str(checkpoint))
        monkeypatch.setattr(ray.train, "get_checkpoint", lambda: found)
        monkeypatch.setattr(ray.train, "get_context", partial(FakeContext, rank, world_size))
        made = train_loader(spec, access="map", batch_size=batch_size, num_workers=0, seed=3)
        made.set_epoch(made.epoch)
        return made

    def ids(batches: Any) -> list[int]:
        return [row for batch in batches for row in batch["id"].tolist()]

    # The sampler's order: two ranks deal a shuffle of the 701 rows, one row left out for equal ranks.
    whole, before = saved_and_resumed(loader, ids, 4, saved)
    assert len(whole[0]) == len(whole[1]) == 350 and len(set(whole[0] + whole[1])) == 700
    # One rank in batches of 30: every row neither rank delivered, each once.
    after = ids(loader(0, 1, saved, batch_size=30))
    assert sorted(before[0] + before[1] + after) == sorted(whole[0] + whole[1])


def test_train_loader_batches_by_token_budget_and_resumes_under_the_saved_and_another_world_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lengths = [int(n) for n in np.random.default_rng(7).integers(1, 60, 400)]
    spec = write_uneven(tmp_path / "t", corpus(lengths), [150, 250])
    saved = tmp_path / "checkpoint"
    saved.mkdir()
    budget = TokenBudget("tokens", max_tokens=256)

    def loader(rank: int, checkpoint: Path | None, world_size: int = 2) -> Any:
        found = None if checkpoint is None else Checkpoint(str(checkpoint))
        monkeypatch.setattr(ray.train, "get_checkpoint", lambda: found)
        monkeypatch.setattr(ray.train, "get_context", partial(FakeContext, rank, world_size))
        return train_loader(spec, tokens=budget, num_workers=0)

    def documents_of(batches: Any) -> list[int]:
        # Token ids count up across the corpus: a document is known by its first token.
        return [int(row[0]) for batch in batches for row in batch["tokens"].tolist()]

    whole = [list(loader(rank, None)) for rank in range(2)]
    assert all(batch["tokens"].numel() <= 256 for batches in whole for batch in batches)
    before = []
    for rank in range(2):
        saving = loader(rank, None)
        reading = iter(saving)
        before.append(documents_of([next(reading) for _ in range(3)]))
        save_loader_state(saving, saved)
    for rank in range(2):
        assert before[rank] + documents_of(loader(rank, saved)) == documents_of(whole[rank])
    # One rank re-plans what neither had delivered: every document once, those the two ranks'
    # equal steps had left out too.
    after = documents_of(loader(0, saved, world_size=1))
    firsts = np.cumsum([0, *lengths[:-1]]).tolist()
    assert sorted(before[0] + before[1] + after) == firsts


@pytest.mark.parametrize("workers", [0, 1])
def test_train_loader_records_each_steps_rows_through_a_resume(
    make_table: Callable[..., TableSpec], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    spec = make_table([400, 300], columns=["id"])
    saved = tmp_path / "checkpoint"
    saved.mkdir()
    folder = str(tmp_path / "record")

    def loader(rank: int, checkpoint: Path | None) -> Any:
        found = None if checkpoint is None else Checkpoint(str(checkpoint))
        monkeypatch.setattr(ray.train, "get_checkpoint", lambda: found)
        monkeypatch.setattr(ray.train, "get_context", partial(FakeContext, rank, 2))
        return train_loader(spec, batch_size=50, num_workers=workers, shuffle=True, record=folder)

    trained: dict[int, dict[int, list[int]]] = {0: {}, 1: {}}
    for rank in range(2):
        saving = loader(rank, None)
        reading = iter(saving)
        for step in range(3):
            trained[rank][step] = next(reading)["id"].tolist()
        save_loader_state(saving, saved)
        del reading, saving
    for rank in range(2):
        for step, batch in enumerate(loader(rank, saved), start=3):
            trained[rank][step] = batch["id"].tolist()
    recorded = recorded_rows(folder)
    for rank in range(2):
        noted = {
            # Split 1's stored rows hold ids from 400 on.
            step: sorted(400 * split + row for split, start, end in ranks[rank] for row in range(start, end))
            for step, ranks in recorded.items()
            if rank in ranks
        }
        assert noted == {step: sorted(ids) for step, ids in trained[rank].items()}, rank


def test_train_loader_refuses_two_kinds_at_once_before_reading(
    make_table: Callable[..., TableSpec], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = make_table([50], columns=["id"])
    monkeypatch.setattr(ray.train, "get_context", partial(FakeContext, 0, 1))
    budget = TokenBudget("tokens", max_tokens=64)
    with pytest.raises(ValueError, match="reads one kind of dataset, but packing and windows were given"):
        train_loader(spec, batch_size=8, packing=Packing("tokens", 8), windows=Windows(2))
    with pytest.raises(ValueError, match="but a mixture and windows were given"):
        train_loader([(spec, 1.0)], batch_size=8, windows=Windows(2))
    with pytest.raises(ValueError, match=r"access='map' reads one table's rows .* \(given: tokens\)"):
        train_loader(spec, tokens=budget, access="map")
    with pytest.raises(ValueError, match=r"\(given: record\)"):
        train_loader(spec, batch_size=8, access="map", record="unused")
    with pytest.raises(ValueError, match=r"takes batch_size .* or tokens= .* not both"):
        train_loader(spec, batch_size=8, tokens=budget)
