"""Object-store outages in the middle of an epoch: a real S3 server (SeaweedFS) behind a proxy that
goes down, stalls, answers 503s or resets connections, read in process and by two DataLoader
workers. Every row comes exactly once (ids compared, values checked against each id), and an
outage longer than the storage option ``retry_seconds`` fails naming the object and the time."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spiral_lightning import TableDataset, TableSpec
from spiral_lightning.core.storage import StorageOptions
from spiral_lightning.sources.retry import RETRY_SECONDS, StoreUnavailable, passing, retry_seconds
from tests.objectstore import FaultProxy, S3Server

#: Three files of 20 row groups of 500 rows: a pass opens a file (a HEAD) in the middle of the epoch too.
FILES, GROUPS, GROUP_ROWS = 3, 20, 500
ROWS = FILES * GROUPS * GROUP_ROWS
_buckets = itertools.count()


def values(ids: np.ndarray) -> np.ndarray:
    return (ids.astype(np.float32) / 7).astype(np.float32)


@pytest.fixture(scope="module")
def table(s3_server: S3Server) -> str:
    """The uri of ``ROWS`` rows (``id``, ``x``) in ``FILES`` Parquet files of a bucket of its own."""
    name = f"outages-{os.getpid()}-{next(_buckets)}"
    s3_server.make_bucket(name)
    for file in range(FILES):
        ids = np.arange(file * GROUPS * GROUP_ROWS, (file + 1) * GROUPS * GROUP_ROWS, dtype=np.int64)
        data = pa.table({"id": ids, "x": values(ids)})
        path = f"{name}/t/part-{file}.parquet"
        pq.write_table(data, path, filesystem=s3_server.filesystem(), row_group_size=GROUP_ROWS)
    return f"parquet:s3://{name}/t"


def spec(server: S3Server, uri: str, proxy: FaultProxy, **options: Any) -> TableSpec:
    store = {
        "aws_endpoint": proxy.endpoint,
        "allow_http": True,
        "aws_access_key_id": server.access_key,
        "aws_secret_access_key": server.secret_key,
        **options,
    }
    # One row group fetched ahead: most of the epoch's requests are still to come when the fault starts.
    return TableSpec(uri, storage_options=store, prefetch=1)


def dataset(server: S3Server, uri: str, proxy: FaultProxy, **options: Any) -> TableDataset:
    # Read in line: reading threads may hold AHEAD_BYTES each, more than this whole table, so the
    # fault could start after the last read and the test would not show the reads riding it out.
    return TableDataset(spec(server, uri, proxy, **options), batch_size=GROUP_ROWS, read_ahead=0)


def batches(data: TableDataset, workers: int) -> Iterable[dict[str, Any]]:
    # Batch by batch (group=1): in groups each worker would have read its whole share before the fault.
    return data.loader(num_workers=workers, group=1) if workers else data


def epoch(rows: Iterable[dict[str, Any]], fault: Callable[[], None], after: int = 2) -> tuple[list[int], float]:
    """The ids of an epoch, with ``fault()`` started after batch ``after``; each batch's values are
    checked against its ids. Also the seconds from the fault to the end of the epoch."""
    ids: list[int] = []
    started = time.monotonic()
    for number, batch in enumerate(rows):
        got = batch["id"].numpy()
        assert np.array_equal(batch["x"].numpy(), values(got)), "a row came back with another row's values"
        ids += got.tolist()
        if number == after:
            started = time.monotonic()
            fault()
    return ids, time.monotonic() - started


def exactly_once(ids: list[int]) -> None:
    assert len(ids) == ROWS and sorted(ids) == list(range(ROWS))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_store_down_for_3_s_mid_epoch_loses_and_repeats_no_row(s3_server: S3Server, table: str, workers: int) -> None:
    with FaultProxy(s3_server.host, s3_server.port) as proxy:
        ids, waited = epoch(batches(dataset(s3_server, table, proxy), workers), lambda: proxy.down(3))
    exactly_once(ids)
    # The epoch waited the outage out: the reads were in the middle of it, not before.
    assert waited >= 2.5


def test_bursts_of_503s_and_resets_on_opening_and_mid_epoch_are_ridden_out(s3_server: S3Server, table: str) -> None:
    with FaultProxy(s3_server.host, s3_server.port) as proxy:
        # Pinned here, then the table is opened (a listing, every footer, a file's check) against
        # a burst of 6 503s (the store client makes 3 attempts a try: 2 failed tries), whenever the
        # workers get to it, and the workers meet 3 s of reset connections mid-epoch.
        loader = batches(dataset(s3_server, table, proxy), 2)
        proxy.fail(503, count=6, methods=("GET", "HEAD"))
        ids, _ = epoch(loader, lambda: proxy.reset(seconds=3, methods=("GET", "HEAD")))
        assert proxy.faults["status"] == 6 and proxy.faults["reset"] > 0
    exactly_once(ids)


def test_a_store_that_stops_answering_times_out_and_is_retried(s3_server: S3Server, table: str) -> None:
    with FaultProxy(s3_server.host, s3_server.port) as proxy:
        # timeout=1: a request gives up after 1 s without a byte, the store client's 3 attempts within 4 s.
        ids, waited = epoch(dataset(s3_server, table, proxy, timeout=1), lambda: proxy.stall(6))
    exactly_once(ids)
    assert waited >= 5.5


def test_an_outage_longer_than_retry_seconds_fails_naming_the_object_and_resumes_exactly(
    s3_server: S3Server, table: str
) -> None:
    with FaultProxy(s3_server.host, s3_server.port) as proxy:
        loader = dataset(s3_server, table, proxy, retry_seconds=1).loader()
        ids: list[int] = []
        state = loader.state_dict()
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as raised:
            for number, batch in enumerate(loader):
                ids += batch["id"].tolist()
                state = loader.state_dict()
                if number == 2:
                    started = time.monotonic()
                    proxy.down(6)
        assert time.monotonic() - started < 6
        said = str(raised.value)
        assert f"{table}" in said and "retry_seconds=1)" in said
        assert "did not serve" in said and ".parquet'" in said and "Could not connect" in said
        assert isinstance(raised.value, ConnectionError)
        time.sleep(max(0.0, 6.5 - (time.monotonic() - started)))
        resumed = dataset(s3_server, table, proxy, retry_seconds=1).loader()
        resumed.load_state_dict(state)
        ids += [i for batch in resumed for i in batch["id"].tolist()]
    exactly_once(ids)


def test_an_outage_longer_than_retry_seconds_fails_clearly_through_workers(s3_server: S3Server, table: str) -> None:
    with FaultProxy(s3_server.host, s3_server.port) as proxy:
        loader = batches(dataset(s3_server, table, proxy, retry_seconds=1), 2)
        said = r"did not serve .* over [\d.]+ s \(storage option retry_seconds=1\)"
        with pytest.raises(StoreUnavailable, match=said):
            epoch(loader, lambda: proxy.down(8))


def test_pinning_rides_out_a_store_down_as_the_job_starts_and_fails_clearly_past_retry_seconds(
    s3_server: S3Server, table: str
) -> None:
    with FaultProxy(s3_server.host, s3_server.port) as proxy:
        proxy.down(3)
        started = time.monotonic()
        pinned = spec(s3_server, table, proxy).resolve()
        assert time.monotonic() - started >= 2.5
        assert [file.row_groups for file in pinned.files or ()] == [(GROUP_ROWS,) * GROUPS] * FILES
        # The footers' requests too: each file is opened (a HEAD) after the listing, and refused for 2 s.
        proxy.fail(503, seconds=2, methods=("HEAD",))
        assert spec(s3_server, table, proxy).resolve().files == pinned.files
        assert proxy.faults["status"] > 0
        proxy.down(6)
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as raised:
            spec(s3_server, table, proxy, retry_seconds=1).resolve()
        assert time.monotonic() - started < 6
    said = str(raised.value)
    assert f"the object store of {table!r} did not serve the listing" in said and "retry_seconds=1)" in said, said
    assert "cannot reach the object store" in said and "check the endpoint" in said


@pytest.mark.slow
def test_a_store_down_for_20_s_mid_epoch_is_ridden_out_by_workers_within_the_default_budget(
    s3_server: S3Server, table: str
) -> None:
    assert RETRY_SECONDS >= 30
    with FaultProxy(s3_server.host, s3_server.port) as proxy:
        ids, waited = epoch(batches(dataset(s3_server, table, proxy), 2), lambda: proxy.down(20))
    exactly_once(ids)
    assert waited >= 19


def test_which_failures_are_retried_and_the_budget_option() -> None:
    assert passing(OSError("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 7, Could not connect"))
    assert passing(OSError("AWS Error SLOW_DOWN during GetObject operation: Please reduce your request rate."))
    assert passing(OSError("AWS Error UNKNOWN (HTTP status 503) during HeadObject operation: No response body."))
    assert passing(OSError("google::cloud::Status(UNAVAILABLE: connection reset)"))
    assert not passing(OSError("AWS Error ACCESS_DENIED during GetObject operation: Access Denied"))
    assert not passing(OSError("AWS Error UNKNOWN (HTTP status 416) during GetObject operation: InvalidRange"))
    assert not passing(PermissionError("the object store refused ... network"))
    assert not passing(StoreUnavailable("did not serve ... timeout"))
    assert not passing(ValueError("connect"))
    assert retry_seconds(None) == RETRY_SECONDS == retry_seconds(StorageOptions({"aws_region": "x"}))
    assert retry_seconds(StorageOptions({"retry_seconds": 0})) == 0
    for wrong in (-1, "soon", "inf"):
        with pytest.raises(ValueError, match="retry_seconds"):
            retry_seconds(StorageOptions({"retry_seconds": wrong}))
