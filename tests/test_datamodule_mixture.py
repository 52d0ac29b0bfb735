"""SpiralDataModule training on a weighted mixture of tables: the batches of the Mixture it makes,
counted ahead so the epoch has its length, resumed mid-epoch from a checkpoint, equal steps on two
DDP ranks, and a resume of that run as one process that re-plans each table's pass."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spiral_lightning import MixedTable, Mixture, SpiralDataModule, TableSpec
from tests.lightning_job import TABLE_IDS, Recorder
from tests.test_datamodule import checkpoints, ids_in, trainer
from tests.test_elastic_lightning import run, stopped_and_resumed


def reference(pairs: list[tuple[TableSpec, float]], stop: Any, epoch: int) -> list[list[int]]:
    """The batches one consumer of the mixture delivers in ``epoch``, ids told apart by table."""
    mixture = Mixture(pairs, batch_size=25, stop=stop, table_key="table", columns=["id", "x"])
    mixture.set_epoch(epoch)
    return [(batch["id"] + TABLE_IDS * batch["table"]).tolist() for batch in mixture]


def data(
    pairs: list[tuple[TableSpec, float]], stop: Any, workers: int = 0, weights: tuple[float, ...] = ()
) -> SpiralDataModule:
    train = [
        MixedTable(spec, weight) for (spec, _), weight in zip(pairs, weights or [w for _, w in pairs], strict=True)
    ]
    return SpiralDataModule(train, batch_size=25, num_workers=workers, stop=stop, table_key="table")


@pytest.mark.parametrize("stop", ["first_exhausted", "cycle"])
def test_a_mixture_trains_as_the_mixture_reads_and_resumes_mid_epoch(
    make_table: Callable[..., TableSpec], tmp_path: Path, stop: str
) -> None:
    pairs = [(make_table([300, 200], columns=["id", "x"]), 3.0), (make_table([130], columns=["id", "x"]), 1.0)]
    whole = [reference(pairs, stop, epoch) for epoch in range(2)]
    first = Recorder()
    run = trainer(tmp_path, max_epochs=2, max_steps=9, callbacks=[checkpoints(tmp_path, 9)])
    run.fit(first, datamodule=data(pairs, stop))
    assert [ids for _, _, ids in first.seen] == whole[0][:9]
    resumed = Recorder()
    trainer(tmp_path, max_epochs=2).fit(resumed, datamodule=data(pairs, stop), ckpt_path=tmp_path / "step=9.ckpt")
    assert [ids for epoch, _, ids in resumed.seen if epoch == 0] == whole[0][9:]
    # The next epoch has its own phases, so another length, which the loader reports anew.
    assert [ids for epoch, _, ids in resumed.seen if epoch == 1] == whole[1]
    assert len(whole[0]) != len(whole[1]) or whole[0] != whole[1]


@pytest.mark.slow
def test_a_mixture_read_by_workers_resumes_under_another_worker_count(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    pairs = [(make_table([300, 200], columns=["id", "x"]), 3.0), (make_table([130], columns=["id", "x"]), 1.0)]
    first = Recorder()
    run = trainer(tmp_path, max_epochs=1, max_steps=8, callbacks=[checkpoints(tmp_path, 8)])
    run.fit(first, datamodule=data(pairs, "first_exhausted", workers=2))
    resumed = Recorder()
    trainer(tmp_path, max_epochs=1).fit(
        resumed, datamodule=data(pairs, "first_exhausted", workers=0), ckpt_path=tmp_path / "step=8.ckpt"
    )
    before, after = ids_in(first.seen, 0), ids_in(resumed.seen, 0)
    assert len(before) == 8 * 25 and after
    assert len(set(before + after)) == len(before + after), "a row of a table's pass came twice"


@pytest.mark.parametrize("workers", [0, 2])
def test_new_weights_on_resume_take_over_from_the_checkpoint_and_lose_no_row(
    make_table: Callable[..., TableSpec], tmp_path: Path, workers: int
) -> None:
    pairs = [(make_table([1500], columns=["id", "x"]), 3.0), (make_table([1500], seed=1, columns=["id", "x"]), 1.0)]
    first = Recorder()
    run = trainer(tmp_path, max_epochs=1, max_steps=16, callbacks=[checkpoints(tmp_path, 16)])
    run.fit(first, datamodule=data(pairs, "first_exhausted", workers=workers))
    resumed = Recorder()
    changed = data(pairs, "first_exhausted", weights=(1.0, 3.0))
    trainer(tmp_path, max_epochs=1).fit(resumed, datamodule=changed, ckpt_path=tmp_path / "step=16.ckpt")
    before, after = ids_in(first.seen, 0), ids_in(resumed.seen, 0)
    assert len(before) == 16 * 25 and len(set(before + after)) == len(before + after)
    # The rows after the checkpoint follow the new weights, 1 to 3 within a batch of each table.
    start = [row // TABLE_IDS for row in after[:400]]
    assert abs(start.count(1) - 300) <= 25, start.count(1)


def test_a_mixture_refuses_what_it_cannot_read(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([50], columns=["id", "x"])
    with pytest.raises(ValueError, match=r"train\[1\] of the mixture must be a MixedTable"):
        SpiralDataModule([MixedTable(spec, 1.0), "spiral:elsewhere"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="leave packing, windows, access and last at their defaults"):
        SpiralDataModule([MixedTable(spec, 1.0)], access="map")
    with pytest.raises(ValueError, match="weight of table 0 of the mixture must be a positive number"):
        SpiralDataModule([{"table": spec.uri, "weight": -1.0}]).setup("fit")  # type: ignore[list-item]


@pytest.mark.slow
def test_ddp_ranks_take_equal_steps_and_resume_as_one_process(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    big = make_table([300, 40, 500, 160]).resolve()
    small = make_table([90, 150], seed=3).resolve()
    options = ["--batch-size", "25", "--mixed-with", small.uri]
    whole = run(tmp_path, "whole", big.uri, 2, *options)
    assert len(whole[0]["seen"]) == len(whole[1]["seen"]) > 0
    before, after = stopped_and_resumed(tmp_path, big.uri, 6, *options)
    assert len(before) == 2 * 6 * 25 and after
    assert len(set(before + after)) == len(before + after), "a row of a table's pass came twice"
    assert {row // TABLE_IDS for row in after} == {0, 1}


def test_weight_points_by_step_train_as_the_mixture_schedule_reads_and_resume_mid_epoch(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    specs = [make_table([1500], columns=["id", "x"]), make_table([1500], seed=1, columns=["id", "x"])]
    # As a config gives them: the first table's share falls from 3:1 to 1:3 at step 12.
    train = [{"table": specs[0].uri, "weight": [[0, 3.0], [12, 1.0]]}, {"table": specs[1].uri, "weight": 1.0}]
    schedule = [(0, [3.0, 1.0]), (12, [1.0, 1.0])]
    mixture = Mixture([(spec, 1.0) for spec in specs], batch_size=25, table_key="table", schedule=schedule)
    whole = [(batch["id"] + TABLE_IDS * batch["table"]).tolist() for batch in mixture]
    first = Recorder()
    run = trainer(tmp_path, max_epochs=1, max_steps=8, callbacks=[checkpoints(tmp_path, 8)])
    run.fit(first, datamodule=SpiralDataModule(train, batch_size=25, num_workers=0, table_key="table"))  # type: ignore[arg-type]
    assert [ids for _, _, ids in first.seen] == whole[:8]
    resumed = Recorder()
    again = SpiralDataModule(train, batch_size=25, num_workers=0, table_key="table")  # type: ignore[arg-type]
    trainer(tmp_path, max_epochs=1).fit(resumed, datamodule=again, ckpt_path=tmp_path / "step=8.ckpt")
    assert [ids for _, _, ids in resumed.seen] == whole[8:]
    tables = [[row // TABLE_IDS for row in batch] for batch in whole]
    assert sum(batch.count(0) for batch in tables[:12]) == pytest.approx(225, abs=25)
    assert sum(batch.count(0) for batch in tables[12:24]) == pytest.approx(150, abs=25)
