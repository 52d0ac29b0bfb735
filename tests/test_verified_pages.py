"""Damaged bytes fail, and say where: Parquet page CRCs written and checked, short range responses
read again, decode errors naming the table, the file (or split) and the row group, locally and in
a real S3 server (SeaweedFS) behind a fault-injecting proxy."""

from __future__ import annotations

import glob
import itertools
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spiral_lightning import TableDataset, TableMapDataset, TableSpec, write_table
from spiral_lightning.sources.cache import kept_entries
from spiral_lightning.sources.damage import DamagedData
from spiral_lightning.sources.retry import StoreUnavailable
from tests.objectstore import FaultProxy, S3Server

ROWS = 10_000
GROUP_ROWS = 1_000
_buckets = itertools.count()


def rows(count: int = ROWS) -> pa.Table:
    ids = np.arange(count, dtype=np.int64)
    return pa.table({"id": ids, "x": np.random.default_rng(0).random(count)})


def middle_of(path: str, group: int, column: int, size: int = 1) -> tuple[int, int]:
    """Bytes in the middle of a column chunk's data pages: past the page header, inside the data."""
    chunk = pq.ParquetFile(path).metadata.row_group(group).column(column)
    start = chunk.data_page_offset
    middle = start + (chunk.total_compressed_size - (start - (chunk.dictionary_page_offset or start))) // 2
    return middle, middle + size


def damage(path: str, span: tuple[int, int], how: str = "flip") -> None:
    """Bytes ``span`` of ``path`` flipped (one bit each) or zeroed as a disk's decay would: size and
    modification time as they were, so the file still looks like the pinned one."""
    before = os.stat(path)
    data = bytearray(Path(path).read_bytes())
    start, end = span
    data[start:end] = bytes(end - start) if how == "zero" else bytes(byte ^ 0x01 for byte in data[start:end])
    Path(path).write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def read_all(dataset: Any) -> list[int]:
    return [int(i) for batch in dataset for i in batch["id"]]


def test_write_table_writes_page_crcs_and_a_flipped_bit_fails_naming_table_file_and_row_group(tmp_path: Path) -> None:
    spec = write_table(f"parquet:{tmp_path / 't'}", rows(), split_rows=GROUP_ROWS)
    (path,) = [file.path for file in spec.files or ()]
    damage(path, middle_of(path, 3, 1))
    with pytest.raises(DamagedData, match=r"CRC checksum verification failed") as raised:
        read_all(TableDataset(spec, batch_size=500))
    said = str(raised.value)
    assert spec.uri in said and path in said and "row group 3 of" in said
    # Random access decodes the same row group, and says the same.
    with pytest.raises(DamagedData, match=r"row group 3 of .*CRC checksum verification failed"):
        TableMapDataset(spec)[3 * GROUP_ROWS + 1]
    # The other row groups still read.
    assert int(TableMapDataset(spec)[2 * GROUP_ROWS]["id"]) == 2 * GROUP_ROWS


def test_pages_any_writer_gave_a_crc_are_checked_where_an_unchecked_flip_reads_as_a_wrong_value(
    tmp_path: Path,
) -> None:
    path = str(tmp_path / "plain.parquet")
    pq.write_table(rows(), path, row_group_size=GROUP_ROWS, compression="none", write_page_checksum=True)
    damage(path, middle_of(path, 5, 0, size=8))
    with pytest.raises(DamagedData, match=r"row group 5 of .*plain\.parquet.*CRC checksum"):
        read_all(TableDataset(TableSpec(f"parquet:{path}"), batch_size=1000))


@pytest.mark.parametrize(
    ("where", "said"),
    [("header", r"Couldn't deserialize thrift"), ("data", r"Corrupt snappy compressed data|Unexpected end of stream")],
)
def test_a_page_without_crc_that_does_not_decode_names_table_file_and_row_group(
    tmp_path: Path, where: str, said: str
) -> None:
    path = str(tmp_path / "snappy.parquet")
    pq.write_table(rows(), path, row_group_size=GROUP_ROWS)  # pyarrow's defaults: snappy, no CRC
    chunk = pq.ParquetFile(path).metadata.row_group(7).column(1)
    span = (chunk.data_page_offset, chunk.data_page_offset + 16) if where == "header" else middle_of(path, 7, 1, 64)
    damage(path, span, "zero")
    spec = TableSpec(f"parquet:{path}")
    with pytest.raises(DamagedData, match=rf"cannot decode row group 7 of '{path}' of 'parquet:{path}': ({said})"):
        read_all(TableDataset(spec, batch_size=1000))


def test_a_damaged_spiral_payload_names_the_table_and_split(tmp_path: Path) -> None:
    spec = write_table(f"spiral:{tmp_path / 's'}", rows(3000), split_rows=1000)
    payloads = sorted(glob.glob(str(tmp_path / "s" / "attempts" / "*" / "payloads" / "*.vortex")))
    assert len(payloads) == 3
    # Every payload is a split; which one holds which rows is spiral-sdk's, so damage all but one.
    for payload in payloads[1:]:
        Path(payload).write_bytes(Path(payload).read_bytes()[:-10])
    said = r"cannot decode split \d \(rows 0\.\.1000\) of 'spiral:.*Table storage failed"
    with pytest.raises(DamagedData, match=said):
        read_all(TableDataset(spec, batch_size=250))


# Object store: a real S3 server behind the fault-injecting proxy.


def options(server: S3Server, endpoint: str, **more: Any) -> dict[str, Any]:
    return {
        "aws_endpoint": endpoint,
        "allow_http": True,
        "aws_access_key_id": server.access_key,
        "aws_secret_access_key": server.secret_key,
        **more,
    }


def in_store(server: S3Server, data: pa.Table, **write: Any) -> str:
    """A new bucket holding ``data`` as one Parquet file of row groups of ``GROUP_ROWS``, written
    by pyarrow with ``write`` options; its key."""
    name = f"pages-{os.getpid()}-{next(_buckets)}"
    server.make_bucket(name)
    pq.write_table(data, f"{name}/t/part.parquet", filesystem=server.filesystem(), row_group_size=GROUP_ROWS, **write)
    return f"{name}/t"


def exact(batches: Any, data: pa.Table, after: int = -1, then: Any = None) -> list[int]:
    """The ids read, each batch's values checked against ``data``; ``then()`` runs after batch ``after``."""
    ids: list[int] = []
    x = data.column("x").to_numpy()
    for number, batch in enumerate(batches):
        got = batch["id"].numpy()
        assert np.array_equal(batch["x"].numpy(), x[got]), "a row came back with another row's values"
        ids += got.tolist()
        if number == after:
            then()
    return ids


def test_a_short_range_response_is_detected_and_read_again(s3_server: S3Server) -> None:
    # Uncompressed and without CRCs, as many writers leave them: a zero-filled tail would decode.
    data = rows(20_000)
    key = in_store(s3_server, data, compression="none")
    with FaultProxy(s3_server.host, s3_server.port) as proxy:
        spec = TableSpec(f"parquet:s3://{key}", storage_options=options(s3_server, proxy.endpoint), prefetch=1)
        # Read in line: reading threads would read the whole small file ahead, before the fault is set.
        dataset = TableDataset(spec, batch_size=500, read_ahead=0)
        ids = exact(dataset, data, after=1, then=lambda: proxy.short(1500, count=1))
        assert proxy.faults["short"] == 1
    assert sorted(ids) == list(range(20_000))


def test_a_store_that_keeps_answering_short_fails_naming_the_object_and_the_time(s3_server: S3Server) -> None:
    key = in_store(s3_server, rows(), compression="none")
    with FaultProxy(s3_server.host, s3_server.port) as proxy:
        store = options(s3_server, proxy.endpoint, retry_seconds=1)
        dataset = TableDataset(TableSpec(f"parquet:s3://{key}", storage_options=store), batch_size=500)
        proxy.short(10, seconds=60)
        with pytest.raises(StoreUnavailable, match=r"did not serve bytes \d+\.\.\d+ of '.*/t/part\.parquet'") as raised:
            read_all(dataset)
    said = str(raised.value)
    assert "tries over" in said and "retry_seconds=1" in said and "fewer bytes than asked" in said
    assert isinstance(raised.value, ConnectionError)


def test_bytes_damaged_on_the_way_fail_their_crc_naming_the_object_and_row_group(s3_server: S3Server) -> None:
    data = rows()
    name = f"pages-{os.getpid()}-{next(_buckets)}"
    s3_server.make_bucket(name)
    with FaultProxy(s3_server.host, s3_server.port) as proxy:
        store = options(s3_server, proxy.endpoint)
        spec = write_table(f"parquet:s3://{name}/t", data.select(["id"]), split_rows=GROUP_ROWS, storage_options=store)
        proxy.flip(count=1)  # the first range read to arrive: the footer is known since the write
        with pytest.raises(DamagedData, match=r"row group \d of '.*/t/part-00000\.parquet' of 'parquet:s3://.*CRC"):
            read_all(TableDataset(spec, batch_size=500))
        assert proxy.faults["flip"] == 1


def test_damaged_bytes_in_the_cache_are_dropped_and_fetched_again(s3_server: S3Server, tmp_path: Path) -> None:
    data = rows()
    name = f"pages-{os.getpid()}-{next(_buckets)}"
    s3_server.make_bucket(name)
    folder = tmp_path / "cache"
    with FaultProxy(s3_server.host, s3_server.port) as proxy:
        store = options(s3_server, proxy.endpoint)
        spec = write_table(f"parquet:s3://{name}/t", data.select(["id"]), split_rows=GROUP_ROWS, storage_options=store)
        cached = TableDataset(replace(spec, cache_dir=str(folder), cache_bytes=1 << 30), batch_size=500)
        # Damaged on the way, and kept in the cache as fetched: dropped when it fails, so the next pass reads.
        proxy.flip(count=1)
        with pytest.raises(DamagedData, match=r"CRC.*the stored bytes are damaged"):
            read_all(cached)
        assert read_all(cached) == list(range(ROWS))
        # Damaged on the cache's disk: says so, then the next pass fetches that row group from the store again.
        entries = kept_entries(folder)
        assert len(entries) == ROWS // GROUP_ROWS
        size = os.path.getsize(entries[3])
        damage(entries[3], (size // 2, size // 2 + 1))
        with pytest.raises(DamagedData, match=r"CRC.*the bytes came from the cache '.*', whose copy is now dropped"):
            read_all(cached)
        assert len(kept_entries(folder)) == ROWS // GROUP_ROWS - 1
        fetched = proxy.requests["GET"]
        assert read_all(cached) == list(range(ROWS))
        assert proxy.requests["GET"] == fetched + 1


def test_an_object_rewritten_in_the_middle_of_a_pass_is_a_change_not_rows(s3_server: S3Server) -> None:
    data = rows(20_000)
    key = in_store(s3_server, data, compression="none")
    spec = TableSpec(f"parquet:s3://{key}", storage_options=options(s3_server, s3_server.endpoint), prefetch=1)

    def rewrite() -> None:
        # Another layout, shorter: the pass's next range reads find other bytes, or fewer.
        pq.write_table(rows(3000), f"{key}/part.parquet", filesystem=s3_server.filesystem(), row_group_size=700)

    # Read in line: reading threads would read the whole small file ahead, before the rewrite.
    with pytest.raises(ValueError, match=r"changed '.*/t/part\.parquet'.*rows of another version are never mixed"):
        exact(TableDataset(spec, batch_size=500, read_ahead=0), data, after=1, then=rewrite)
