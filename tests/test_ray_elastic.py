"""Ray Train loader states re-planned for another world size, worker count or batch size: the rank files
``save_loader_state`` wrote restore into loaders of another topology with every row once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

from ray_adapter import restore_loader_state, save_loader_state
from spiral_lightning import TableDataset, TableSpec
from tests.tables import KEEP_TEXT, kept_ids

SIZES = [3000, 700, 0, 4100, 2500, 1800]


def loader(spec: TableSpec, rank: int, world_size: int, workers: int, batch_size: int = 300) -> StatefulDataLoader:
    dataset = TableDataset(spec, batch_size=batch_size, rank=rank, world_size=world_size)
    context = "forkserver" if workers else None
    return StatefulDataLoader(dataset, batch_size=None, num_workers=workers, multiprocessing_context=context)


def ids(batches: list[dict[str, Any]]) -> list[int]:
    return [row for batch in batches for row in batch["id"].tolist()]


@pytest.mark.slow
def test_rank_files_of_two_ranks_resume_as_three(make_table: Callable[..., TableSpec], tmp_path: Path) -> None:
    spec = make_table(SIZES, seed=4, columns=["id"], filter=KEEP_TEXT)
    delivered: list[int] = []
    for rank, stop in ((0, 6), (1, 1)):
        saving = loader(spec, rank, 2, 1)
        reading = iter(saving)
        delivered += ids([next(reading) for _ in range(stop)])
        save_loader_state(saving, tmp_path)
    for rank in range(3):
        resumed = loader(spec, rank, 3, 0)
        restore_loader_state(resumed, tmp_path)
        delivered += ids(list(resumed))
    assert sorted(delivered) == kept_ids(SIZES, seed=4)


def test_rank_files_resume_in_batches_of_another_size(make_table: Callable[..., TableSpec], tmp_path: Path) -> None:
    spec = make_table(SIZES, seed=4, columns=["id"])
    delivered: list[int] = []
    for rank in range(2):
        saving = loader(spec, rank, 2, 0)
        reading = iter(saving)
        delivered += ids([next(reading) for _ in range(4)])
        save_loader_state(saving, tmp_path)
    for rank in range(2):
        resumed = loader(spec, rank, 2, 0, batch_size=450)
        restore_loader_state(resumed, tmp_path)
        batches = list(resumed)
        assert max(len(batch["id"]) for batch in batches) == 450
        delivered += ids(batches)
    assert sorted(delivered) == list(range(sum(SIZES)))
