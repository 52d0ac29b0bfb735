"""The record of each step's rows: what a DataModule run trained on, step by step and rank by
rank, read back by ``spiral_lightning.record.rows``, through a rollback with skipped steps."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint
from pyarrow.fs import FileSelector

from spiral_lightning import (
    MixedTable,
    Mixture,
    PackedDataset,
    Packing,
    Shuffled,
    SpiralDataModule,
    TableDataset,
    TableSpec,
    TokenBatchDataset,
    TokenBudget,
    WindowDataset,
    Windows,
    write_table,
)
from spiral_lightning.core.storage import StorageOptions
from spiral_lightning.datasets.record import StepRecord, check_recordable
from spiral_lightning.lightning.cli import main
from spiral_lightning.lightning.loader import consumer_states
from spiral_lightning.record import rows
from tests.examples import examples
from tests.lightning_job import TABLE_IDS, Recorder
from tests.objectstore import S3Server
from tests.tables import write_uneven
from tests.test_objectstore import bucket, options
from tests.test_packing import corpus, documents

SKIPS = [(12, 15)]


def fit(root: Path, spec: TableSpec, ckpt_path: Path | None, **settings: Any) -> Recorder:
    """Two epochs of 20 batches of 50 rows, a checkpoint every 5 steps, the record in ``root/record``
    unless ``settings`` name another."""
    model = Recorder()
    data = SpiralDataModule(spec, **{"batch_size": 50, "record": str(root.parent / "record"), **settings})
    saves = ModelCheckpoint(root, "{step}", every_n_train_steps=5, save_top_k=-1)
    settings: dict[str, Any] = {"enable_progress_bar": False, "enable_model_summary": False, "logger": False}
    pl.Trainer(max_epochs=2, callbacks=[saves], default_root_dir=root, **settings).fit(
        model, datamodule=data, ckpt_path=ckpt_path
    )
    return model


def noted_steps(folder: Path, dataset: Any, loader: Any, delivered: Callable[[Any], Any]) -> list[Any]:
    """What ``delivered`` says of each batch of ``loader`` (over ``dataset``), each batch noted as
    a step, from step 0, in a record of ``dataset`` in ``folder``."""
    record = StepRecord(folder, dataset, rank=0, from_step=0)
    record.begin([])
    seen = []
    for step, batch in enumerate(loader):
        record.note(step, consumer_states(loader.state_dict()))
        seen.append(delivered(batch))
    record.flush()
    return seen


def stored(ranges: list[tuple[int, int, int]]) -> list[int]:
    """The ids of a one-split table whose id is its stored row."""
    return sorted(row for split, start, end in ranges for row in range(start, end))


@pytest.mark.parametrize(("workers", "shuffle"), [(0, True), (2, False)])
def test_the_record_names_each_steps_rows_through_a_rollback_with_skipped_steps(
    make_table: Callable[..., TableSpec], tmp_path: Path, workers: int, shuffle: bool
) -> None:
    spec = make_table([1000], columns=["id", "x"])
    first = fit(tmp_path / "first", spec, None, num_workers=workers, shuffle=shuffle)
    recorded = rows(tmp_path / "record")
    assert sorted(recorded) == list(range(40))
    assert all(stored(recorded[step][0]) == sorted(ids) for _, step, ids in first.seen)

    rolled = fit(
        tmp_path / "rolled",
        spec,
        tmp_path / "first" / "step=10.ckpt",
        num_workers=workers,
        shuffle=shuffle,
        skip_steps=SKIPS,
    )
    recorded = rows(tmp_path / "record")
    # The skipped steps' rows were read and dropped: the record keeps no rows for them.
    assert sorted(recorded) == [step for step in range(40) if not 12 <= step < 15]
    trained = [ids for _, step, ids in first.seen if step < 10] + [ids for _, _, ids in rolled.seen]
    assert sorted(stored(r[0]) for r in recorded.values()) == sorted(sorted(ids) for ids in trained)
    # Epoch 0 (steps 0-19) trained every row but the skipped steps' once; epoch 1 every row.
    epoch_0 = [i for step, ranges in recorded.items() if step < 20 for i in stored(ranges[0])]
    skipped = {i for _, step, ids in first.seen if 12 <= step < 15 for i in ids}
    assert sorted(epoch_0) == sorted(set(range(1000)) - skipped) and len(skipped) == 150


def test_the_command_prints_a_steps_rows_and_kinds_it_cannot_record_are_refused(
    make_table: Callable[..., TableSpec], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = make_table([1000], columns=["id", "x"])
    first = fit(tmp_path / "first", spec, None, num_workers=0)
    capsys.readouterr()
    main(["record", str(tmp_path / "record"), "--steps", "3:5"])
    # Stored order: step s trained rows 50 s to 50 s + 49, epoch 0 then again in epoch 1.
    assert capsys.readouterr().out.splitlines() == ["step 3 rank 0: 0:150-200", "step 4 rank 0: 0:200-250"]
    assert [sorted(ids) for _, step, ids in first.seen if step in (3, 4)] == [
        list(range(150, 200)),
        list(range(200, 250)),
    ]
    with pytest.raises(SystemExit):
        main(["record", str(tmp_path / "nowhere")])
    assert "no record folder" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not for list; leave record unset"):
        check_recordable([1, 2], tmp_path / "r2")
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    remote = SpiralDataModule(spec, record="s3://no-such-bucket/record")
    with pytest.raises(ValueError, match="the record folder 's3://no-such-bucket/record' cannot be reached"):
        trainer.fit(Recorder(), datamodule=remote)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_record_names_the_documents_each_packed_step_read(tmp_path: Path, workers: int) -> None:
    lengths = [int(n) for n in np.random.default_rng(2).integers(0, 40, 300)]
    # One split: a document's stored row is its number.
    spec = write_uneven(tmp_path / "t", corpus(lengths), [300])
    model = Recorder()
    packing = Packing("tokens", 16, separator=-1)
    data = SpiralDataModule(spec, batch_size=4, num_workers=workers, packing=packing, record=str(tmp_path / "record"))
    settings: dict[str, Any] = {"enable_progress_bar": False, "enable_model_summary": False, "logger": False}
    pl.Trainer(max_epochs=1, default_root_dir=tmp_path, **settings).fit(model, datamodule=data)
    recorded = rows(tmp_path / "record")
    assert sorted(recorded) == [step for _, step, _ in model.seen] and len(model.seen) > 10
    owner = {token: number for number, document in enumerate(documents(lengths)) for token in document}
    for _, step, ids in model.seen:
        read = {owner[token] for token in ids if token != -1}
        noted = {row for row in stored(recorded[step][0]) if lengths[row]}
        # Every document a step's blocks took tokens of, and at most one more: the one whose
        # separator alone opened the step.
        assert read <= noted and len(noted - read) <= 1, step


@pytest.mark.parametrize("workers", [0, 2])
def test_the_record_names_each_mixture_steps_table_and_rows_through_a_resume(
    make_table: Callable[..., TableSpec], tmp_path: Path, workers: int
) -> None:
    tables = [make_table([600], columns=["id", "x"]), make_table([150], seed=1, columns=["id", "x"])]
    train = [MixedTable(tables[0], 3.0), MixedTable(tables[1], 1.0)]

    def fit(root: Path, ckpt_path: Path | None) -> Recorder:
        model = Recorder()
        data = SpiralDataModule(
            train, batch_size=25, num_workers=workers, stop="cycle", table_key="table", record=str(tmp_path / "rec")
        )
        saves = ModelCheckpoint(root, "{step}", every_n_train_steps=6, save_top_k=-1)
        settings: dict[str, Any] = {"enable_progress_bar": False, "enable_model_summary": False, "logger": False}
        pl.Trainer(max_epochs=1, callbacks=[saves], default_root_dir=root, **settings).fit(
            model, datamodule=data, ckpt_path=ckpt_path
        )
        return model

    first = fit(tmp_path / "first", None)
    resumed = fit(tmp_path / "resumed", tmp_path / "first" / "step=6.ckpt")
    recorded = rows(tmp_path / "rec")
    trained = {step: ids for _, step, ids in first.seen if step < 6} | {step: ids for _, step, ids in resumed.seen}
    assert sorted(recorded) == sorted(trained) and len(trained) > 20
    for step, ids in trained.items():
        # A Recorder tells tables apart by TABLE_IDS; the record names each step's table first.
        (ranges,) = recorded[step].values()
        assert {table for table, *_ in ranges} == {ids[0] // TABLE_IDS}
        noted = sorted(TABLE_IDS * table + row for table, _, start, end in ranges for row in range(start, end))
        assert noted == sorted(ids), step


def test_a_record_in_an_object_store_reads_back_through_a_resume(
    make_table: Callable[..., TableSpec], tmp_path: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The DataModule reaches the record's store with the environment's credentials and endpoint.
    store = options(s3_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", store["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", store["aws_secret_access_key"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", store["aws_endpoint"])
    folder = f"s3://{bucket(s3_server)}/runs/record"
    spec = make_table([1000], columns=["id", "x"])
    first = fit(tmp_path / "first", spec, None, num_workers=0, record=folder)
    resumed = fit(tmp_path / "resumed", spec, tmp_path / "first" / "step=10.ckpt", num_workers=0, record=folder)
    recorded = rows(folder, storage_options=StorageOptions(store))
    trained = {step: ids for _, step, ids in first.seen if step < 10} | {step: ids for _, step, ids in resumed.seen}
    assert {step: stored(ranks[0]) for step, ranks in recorded.items()} == {
        step: sorted(ids) for step, ids in trained.items()
    }
    # One object a write: every checkpoint of both runs and the end of each fit.
    names = [info.path for info in s3_server.filesystem().get_file_info(FileSelector(folder[5:]))]
    assert len(names) > 4 and all(name.split("/")[-1].startswith("rank-0.") for name in names)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_record_names_the_rows_of_each_map_access_step_through_a_resume_in_other_batches(
    make_table: Callable[..., TableSpec], tmp_path: Path, workers: int
) -> None:
    spec = make_table([1000], columns=["id", "x"])
    first = fit(tmp_path / "first", spec, None, num_workers=workers, access="map")
    # Resumed in batches of 40: the rest of epoch 0 re-planned, then epoch 1 as the sampler deals it.
    resumed = fit(
        tmp_path / "resumed",
        spec,
        tmp_path / "first" / "step=10.ckpt",
        num_workers=workers,
        access="map",
        batch_size=40,
    )
    recorded = rows(tmp_path / "record")
    trained = {step: ids for _, step, ids in first.seen if step < 10} | {step: ids for _, step, ids in resumed.seen}
    assert {step: stored(ranks[0]) for step, ranks in recorded.items()} == {
        step: sorted(ids) for step, ids in trained.items()
    }
    # Epoch 0 read every row once: 10 batches of 50 before the stop, the other 500 after it.
    epoch_0 = [row for _, step, ids in first.seen if step < 10 for row in ids]
    epoch_0 += [row for epoch, _, ids in resumed.seen if epoch == 0 for row in ids]
    assert sorted(epoch_0) == list(range(1000))


def test_a_shuffled_steps_line_holds_its_cursors_and_reads_back_as_its_rows(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    spec = make_table([1000], columns=["id"])
    dataset = TableDataset(spec, batch_size=64, policy=Shuffled(block_rows=100, buffer_rows=256))
    record = StepRecord(tmp_path / "record", dataset, rank=0, from_step=0)
    record.begin([])
    seen = []
    for step, batch in enumerate(dataset):
        record.note(step, [dataset.state()])
        seen.append(sorted(batch["id"].tolist()))
    record.flush()
    recorded = rows(tmp_path / "record")
    assert [stored(recorded[step][0]) for step in range(len(seen))] == seen
    # One line of the consumer's list, windows and key; then each step's cursors, a few dozen bytes.
    (written,) = (tmp_path / "record").glob("*.jsonl")
    lines = written.read_text().splitlines()
    assert sum('"items"' in line for line in lines) == 1
    steps = [line for line in lines if line.startswith('{"step"')]
    assert len(steps) == len(seen) and max(map(len, steps)) < 100
    # Without its list line a step cannot be read back, and the error says where.
    written.write_text("\n".join(line for line in lines if '"items"' not in line) + "\n")
    with pytest.raises(ValueError, match=r"rank 0, line 2: step 0 names work list 0, which no line before it holds"):
        rows(tmp_path / "record")


FILTERED_LENGTHS = [int(n) for n in np.random.default_rng(8).integers(1, 40, 900)]


def filtered_dataset(spec: TableSpec, kind: str) -> Any:
    """A dataset of ``kind`` over ``spec``, keeping two rows of every three (``keep < 2``)."""
    if kind == "rows":
        return TableDataset(spec, columns=["id"], filter="keep < 2", batch_size=37)
    if kind == "windows":
        policy = Shuffled(block_rows=50, buffer_rows=128)
        return TableDataset(spec, columns=["id"], filter="keep < 2", batch_size=37, policy=policy)
    if kind == "packed":
        return PackedDataset(spec, column="tokens", length=16, batch_size=2, separator=-1, filter="keep < 2")
    return TokenBatchDataset(spec, budget=TokenBudget("tokens", max_tokens=200, window=32, pad=-1), filter="keep < 2")


FILTERED_CASES = [("rows", 2, "parquet"), ("rows", 0, "spiral"), ("windows", 0, "parquet"), ("packed", 0, "parquet")]


@pytest.mark.parametrize(("kind", "workers", "backend"), [*FILTERED_CASES, ("tokens", 0, "spiral")])
def test_the_record_of_a_filtered_table_names_the_kept_rows_each_step_read(
    tmp_path: Path, kind: str, workers: int, backend: str
) -> None:
    spec = write_table(f"{backend}:{tmp_path / 'corpus'}", corpus(FILTERED_LENGTHS), split_rows=300)
    owner = {token: number for number, document in enumerate(documents(FILTERED_LENGTHS)) for token in document}
    dataset = filtered_dataset(spec, kind)

    def delivered(batch: dict[str, Any]) -> set[int]:
        if kind in ("rows", "windows"):
            return {int(i) for i in batch["id"].tolist()}
        return {owner[int(token)] for token in batch["tokens"].flatten().tolist() if token >= 0}

    seen = noted_steps(tmp_path / "record", dataset, dataset.loader(num_workers=workers), delivered)
    recorded = rows(tmp_path / "record")
    assert sorted(recorded) == list(range(len(seen))) and len(seen) > 5
    # Row i of the table is stored row i % 300 of split i // 300.
    noted = [
        {300 * split + row for split, start, end in recorded[step][0] for row in range(start, end)} for step in recorded
    ]
    kept = {i for i in range(len(FILTERED_LENGTHS)) if i % 3 < 2}
    assert set().union(*noted) <= kept
    if kind == "packed":
        # Every document a step's blocks took tokens of, and at most one more: the one whose
        # separator alone opened the step.
        assert all(read <= step and len(step - read) <= 1 for read, step in zip(seen, noted, strict=True))
    else:
        assert noted == seen
        assert sorted(i for step in noted for i in step) == sorted(kept)


def test_the_record_of_filtered_map_access_names_the_kept_rows_of_each_step(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    # Split 0 holds ids 0-999, split 1 ids 1000-1499; the filter keeps scattered runs of both.
    spec = make_table(
        [1000, 500], columns=["id", "x"], filter="id < 150 OR id BETWEEN 700 AND 1200 OR id IN (300, 302)"
    )
    model = fit(tmp_path / "map", spec, None, access="map", num_workers=0)
    recorded = rows(tmp_path / "record")
    noted = {
        step: sorted(1000 * split + row for split, low, high in ranks[0] for row in range(low, high))
        for step, ranks in recorded.items()
    }
    assert noted == {step: sorted(ids) for _, step, ids in model.seen}
    assert sorted(i for _, step, ids in model.seen if step < len(model.seen) // 2 for i in ids) == [
        *range(150),
        300,
        302,
        *range(700, 1201),
    ]


@pytest.mark.parametrize(
    ("windows", "filtered", "workers"),
    # Windows(4, stride=17): a split's 12 windows are 4 batches, and the next window would start past its end.
    [(Windows(5, stride=3, group_by="episode"), True, 2), (Windows(4, stride=17), False, 0), (Windows(3), True, 0)],
)
def test_the_record_of_windows_names_the_rows_of_each_steps_windows_through_a_resume(
    tmp_path: Path, windows: Windows, filtered: bool, workers: int
) -> None:
    ids = np.arange(600)
    table = pa.table({"id": ids, "episode": ids // 37, "keep": ids % 5})
    spec = write_table(f"spiral:{tmp_path / 'episodes'}", table, split_rows=200)
    options: dict[str, Any] = {"columns": ["id", "episode"], "filter": "keep != 3" if filtered else None}

    def loader() -> Any:
        dataset = WindowDataset(TableSpec(spec.uri, **options), windows=windows, batch_size=3, policy="balanced")
        return dataset, dataset.loader(num_workers=workers)

    def read(record: StepRecord, loader: Any, steps: range) -> list[set[int]]:
        seen = []
        for step, batch in zip(steps, loader, strict=False):
            record.note(step, consumer_states(loader.state_dict()))
            seen.append({int(i) for i in batch["id"].flatten().tolist()})
        record.flush()
        return seen

    dataset, first = loader()
    record = StepRecord(tmp_path / "record", dataset, rank=0, from_step=0)
    record.begin([])
    seen = read(record, first, range(5))
    state = first.state_dict()
    del first
    dataset, resumed = loader()
    resumed.load_state_dict(state)
    record = StepRecord(tmp_path / "record", dataset, rank=0, from_step=5)
    record.begin(consumer_states(state))
    seen += read(record, resumed, range(5, 10_000))
    recorded = rows(tmp_path / "record")
    assert sorted(recorded) == list(range(len(seen))) and len(seen) > 10
    # Row i of the table is stored row i % 200 of split i // 200.
    noted = [
        {200 * split + row for split, low, high in recorded[step][0] for row in range(low, high)} for step in recorded
    ]
    assert noted == seen


def test_the_record_of_a_mixture_of_filtered_tables_names_each_tables_kept_rows(tmp_path: Path) -> None:
    ids = np.arange(300)
    first = write_table(f"parquet:{tmp_path / 'a'}", pa.table({"id": ids, "k": ids % 3}), split_rows=100)
    second = write_table(
        f"spiral:{tmp_path / 'b'}", pa.table({"id": 1000 + ids[:200], "k": ids[:200] % 2}), split_rows=50
    )
    tables = [(TableSpec(first.uri, filter="k != 0"), 1.0), (TableSpec(second.uri, filter="k = 1"), 1.0)]
    mixture = Mixture(tables, batch_size=16, table_key="table")
    seen = noted_steps(
        tmp_path / "record", mixture, mixture.loader(num_workers=0), lambda batch: sorted(batch["id"].tolist())
    )
    recorded = rows(tmp_path / "record")
    # Table 0's split s holds ids 100 s.., table 1's ids 1000 + 50 s..
    split_rows, base = (100, 50), (0, 1000)
    noted = [
        sorted(
            base[table] + split_rows[table] * split + row
            for table, split, low, high in ranks[0]
            for row in range(low, high)
        )
        for ranks in recorded.values()
    ]
    assert noted == seen and len(seen) > 10


@examples(20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    size=st.integers(1, 6),
    stride=st.integers(1, 9),
    batch_size=st.integers(1, 5),
    episode=st.integers(3, 40),
    drop=st.sets(st.integers(0, 239), max_size=60),
    group=st.booleans(),
)
def test_every_windows_step_notes_the_rows_of_its_windows(
    tmp_path: Path, size: int, stride: int, batch_size: int, episode: int, drop: set[int], group: bool
) -> None:
    folder = tmp_path / f"t{size}-{stride}-{batch_size}-{episode}-{len(drop)}-{group}-{hash(frozenset(drop))}"
    ids = np.arange(240)
    table = pa.table({"id": ids, "episode": ids // episode})
    spec = write_table(f"parquet:{folder / 'table'}", table, split_rows=70)
    kept = f"id NOT IN ({', '.join(map(str, sorted(drop)))})" if drop else None
    windows = Windows(size, stride=stride, group_by="episode" if group else None)
    dataset = WindowDataset(TableSpec(spec.uri, filter=kept), windows=windows, batch_size=batch_size, policy="balanced")
    record = StepRecord(folder / "record", dataset, rank=0, from_step=0)
    record.begin([])
    seen = []
    for step, batch in enumerate(dataset):
        record.note(step, [dataset.state_dict()])
        seen.append({int(i) for i in batch["id"].flatten().tolist()})
    record.flush()
    recorded = rows(folder / "record")
    # Row i of the table is stored row i % 70 of split i // 70.
    noted = [
        {70 * split + row for split, low, high in ranks[0] for row in range(low, high)} for ranks in recorded.values()
    ]
    assert noted == seen and len(seen) == dataset.batches(0)
