"""Parquet tables in an object store: a real S3 server (SeaweedFS on 127.0.0.1) read by real
DataLoader workers, a Lightning Trainer and LightningCLI, with requests counted by a TCP proxy."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torchdata.stateful_dataloader import StatefulDataLoader

from spiral_lightning import (
    SpiralDataModule,
    TableDataset,
    TableMapDataset,
    TableSpec,
    WindowDataset,
    Windows,
    write_table,
)
from spiral_lightning.core.plan import fingerprint
from spiral_lightning.core.storage import StorageOptions
from spiral_lightning.demos.data import demo_data
from spiral_lightning.lightning.cli import main
from spiral_lightning.sources.stores import locate
from tests.lightning_job import Recorder
from tests.loaders import stopped_and_resumed
from tests.objectstore import LatencyProxy, S3Server, free_ports

#: Row groups of the three files of ``uneven``: 2,000 rows in all.
FILES = [[300, 40, 500], [160], [700, 300]]
TOTAL = sum(itertools.chain.from_iterable(FILES))
_buckets = itertools.count()


def options(server: S3Server, endpoint: str | None = None, **more: Any) -> dict[str, Any]:
    return {
        "aws_endpoint": endpoint or server.endpoint,
        "allow_http": True,
        "aws_access_key_id": server.access_key,
        "aws_secret_access_key": server.secret_key,
        **more,
    }


def bucket(server: S3Server) -> str:
    """A new bucket of this test's own."""
    name = f"test-{os.getpid()}-{next(_buckets)}"
    server.make_bucket(name)
    return name


def numbers(start: int, count: int) -> pa.Table:
    ids = np.arange(start, start + count, dtype=np.int64)
    return pa.table({"id": ids, "x": ids.astype(np.float32) / 7, "v": np.repeat(ids, 1).astype(np.float64)})


def uneven(server: S3Server) -> str:
    """A uri of three Parquet files of uneven row groups in a new bucket, ids 0..TOTAL in order."""
    name = bucket(server)
    filesystem = server.filesystem()
    start = 0
    for index, groups in enumerate(FILES):
        writer = pq.ParquetWriter(f"{name}/t/part-{index}.parquet", numbers(0, 1).schema, filesystem=filesystem)
        for rows in groups:
            writer.write_table(numbers(start, rows))
            start += rows
        writer.close()
    return f"parquet:s3://{name}/t"


def proxy_to(server: S3Server) -> LatencyProxy:
    return LatencyProxy(server.host, server.port, delay=0.0)


def ids(batches: Any) -> list[int]:
    return [int(i) for batch in batches for i in batch["id"]]


def test_every_kind_takes_the_uri_and_storage_options_without_a_spec(s3_server: S3Server) -> None:
    uri, store = uneven(s3_server), options(s3_server)
    everything = list(range(TOTAL))
    assert sorted(ids(TableDataset(uri, batch_size=500, storage_options=store))) == everything
    windows = WindowDataset(uri, windows=Windows(1), batch_size=500, storage_options=store, columns=["id"])
    assert sorted(int(i) for batch in windows for i in batch["id"][:, 0]) == everything
    rows = TableMapDataset(uri, storage_options=store, columns=["id"])
    assert len(rows) == TOTAL and int(rows[TOTAL - 1]["id"]) == TOTAL - 1


@pytest.mark.slow
def test_ranks_and_workers_read_every_row_once_and_resume_mid_epoch(s3_server: S3Server) -> None:
    spec = TableSpec(uneven(s3_server), storage_options=options(s3_server))

    def loader(rank: int) -> StatefulDataLoader:
        dataset = TableDataset(spec, batch_size=64, rank=rank, world_size=2)
        return StatefulDataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="forkserver")

    per_rank = [ids(loader(rank)) for rank in range(2)]
    assert sorted(per_rank[0] + per_rank[1]) == list(range(TOTAL))
    assert not set(per_rank[0]) & set(per_rank[1])

    before, after = stopped_and_resumed(lambda: loader(1), stop=3)
    assert len(before) == 3
    assert sorted(ids(before) + ids(after)) == sorted(per_rank[1])


def test_write_table_round_trips_and_a_pass_makes_a_request_per_row_group_and_file(s3_server: S3Server) -> None:
    name = bucket(s3_server)
    written = write_table(
        f"parquet:s3://{name}/t", numbers(0, 5000), split_rows=1000, storage_options=options(s3_server)
    )
    assert [file.row_groups for file in written.files or ()] == [(1000,) * 5]
    assert written.files and written.files[0].etag

    with proxy_to(s3_server) as proxy:
        spec = TableSpec(f"parquet:s3://{name}/t", storage_options=options(s3_server, proxy.endpoint)).resolve()
        proxy.reset()
        # Planning, its source and the read-ahead thread share one listing and one footer.
        dataset = TableDataset(spec, batch_size=512, read_ahead=2)
        assert ids(dataset) == list(range(5000))
        # One listing of the folder, 5 row groups and 1 check of the file.
        assert proxy.requests == {"GET": 6, "HEAD": 1}
        proxy.reset()
        assert ids(dataset) == list(range(5000))
        assert proxy.requests == {"GET": 5, "HEAD": 1}

    with pytest.raises(FileExistsError, match="never overwrites"):
        write_table(f"parquet:s3://{name}/t", numbers(0, 10), storage_options=options(s3_server))


def test_map_style_reads_take_rows_from_the_store(s3_server: S3Server) -> None:
    spec = TableSpec(uneven(s3_server), storage_options=options(s3_server), filter="id >= 250 AND id < 1600")
    dataset = TableMapDataset(spec)
    kept = list(range(250, 1600))
    assert len(dataset) == len(kept)
    wanted = [len(kept) - 1, 0, 250, 7, 250]
    assert [int(row["id"]) for row in dataset.__getitems__(wanted)] == [kept[i] for i in wanted]


def test_the_cache_serves_later_epochs_without_a_request_within_its_budget(s3_server: S3Server, tmp_path: Path) -> None:
    uri = uneven(s3_server)
    with proxy_to(s3_server) as proxy:
        store = options(s3_server, proxy.endpoint)
        dataset = TableDataset(
            TableSpec(uri, storage_options=store, cache_dir=str(tmp_path / "all"), cache_bytes=1 << 30), batch_size=100
        )
        # The store's reads fetch ahead themselves; once the cache holds every row group they are
        # local reads, which the consumer spreads over its reading threads.
        assert dataset.source().fetches_ahead
        assert ids(dataset) == list(range(TOTAL))
        assert not dataset.source().fetches_ahead
        proxy.reset()
        assert ids(dataset) == list(range(TOTAL))
        assert proxy.requests == {}

        # A budget of about two row groups: the rest is fetched again, and the rows stay exact.
        budget = 2 * 700 * 24
        small = TableSpec(uri, storage_options=store, cache_dir=str(tmp_path / "small"), cache_bytes=budget)
        for _ in range(2):
            proxy.reset()
            assert ids(TableDataset(small, batch_size=100)) == list(range(TOTAL))
            kept = [path.stat().st_size for path in (tmp_path / "small").iterdir()]
            assert 0 < sum(kept) <= budget
            assert proxy.requests["GET"] >= 4


def test_a_file_rewritten_between_passes_is_detected(s3_server: S3Server) -> None:
    uri = uneven(s3_server)
    dataset = TableDataset(TableSpec(uri, storage_options=options(s3_server)), batch_size=100)
    assert ids(dataset) == list(range(TOTAL))
    path = f"{uri.removeprefix('parquet:s3://')}/part-1.parquet"
    pq.write_table(numbers(10_000, 160), path, filesystem=s3_server.filesystem())
    with pytest.raises(ValueError, match=r"changed '.*part-1\.parquet'.*rows of another version are never mixed"):
        ids(dataset)


def test_wrong_keys_fail_fast_and_an_unreachable_endpoint_after_retry_seconds_with_the_fix(s3_server: S3Server) -> None:
    uri = uneven(s3_server)
    started = time.monotonic()
    with pytest.raises(PermissionError, match=r"refused.*check the credentials") as refused:
        TableSpec(uri, storage_options=options(s3_server, aws_secret_access_key="not-the-secret")).resolve()
    assert "not-the-secret" not in str(refused.value)
    assert time.monotonic() - started < 30

    # A closed port is a store that is down, for all pinning can tell: retried for retry_seconds.
    (closed,) = free_ports(1)
    store = options(s3_server, f"http://127.0.0.1:{closed}", retry_seconds=1)
    with pytest.raises(ConnectionError, match=r"retry_seconds=1\).*cannot reach the object store.*check the endpoint"):
        TableSpec(uri, storage_options=store).resolve()


def test_credentials_never_enter_a_uri_a_repr_a_state_or_a_checkpoint(s3_server: S3Server, tmp_path: Path) -> None:
    secret = s3_server.secret_key
    with pytest.raises(ValueError, match="carries credentials") as in_uri:
        TableSpec(f"parquet:s3://{s3_server.access_key}:{secret}@bucket/t")
    assert secret not in str(in_uri.value)
    with pytest.raises(ValueError, match="never in the uri"):
        TableSpec("parquet:s3://bucket/t?endpoint_override=127.0.0.1")

    spec = TableSpec(uneven(s3_server), columns=["id", "x"], storage_options=options(s3_server)).resolve()
    assert secret not in repr(spec) and "aws_secret_access_key='***'" in repr(spec)
    assert secret not in spec.version
    dataset = TableDataset(spec, batch_size=50)
    next(iter(dataset))
    assert secret not in json.dumps(dataset.state_dict())
    assert secret not in fingerprint(dataset.work())
    with pytest.raises(ValueError, match="unknown columns") as unknown:
        len(TableDataset(TableSpec(spec.uri, columns=["nope"], storage_options=options(s3_server))))
    assert secret not in str(unknown.value)

    data = SpiralDataModule(spec, batch_size=50)
    checkpoint = ModelCheckpoint(tmp_path, "{step}", every_n_train_steps=3, save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=6, logger=False, enable_progress_bar=False, callbacks=[checkpoint]
    )
    trainer.fit(Recorder(), datamodule=data)
    saved = list(tmp_path.glob("*.ckpt"))
    assert len(saved) == 2
    for path in saved:
        assert secret.encode() not in path.read_bytes()
        assert torch.load(path, weights_only=True)["SpiralDataModule"]["ranks"][0]["position"]["batches"] in (3, 6)


@pytest.mark.slow
def test_yaml_reads_the_store_with_keys_from_the_environment(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = bucket(s3_server)
    write_table(f"parquet:s3://{name}/demo", demo_data(1200), split_rows=400, storage_options=options(s3_server))
    # A new endpoint spelling keeps this process's filesystems, made with other keys, out of it.
    endpoint = s3_server.endpoint.replace("127.0.0.1", "localhost")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text(
        textwrap.dedent(
            f"""
            trainer:
              accelerator: cpu
              max_steps: 11
              logger: false
              enable_progress_bar: false
              default_root_dir: {tmp_path}
              callbacks:
                - class_path: lightning.pytorch.callbacks.ModelCheckpoint
                  init_args:
                    dirpath: {tmp_path / "checkpoints"}
                    save_last: true
            model:
              class_path: spiral_lightning.demos.tabular.DemoModel
            data:
              class_path: spiral_lightning.SpiralDataModule
              init_args:
                train:
                  uri: parquet:s3://{name}/demo
                  cache_dir: {tmp_path / "cache"}
                  cache_bytes: 100000000
                batch_size: 100
                storage_options:
                  aws_endpoint: {endpoint}
                  allow_http: true
            """
        )
    )
    main(["fit", "--config", str(experiment)])
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 11
    assert last["SpiralDataModule"]["ranks"][0]["position"]["batches"] == 11
    # The steps read every row group (the last from step 9 on), whatever the read-ahead had reached.
    assert len(list((tmp_path / "cache").iterdir())) == 3


def test_the_environment_alone_names_the_endpoint_and_keys(s3_server: S3Server) -> None:
    uri = uneven(s3_server)
    script = f"from spiral_lightning import TableDataset\nprint(sum(len(b['id']) for b in TableDataset({uri!r})))"
    environment = dict(
        os.environ,
        AWS_ENDPOINT_URL=s3_server.endpoint,
        AWS_ACCESS_KEY_ID=s3_server.access_key,
        AWS_SECRET_ACCESS_KEY=s3_server.secret_key,
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(TOTAL)]


def test_a_local_spiral_table_in_an_object_store_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"only in local folders.*'spiral://<project>/<path>'"):
        write_table("spiral:s3://bucket/t", numbers(0, 10))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="storage_options and cache_dir apply to Parquet tables"):
        TableSpec("spiral:data/t", storage_options={"aws_region": "eu-west-1"})


def test_bad_storage_options_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"unknown storage options \['aws_secret'\]"):
        TableSpec("parquet:s3://bucket/t", storage_options={"aws_secret": "x"})
    with pytest.raises(ValueError, match="do not apply to"):
        TableSpec("parquet:s3://bucket/t", storage_options={"azure_storage_account_name": "a"}).resolve()
    with pytest.raises(ValueError, match="cache_dir and cache_bytes go together"):
        TableSpec("parquet:s3://bucket/t", cache_dir="/tmp/c")
    with pytest.raises(ValueError, match="allow_http=true"):
        TableSpec("parquet:s3://bucket/t", storage_options={"aws_endpoint": "http://127.0.0.1:1"}).resolve()
    aliased = TableSpec("parquet:s3://bucket/t", storage_options={"endpoint_url": "https://e", "region": "r"})
    assert dict(aliased.storage_options or {}) == {"aws_endpoint": "https://e", "aws_region": "r"}


def test_every_kind_of_store_is_located_with_its_options() -> None:
    gcs = locate("gs://bucket/t", StorageOptions({"google_anonymous": True, "google_endpoint": "localhost:4443"}))
    assert (gcs.kind, gcs.path, type(gcs.filesystem)) == ("gcs", "bucket/t", pafs.GcsFileSystem)
    azure = locate(
        "abfs://container@account.dfs.core.windows.net/t/", StorageOptions({"azure_storage_account_key": "a2V5"})
    )
    assert (azure.kind, azure.path, type(azure.filesystem)) == ("azure", "container/t", pafs.AzureFileSystem)
    assert "a2V5" not in repr(StorageOptions({"account_key": "a2V5"}))
    local = locate("file:///data/t")
    assert (local.kind, local.path, local.remote) == ("local", "/data/t", False)
    with pytest.raises(ValueError, match="unsupported storage scheme 'hdfs'"):
        locate("hdfs://namenode/t")
