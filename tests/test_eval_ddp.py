"""Validation, test and predict under DDP: every rank yields the same batches, each row of the
table once over the ranks, the ranks with fewer batches ending with padding batches whose rows the
``valid`` mask marks False; a table with fewer rows than ranks; a per-step ``sync_dist`` log."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from spiral_lightning import Shard, SpiralDataModule, SpiralLoader, TableDataset, TableSpec, write_table
from spiral_lightning.lightning.padding import VALID, WithValid, padding_batch, padding_note
from tests import eval_ddp_job
from tests.ranks import torchrun
from tests.tables import KEEP_TEXT, kept_ids

ROOT = Path(__file__).resolve().parent.parent
BATCH = 64
#: 1025 rows: on 2 ranks of 2 workers one consumer reads 257 rows, the others 256, so rank 0
#: reads 9 batches of ``BATCH`` and rank 1 reads 8.
SIZES = [300, 40, 500, 185]


def rank_ids(spec: TableSpec, rank: int, world_size: int, workers: int) -> list[int]:
    """The ids of the rows the ``balanced`` work lists of ``rank``'s consumers return, read
    straight from the source, in consumer order."""
    dataset = TableDataset(spec, policy="balanced", rank=rank, world_size=world_size)
    return [
        int(row)
        for worker in range(max(1, workers))
        for batch, _, _ in dataset.source().read(dataset.work(Shard(rank, world_size, worker, max(1, workers))))
        for row in batch.column("id").to_pylist()
    ]


def eval_dataset(spec: TableSpec, rank: int, world_size: int) -> TableDataset:
    """``rank``'s dataset of an evaluation stage, as ``SpiralDataModule.setup`` builds it."""
    return TableDataset(
        spec, batch_size=BATCH, policy="balanced", rank=rank, world_size=world_size, transform=WithValid(None)
    )


def read_padded(spec: TableSpec, world_size: int, workers: int) -> list[list[dict[str, Any]]]:
    """Every rank's batches through a ``SpiralLoader`` padded to the batches of the rank with the
    most, as ``SpiralDataModule`` gives an evaluation stage under DDP, read rank after rank."""
    datasets = [eval_dataset(spec, rank, world_size) for rank in range(world_size)]
    most = max(dataset.batches(workers) for dataset in datasets)
    context = "forkserver" if workers else None
    return [
        list(
            SpiralLoader(
                dataset,
                batches=most,
                pad=padding_batch(dataset, "val"),
                num_workers=workers,
                multiprocessing_context=context,
            )
        )
        for dataset in datasets
    ]


def split(batches: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """The ids of the valid rows of ``batches``, and how many rows each batch marks padding."""
    valid = [i for batch in batches for i in batch["id"][batch[VALID]].tolist()]
    return valid, [int((~batch[VALID]).sum()) for batch in batches]


@pytest.mark.parametrize(
    ("sizes", "world_size", "workers", "backend"),
    [
        (SIZES, 2, 2, "spiral"),
        ([300, 40, 500, 121], 3, 0, "parquet"),
        ([1], 3, 2, "spiral"),
        ([1], 2, 3, "parquet"),
    ],
)
def test_padded_ranks_yield_equal_batches_and_every_row_once(
    make_table: Callable[..., TableSpec], sizes: list[int], world_size: int, workers: int, backend: str
) -> None:
    spec = make_table(sizes, backend=backend, columns=["id", "x"])
    ranks = read_padded(spec, world_size, workers)
    own = [eval_dataset(spec, rank, world_size).batches(workers) for rank in range(world_size)]
    # Some rank pads in every case here, one of them without a row of its own in the tiny tables.
    assert min(own) < max(own)
    seen = []
    for rank, batches in enumerate(ranks):
        assert len(batches) == max(own)
        valid, padding = split(batches)
        assert sorted(valid) == sorted(rank_ids(spec, rank, world_size, workers))
        # The rank's own batches keep every row; the padding batches after them mark none valid.
        assert padding == [0] * own[rank] + [len(batch["id"]) for batch in batches[own[rank] :]]
        assert all(len(batch["id"]) > 0 for batch in batches[own[rank] :])
        seen += valid
    assert sorted(seen) == list(range(sum(sizes)))


def test_one_rank_reads_every_row_marked_valid(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([100, 30], columns=["id", "x"])
    data = SpiralDataModule(val=spec.uri, test=spec.uri, batch_size=BATCH, columns=["id", "x"])
    data.setup("validate")
    batches = list(data.val_dataloader())
    assert [len(batch["id"]) for batch in batches] == [64, 64, 2]
    assert all(bool(batch[VALID].all()) for batch in batches)
    assert sorted(i for batch in batches for i in batch["id"].tolist()) == list(range(130))


def test_a_column_named_like_the_mask_is_refused(tmp_path: Path) -> None:
    uri = f"parquet:{tmp_path / 'flags'}"
    write_table(uri, pa.table({"id": range(10), VALID: [True] * 10}), split_rows=5)
    data = SpiralDataModule(val=uri, batch_size=4)
    with pytest.raises(ValueError, match=r"val table .* has a column named 'valid'.*columns=\[\.\.\.\]"):
        data.setup("validate")
    # Selecting the other columns reads it, and training reads the column as it is.
    SpiralDataModule(val=uri, batch_size=4, columns=["id"]).setup("validate")
    SpiralDataModule(train=uri, batch_size=4).setup("fit")


def test_a_transform_that_drops_the_mask_is_refused_before_padding(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([10], columns=["id", "x"])
    dataset = TableDataset(spec, batch_size=4, rank=1, world_size=2, transform=WithValid(_drop_valid))
    with pytest.raises(ValueError, match=r"transform of the val table .* without its 'valid' mask.*even_batches=False"):
        padding_batch(dataset, "val")


def _drop_valid(batch: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in batch.items() if name != VALID}


def run_job(out: Path, *args: str) -> tuple[list[dict[str, Any]], str]:
    """Each rank's record of ``eval_ddp_job`` run with ``args``, and what the job printed."""
    printed = torchrun(eval_ddp_job.main, ["--out", str(out), "--batch-size", str(BATCH), *args], 2, out)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)], printed


def test_the_padding_note_counts_every_padding_batch() -> None:
    assert padding_note("val", [9, 8, 7]) == (
        "val yields 9 batches on each of 3 ranks, 3 of all of them padding batches ('valid' False on every row) "
        "for the ranks with fewer rows"
    )


@pytest.mark.slow
def test_ddp_evaluation_pads_ranks_to_equal_batches_and_syncs_every_step(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    train = make_table([64, 64])
    val = make_table(SIZES)
    # One row for two ranks of two workers each: rank 1 reads no row at all.
    test = make_table([1], backend="parquet")
    predict = make_table(SIZES, seed=3)
    filtered = TableSpec(predict.uri, filter=KEEP_TEXT)
    records, printed = run_job(
        tmp_path,
        *("--train", train.uri, "--val", val.uri, "--test", test.uri),
        *("--predict", predict.uri, "--predict-filter", KEEP_TEXT),
    )
    stages = {"val": (val, list(range(sum(SIZES)))), "test": (test, [0]), "predict": (filtered, kept_ids(SIZES, 3))}
    for stage, (spec, every) in stages.items():
        own = [TableDataset(spec, batch_size=BATCH, policy="balanced", rank=r, world_size=2).batches(2) for r in (0, 1)]
        # One rank pads in every stage: val by a batch, test wholly, predict under an uneven filter.
        assert min(own) < max(own), stage
        seen = []
        for rank, record in enumerate(records):
            steps = record["steps"][stage]
            assert len(steps) == max(own), (stage, rank)
            valid = [i for ids, _ in steps for i in ids]
            assert sorted(valid) == sorted(rank_ids(spec, rank, 2, 2)), (stage, rank)
            # Padding batches come after the rank's own batches and carry no valid row.
            assert [bool(padding) for _, padding in steps] == [False] * own[rank] + [True] * (max(own) - own[rank])
            assert all(not ids for ids, _ in steps[own[rank] :])
            seen += valid
        assert sorted(seen) == every, stage
    assert [len(record["steps"]["val"]) for record in records] == [9, 9]
    assert [len(record["steps"]["test"]) for record in records] == [1, 1]
    assert printed.count(padding_note("val", [9, 8])) == 1
    assert printed.count(padding_note("test", [1, 0])) == 1
    # The per-step logs, summed over steps and synced over ranks, count each row once, padding never.
    for record in records:
        assert record["val_rows"] == sum(SIZES)
        assert record["test_rows"] == 1
        predicted = [i for ids, valid in record["predicted"] for i, keep in zip(ids, valid, strict=True) if keep]
        assert predicted == [i for ids, _ in record["steps"]["predict"] for i in ids]
