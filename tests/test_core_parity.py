"""Reference parity: with the default policy, TableDataset delivers exactly what spiral-sdk's own
ScanDataset delivers on the same table: the same rows, order and batch boundaries per consumer."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest
import spiral
import torch
from spiral.torch import ScanDataset
from torch.utils.data import DataLoader

from spiral_lightning import TableDataset, TableSpec
from tests.tables import KEEP

SPLITS = [700, 1, 2500, 0, 1300, 999, 4000]


def sdk_request(spec: TableSpec) -> spiral.ScanRequest:
    resource_id, version_id = spec.version.split("@")
    root = spec.uri.split(":", 1)[1].split("?", 1)[0]
    table = spiral.Client.local().local_table(root, resource_id, version_id)
    return table.scan_request(spec.columns, filter=spec.filter)


def outcome(batches: Iterable[dict[str, Any]]) -> tuple[list[list[int]], list[torch.Tensor], str | None]:
    """Each batch's ids and vectors, and the error that ended the iteration, if any."""
    ids: list[list[int]] = []
    vectors: list[torch.Tensor] = []
    try:
        for batch in batches:
            ids.append(batch["id"].tolist())
            vectors.append(batch["v"].clone())
    except ValueError as error:
        return ids, vectors, str(error).split(" ", 1)[0]
    return ids, vectors, None


def assert_same(ours: Iterable[dict[str, Any]], theirs: Iterable[dict[str, Any]]) -> None:
    our_ids, our_vectors, our_error = outcome(ours)
    their_ids, their_vectors, their_error = outcome(theirs)
    assert our_ids == their_ids
    assert all(torch.equal(a, b) for a, b in zip(our_vectors, their_vectors, strict=True))
    assert our_error == their_error


@pytest.mark.parametrize("filtered", [False, True])
@pytest.mark.parametrize("last", ["keep_partial", "require_full"])
@pytest.mark.parametrize("batch_size", [None, 1, 64, 1000, 5000])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_in_process_consumers_match_scan_dataset(
    make_table: Callable[..., TableSpec], world_size: int, batch_size: int | None, last: str, filtered: bool
) -> None:
    spec = make_table(SPLITS, seed=3, columns=["id", "v"], filter=KEEP if filtered else None)
    request = sdk_request(spec)
    for rank in range(world_size):
        options: dict[str, Any] = {"batch_size": batch_size, "last": last, "rank": rank, "world_size": world_size}
        assert_same(TableDataset(spec, policy="stripe", **options), ScanDataset(request, **options))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world_size", "rank", "workers", "batch_size"),
    [(1, 0, 2, 100), (2, 1, 3, None), (3, 0, 1, 333), (1, 0, 3, 1000)],
)
def test_dataloader_workers_match_scan_dataset(
    make_table: Callable[..., TableSpec], world_size: int, rank: int, workers: int, batch_size: int | None
) -> None:
    """Through real worker processes the interleaved batches agree, so each worker's do."""
    spec = make_table(SPLITS, seed=5, columns=["id", "v"], filter=KEEP)
    options: dict[str, Any] = {"batch_size": batch_size, "rank": rank, "world_size": world_size}

    def loader(dataset: Any) -> DataLoader[Any]:
        return DataLoader(dataset, batch_size=None, num_workers=workers, multiprocessing_context="forkserver")

    assert_same(
        loader(TableDataset(spec, policy="stripe", **options)), loader(ScanDataset(sdk_request(spec), **options))
    )
