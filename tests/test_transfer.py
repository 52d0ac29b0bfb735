"""Batches leave DataLoader workers as one shared-memory block: same values, one storage."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest
import torch
import torch.multiprocessing
from torch.utils.data import DataLoader

from spiral_lightning import TableDataset, TableMapDataset, TableSpec, send_by_name, to_torch
from spiral_lightning.reading.transfer import handed_on, one_block
from tests.tables import BACKENDS


def storage_of(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def test_one_block_keeps_every_value_and_shares_one_storage() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    repeated = torch.tensor([7, 8], dtype=torch.int16)
    batch = {
        "id": torch.arange(5, dtype=torch.int64),
        "x": torch.linspace(0, 1, 5),
        "flag": torch.tensor([True, False, True, True, False]),
        "iq": torch.randn(5, 3, dtype=torch.complex64),
        "permuted": base.permute(2, 0, 1),
        "empty": torch.zeros(0, 4, dtype=torch.float64),
        "ragged": [torch.ones(2, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8), None],
        "same": [repeated, repeated],
        "name": ["a", "b", "c", "d", "e"],
    }
    moved = one_block(batch)
    assert list(moved) == list(batch)
    tensors = [value for value in moved.values() if isinstance(value, torch.Tensor)]
    tensors += [*moved["ragged"][:2], *moved["same"]]
    for name, value in batch.items():
        if isinstance(value, torch.Tensor):
            assert moved[name].dtype == value.dtype and moved[name].shape == value.shape
            assert torch.equal(moved[name], value), name
    assert [torch.equal(a, b) for a, b in zip(moved["ragged"][:2], batch["ragged"][:2], strict=True)] == [True, True]
    assert moved["ragged"][2] is None and moved["name"] == batch["name"]
    # A tensor listed twice stays one tensor, copied once.
    assert moved["same"][0] is moved["same"][1] and torch.equal(moved["same"][0], repeated)
    assert len({storage_of(tensor) for tensor in tensors}) == 1
    assert tensors[0].untyped_storage().is_shared()
    # Every view starts on a 64-byte boundary, so any dtype lines up.
    assert all((tensor.data_ptr() - storage_of(tensor)) % 64 == 0 for tensor in tensors)
    # The originals are untouched by writes to the copies.
    moved["id"].add_(100)
    assert batch["id"].tolist() == [0, 1, 2, 3, 4]


def test_batches_with_one_tensor_or_no_mapping_stay_as_they_are() -> None:
    single = {"id": torch.arange(3), "name": ["a", "b", "c"]}
    assert one_block(single) is single
    rows = [torch.arange(3), torch.arange(3)]
    assert one_block(rows) is rows
    # In the main process nothing moves: the batch never leaves it.
    batch = {"id": torch.arange(3), "x": torch.ones(3)}
    assert handed_on(batch) is batch


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_worker_batches_arrive_in_one_block_with_the_rows(make_table: Callable[..., TableSpec], backend: str) -> None:
    spec = make_table([120, 80, 200], seed=3, backend=backend)
    dataset = TableDataset(spec, batch_size=32)
    expected = sorted(int(row) for batch in dataset for row in batch["id"])
    loader = DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="forkserver")
    seen = []
    for batch in loader:
        assert len({storage_of(batch[name]) for name in ("id", "score", "x", "v")}) == 1
        assert batch["v"].shape == (batch["id"].shape[0], 4)
        # The rows' values still belong to their ids (x = id / 2, v = 4 * id .. 4 * id + 3).
        assert torch.equal(batch["x"], batch["id"].to(torch.float32) / 2)
        assert torch.equal(batch["v"][:, 0], batch["id"].to(torch.float32) * 4)
        seen += batch["id"].tolist()
    assert sorted(seen) == expected == list(range(400))


def with_strategy(batch: pa.RecordBatch) -> dict[str, Any]:
    """``to_torch`` of the batch, with the sharing strategy of the process that collated it."""
    return {**to_torch(batch), "strategy": torch.multiprocessing.get_sharing_strategy()}


def row_with_strategy(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "strategy": torch.multiprocessing.get_sharing_strategy()}


@pytest.mark.slow
def test_send_by_name_makes_workers_name_their_blocks_and_nothing_else_changes(
    make_table: Callable[..., TableSpec],
) -> None:
    # By name the main process maps each block itself instead of fetching a descriptor over a
    # connection to the worker per batch. Only workers given send_by_name change strategy.
    spec = make_table([120, 80, 200], seed=3)
    before = torch.multiprocessing.get_sharing_strategy()
    dataset = TableDataset(spec, batch_size=32, collate=with_strategy)
    for init, strategy in [(send_by_name, "file_system"), (None, before)]:
        loader = DataLoader(
            dataset, batch_size=None, num_workers=2, multiprocessing_context="forkserver", worker_init_fn=init
        )
        batches = list(loader)
        assert {batch["strategy"] for batch in batches} == {strategy}
        assert sorted(int(row) for batch in batches for row in batch["id"]) == list(range(400))
    rows = TableMapDataset(spec, transform=row_with_strategy)
    mapped = DataLoader(
        rows,
        batch_size=50,
        shuffle=True,
        num_workers=2,
        multiprocessing_context="forkserver",
        worker_init_fn=send_by_name,
    )
    batches = list(mapped)
    assert {strategy for batch in batches for strategy in batch["strategy"]} == {"file_system"}
    assert sorted(int(row) for batch in batches for row in batch["id"]) == list(range(400))
    assert torch.multiprocessing.get_sharing_strategy() == before
