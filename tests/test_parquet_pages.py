"""Fixed-size list columns decoded from plain pages give exactly what Arrow's reader gives, and
every page that is not a plain list page is left to Arrow: nulls, compression, dictionaries,
version 2 pages, a checksum that does not match."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spiral_lightning import TableDataset, TableMapDataset, TableSpec, write_table
from spiral_lightning.sources import parquet_pages
from spiral_lightning.sources.damage import DamagedData
from spiral_lightning.sources.parquet_pages import RowGroups, fixed_lists, plain_values
from tests.objectstore import S3Server
from tests.test_objectstore import bucket, options, proxy_to
from tests.test_verified_pages import damage, middle_of

PLAIN = {"compression": "none", "use_dictionary": False, "write_page_checksum": True}


def lists(rows: int, size: int, value_type: pa.DataType, *, nullable: bool = True, seed: int = 0) -> pa.Table:
    """``rows`` rows of an ``id`` and a column ``v`` of ``size`` values of ``value_type`` a row."""
    values = np.random.default_rng(seed).normal(size=rows * size) * 1000
    column = pa.FixedSizeListArray.from_arrays(pa.array(values.astype(value_type.to_pandas_dtype())), size)
    schema = pa.schema([("id", pa.int64()), pa.field("v", pa.list_(value_type, size), nullable)])
    return pa.table([pa.array(np.arange(rows)), column], schema=schema)


def decoded(path: Path, group: int, column: str = "v") -> pa.Array | None:
    """The column chunk decoded from its pages, or None where they are not plain list pages."""
    parquet = pq.ParquetFile(path)
    fixed = fixed_lists(parquet, [column])[column]
    chunk = parquet.metadata.row_group(group).column(fixed.leaf)
    data = pa.OSFile(str(path)).read_at(chunk.total_compressed_size, chunk.data_page_offset)
    return plain_values(data, fixed, parquet.metadata.row_group(group).num_rows)


def read(path: Path, columns: list[str], batch_rows: int) -> list[pa.RecordBatch]:
    parquet = pq.ParquetFile(path, page_checksum_verification=True)
    groups = RowGroups(parquet, pa.OSFile(str(path)))
    return [batch for group in range(parquet.num_row_groups) for batch in groups.batches(group, columns, batch_rows)]


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 3000),
    size=st.sampled_from([1, 3, 4, 8, 16, 17, 64]),
    value_type=st.sampled_from([pa.float32(), pa.float64(), pa.int32(), pa.int64()]),
    nullable=st.booleans(),
    page_bytes=st.sampled_from([512, 4096, 1 << 20]),
    batch_rows=st.sampled_from([100, 1000, 65_536]),
)
def test_plain_list_pages_decode_to_what_arrow_reads(
    tmp_path_factory: pytest.TempPathFactory,
    rows: int,
    size: int,
    value_type: pa.DataType,
    nullable: bool,
    page_bytes: int,
    batch_rows: int,
) -> None:
    path = tmp_path_factory.mktemp("lists") / "t.parquet"
    table = lists(rows, size, value_type, nullable=nullable)
    pq.write_table(table, path, row_group_size=1000, data_page_size=page_bytes, **PLAIN)
    parquet = pq.ParquetFile(path)
    for group in range(parquet.num_row_groups):
        fast = decoded(path, group)
        assert fast is not None, f"row group {group} was not read from its pages"
        assert fast.equals(parquet.read_row_group(group).column("v").combine_chunks())
    batches = read(path, ["id", "v"], batch_rows)
    assert pa.Table.from_batches(batches).equals(table)
    by_arrow = (parquet.iter_batches(batch_rows, [group], ["id"]) for group in range(parquet.num_row_groups))
    assert [batch.num_rows for batch in batches] == [batch.num_rows for group in by_arrow for batch in group]
    assert pa.Table.from_batches(read(path, ["v"], batch_rows)).equals(table.select(["v"]))


def test_write_tables_embeddings_are_read_from_their_pages_by_the_dataset(tmp_path: Path) -> None:
    table = lists(5000, 16, pa.float32())
    spec = write_table(f"parquet:{tmp_path / 't'}", table, split_rows=1200)
    (path,) = [Path(file.path) for file in spec.files or ()]
    assert all(decoded(path, group) is not None for group in range(5))
    got = list(TableDataset(spec, batch_size=1000))
    assert [batch["id"].tolist() for batch in got] == [list(range(at, at + 1000)) for at in range(0, 5000, 1000)]
    expected = table.column("v").combine_chunks().flatten().to_numpy().reshape(5000, 16)
    assert np.array_equal(np.concatenate([batch["v"].numpy() for batch in got]), expected)
    # Random access reads whole row groups the same way.
    rows = TableMapDataset(spec).__getitems__([4999, 0, 1200, 3601])
    assert [int(row["id"]) for row in rows] == [4999, 0, 1200, 3601]
    assert np.array_equal(np.stack([row["v"].numpy() for row in rows]), expected[[4999, 0, 1200, 3601]])


@pytest.mark.parametrize(
    ("why", "table", "options"),
    [
        ("a null list", "null list", PLAIN),
        ("a null value", "null value", PLAIN),
        ("snappy compression", "plain", {**PLAIN, "compression": "snappy"}),
        ("a dictionary", "plain", {**PLAIN, "use_dictionary": True}),
        ("version 2 pages", "plain", {**PLAIN, "data_page_version": "2.0"}),
        ("split values", "plain", {**PLAIN, "column_encoding": {"v.list.element": "BYTE_STREAM_SPLIT"}}),
    ],
)
def test_pages_that_are_not_plain_list_pages_are_left_to_arrow(
    tmp_path: Path, why: str, table: str, options: dict[str, Any]
) -> None:
    data = lists(3000, 8, pa.float32())
    if table != "plain":
        values = data.column("v").combine_chunks()
        if table == "null list":
            mask = pa.array(np.arange(3000) == 1234)
            column = pa.FixedSizeListArray.from_arrays(values.values, 8, mask=mask)
        else:
            flat = values.values.to_numpy(zero_copy_only=False).astype(object)
            flat[12_003] = None  # row 1500
            column = pa.FixedSizeListArray.from_arrays(pa.array(flat, pa.float32()), 8)
        data = data.set_column(1, "v", column)
    if options.get("column_encoding"):
        options = {**options, "use_dictionary": False}
    path = tmp_path / "t.parquet"
    pq.write_table(data, path, row_group_size=1000, **options)
    assert decoded(path, 1) is None, why
    # A null declines its row group only.
    assert (decoded(path, 0) is not None) == (table != "plain"), why
    assert pa.Table.from_batches(read(path, ["id", "v"], 700)).equals(pq.read_table(path))


def test_a_page_of_more_rows_than_this_pyarrow_writes_to_a_page_is_left_to_arrow(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    table = lists(30_000, 1, pa.float32())
    pq.write_table(table, path, data_page_size=1 << 30, max_rows_per_page=30_000, **PLAIN)
    assert decoded(path, 0) is None
    assert pa.Table.from_batches(read(path, ["id", "v"], 65_536)).equals(table)


def test_a_list_page_whose_crc_fails_is_refused_by_arrow_naming_the_row_group(tmp_path: Path) -> None:
    spec = write_table(f"parquet:{tmp_path / 't'}", lists(4000, 16, pa.float32()), split_rows=1000)
    (path,) = [file.path for file in spec.files or ()]
    damage(path, middle_of(path, 2, 1))
    assert decoded(Path(path), 2) is None and decoded(Path(path), 1) is not None
    with pytest.raises(DamagedData, match=r"row group 2 of .*CRC checksum verification failed"):
        list(TableDataset(spec, batch_size=1000))


def test_only_fixed_size_lists_of_plain_numbers_are_candidates(tmp_path: Path) -> None:
    table = pa.table(
        {
            "fixed": pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(8, np.float32)), 4),
            "varying": pa.array([[1.0, 2.0], [3.0]], pa.list_(pa.float32())),
            "narrow": pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(8, np.int16)), 4),
            "nested": pa.array([[[1.0]], [[2.0]]], pa.list_(pa.list_(pa.float32(), 1), 1)),
            "flat": pa.array([1.0, 2.0], pa.float32()),
        }
    )
    path = tmp_path / "t.parquet"
    pq.write_table(table, path, **PLAIN)
    found = fixed_lists(pq.ParquetFile(path), table.column_names)
    assert list(found) == ["fixed"] and found["fixed"].leaf == 0
    assert fixed_lists(pq.ParquetFile(path), ["flat", "varying"]) == {}


def test_list_pages_fetched_from_an_object_store_are_decoded_from_the_fetched_bytes(
    s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = lists(5000, 16, pa.float32())
    uri = f"parquet:s3://{bucket(s3_server)}/t"
    write_table(uri, table, split_rows=1000, storage_options=options(s3_server))
    taken: list[int] = []

    def counted(chunk: pa.Buffer, column: parquet_pages.FixedList, rows: int) -> pa.Array | None:
        lists = plain_values(chunk, column, rows)
        taken.append(0 if lists is None else len(lists))
        return lists

    monkeypatch.setattr(parquet_pages, "plain_values", counted)
    with proxy_to(s3_server) as proxy:
        spec = TableSpec(uri, storage_options=options(s3_server, proxy.endpoint)).resolve()
        proxy.reset()
        got = list(TableDataset(spec, batch_size=1000))
        # One request a row group and one check of the file, as without the list pages' decoding.
        assert proxy.requests == {"GET": 6, "HEAD": 1}
    assert taken == [1000] * 5
    assert [int(i) for batch in got for i in batch["id"]] == list(range(5000))
    expected = table.column("v").combine_chunks().flatten().to_numpy().reshape(5000, 16)
    assert np.array_equal(np.concatenate([batch["v"].numpy() for batch in got]), expected)
