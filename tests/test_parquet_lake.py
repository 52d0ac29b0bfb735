"""Parquet tables as data lakes are: files whose schemas differ read as their union, and hive
partition folders (``day=1/``) read as columns that a filter prunes whole files by."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spiral_lightning import NullError, TableDataset, TableMapDataset, TableSpec
from spiral_lightning.sources import open_source
from tests.objectstore import S3Server


def ids(dataset: Any) -> list[int]:
    return [int(i) for batch in dataset for i in batch["id"]]


def rows(dataset: Any, column: str) -> list[Any]:
    values: list[Any] = []
    for batch in dataset:
        part = batch[column]
        values += part if isinstance(part, list) else part.tolist()
    return values


def write(path: Path, columns: dict[str, pa.Array], row_group_size: int = 4) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)


def id_range(start: int, count: int) -> pa.Array:
    return pa.array(np.arange(start, start + count, dtype=np.int64))


def two_shapes(folder: Path) -> str:
    """``a.parquet`` (ids 0..9, ``x``) and ``b.parquet`` (ids 10..15, ``name``)."""
    write(folder / "a.parquet", {"id": id_range(0, 10), "x": pa.array(range(10), pa.int64())})
    write(folder / "b.parquet", {"id": id_range(10, 6), "name": pa.array([f"n{i}" for i in range(6)])})
    return f"parquet:{folder}"


def test_files_with_different_columns_read_as_their_union(tmp_path: Path) -> None:
    uri = two_shapes(tmp_path)
    source = open_source(TableSpec(uri).resolve())
    assert source.schema.names == ["id", "x", "name"]
    assert source.schema.field("x").type == pa.int64() and source.schema.field("x").nullable

    # A column that becomes a tensor has nulls in b's rows: refused, naming the column.
    with pytest.raises(NullError, match=r"column 'x' is null .* row 10 .*null_fill=\{'x': 0\}"):
        ids(TableDataset(uri, batch_size=4))
    filled = TableDataset(TableSpec(uri, null_fill={"x": -1}), batch_size=4)
    assert ids(filled) == list(range(16))
    assert rows(filled, "x") == list(range(10)) + [-1] * 6
    assert rows(filled, "name") == [None] * 10 + [f"n{i}" for i in range(6)]
    masked = next(iter(TableDataset(TableSpec(uri, columns=["x"], null_mask=["x"]), batch_size=16)))
    assert masked["x_valid"].tolist() == [True] * 10 + [False] * 6

    # Only shared columns, or only one file's: no nulls to decide, every row.
    assert ids(TableDataset(uri, columns=["id"], batch_size=5)) == list(range(16))
    names = TableDataset(uri, columns=["id", "name"], batch_size=5)
    assert ids(names) == list(range(16))
    assert rows(names, "name") == [None] * 10 + [f"n{i}" for i in range(6)]
    with pytest.raises(ValueError, match=r"unknown columns \['y'\]"):
        TableDataset(uri, columns=["id", "y"])


def test_a_filter_on_a_column_some_files_lack_reads_it_as_null(tmp_path: Path) -> None:
    uri = two_shapes(tmp_path)
    b_file = str(tmp_path / "b.parquet")
    greater = TableSpec(uri, columns=["id"], filter="x > 1").resolve()
    assert ids(TableDataset(greater, batch_size=3)) == list(range(2, 10))
    # b.parquet has no x: x > 1 holds for none of its rows, so none of its row groups is planned.
    assert len(open_source(greater).splits) == 3
    assert greater.files is not None and greater.files[1].path == b_file
    assert ids(TableDataset(uri, columns=["id"], filter="x IS NULL", batch_size=3)) == list(range(10, 16))
    assert ids(TableDataset(uri, columns=["id"], filter="x IS NULL OR name = 'n2'")) == list(range(10, 16))
    assert ids(TableDataset(uri, columns=["id"], filter="name LIKE 'n%' OR x < 2")) == [0, 1, *range(10, 16)]
    mapped = TableMapDataset(TableSpec(uri, columns=["id", "name"], filter="x IS NULL AND id >= 12"))
    assert len(mapped) == 4
    assert [row["name"] for row in mapped.__getitems__([3, 0])] == ["n5", "n2"]


def test_integer_and_float_types_read_as_the_type_they_widen_to(tmp_path: Path) -> None:
    write(
        tmp_path / "a.parquet",
        {"id": id_range(0, 5), "x": pa.array(range(5), pa.int32()), "f": pa.array([0.5] * 5, pa.float32())},
    )
    write(
        tmp_path / "b.parquet",
        {
            "id": id_range(5, 5),
            "x": pa.array([2**40 + i for i in range(5)], pa.int64()),
            "f": pa.array([0.25] * 5, pa.float64()),
        },
    )
    uri = f"parquet:{tmp_path}"
    schema = open_source(TableSpec(uri).resolve()).schema
    assert (schema.field("x").type, schema.field("f").type) == (pa.int64(), pa.float64())
    dataset = TableDataset(uri, batch_size=3)
    assert ids(dataset) == list(range(10))
    assert rows(dataset, "x") == list(range(5)) + [2**40 + i for i in range(5)]
    assert rows(dataset, "f") == [0.5] * 5 + [0.25] * 5
    assert ids(TableDataset(uri, filter="x >= 3 AND x < 1099511627777", batch_size=3)) == [3, 4, 5]


def test_types_that_do_not_widen_are_refused_only_when_read(tmp_path: Path) -> None:
    write(tmp_path / "a.parquet", {"id": id_range(0, 5), "x": pa.array(range(5), pa.int64())})
    write(tmp_path / "b.parquet", {"id": id_range(5, 5), "x": pa.array([str(i) for i in range(5)])})
    # uint64 and int64 unify as int64 in pyarrow, losing values past 2**63: refused too.
    write(tmp_path / "c.parquet", {"id": id_range(10, 5), "u": pa.array(range(5), pa.uint64())})
    write(tmp_path / "d.parquet", {"id": id_range(15, 5), "u": pa.array(range(5), pa.int64())})
    uri = f"parquet:{tmp_path}"
    spec = TableSpec(uri).resolve()
    a, b = (repr(str(tmp_path / name)) for name in ("a.parquet", "b.parquet"))
    refusal = rf"column 'x' is int64 in {a} but string in {b}"
    with pytest.raises(ValueError, match=refusal):
        TableDataset(spec)
    with pytest.raises(ValueError, match=refusal):
        TableDataset(spec, columns=["id", "x"])
    with pytest.raises(ValueError, match=refusal):
        TableDataset(spec, columns=["id"], filter="x IS NULL")
    c, d = (repr(str(tmp_path / name)) for name in ("c.parquet", "d.parquet"))
    with pytest.raises(ValueError, match=rf"column 'u' is uint64 in {c} but int64 in {d}"):
        TableDataset(spec, columns=["u"])
    assert ids(TableDataset(spec, columns=["id"], batch_size=7)) == list(range(20))


def hive(folder: Path) -> str:
    """``day=1/part.parquet`` (ids 0..9), ``day=2/part.parquet`` (ids 10..19, with ``label``)
    and ``day=3/city=paris/part.parquet`` (ids 20..24), row groups of 4 rows."""
    write(folder / "day=1" / "part.parquet", {"id": id_range(0, 10)})
    write(folder / "day=2" / "part.parquet", {"id": id_range(10, 10), "label": pa.array(range(10), pa.int32())})
    write(folder / "day=3" / "city=paris" / "part.parquet", {"id": id_range(20, 5)})
    (folder / "day=1" / "_SUCCESS").write_text("")
    return f"parquet:{folder}"


def test_hive_folders_are_columns(tmp_path: Path) -> None:
    uri = hive(tmp_path)
    source = open_source(TableSpec(uri).resolve())
    assert source.schema.names == ["id", "label", "day", "city"]
    assert (source.schema.field("day").type, source.schema.field("city").type) == (pa.int64(), pa.string())
    dataset = TableDataset(uri, columns=["id", "day", "city"], batch_size=6)
    assert ids(dataset) == list(range(25))
    assert rows(dataset, "day") == [1] * 10 + [2] * 10 + [3] * 5
    assert rows(dataset, "city") == [None] * 20 + ["paris"] * 5
    batch = next(iter(dataset))
    assert batch["day"].dtype.is_floating_point is False and batch["day"].tolist() == [1] * 6
    # Only partition columns: no column of the files is read, their rows still counted.
    assert rows(TableDataset(uri, columns=["day"], batch_size=25), "day") == [1] * 10 + [2] * 10 + [3] * 5
    # A glob's partitions are the folders below its first wildcard.
    globbed = TableSpec(f"parquet:{tmp_path}/day=*/**/*.parquet", columns=["id", "day"]).resolve()
    assert rows(TableDataset(globbed, batch_size=25), "day") == [1] * 10 + [2] * 10 + [3] * 5
    one_day = TableSpec(f"parquet:{tmp_path}/day=2").resolve()
    assert open_source(one_day).schema.names == ["id", "label"]


def test_a_filter_on_partition_columns_plans_no_split_of_the_files_it_excludes(tmp_path: Path) -> None:
    uri = hive(tmp_path)
    spec = TableSpec(uri, columns=["id", "day"], filter="day = 2").resolve()
    source = open_source(spec)
    # day=2's file alone: its row groups of 4, 4 and 2 rows.
    assert [(split.start, split.end) for split in source.splits] == [(0, 4), (0, 4), (0, 2)]
    assert ids(TableDataset(spec, batch_size=3)) == list(range(10, 20))

    # The excluded files are never opened for rows: zeros of the same size and modification
    # time in place of day=1's file change nothing (a read of it would fail).
    day_one = tmp_path / "day=1" / "part.parquet"
    stat = day_one.stat()
    day_one.write_bytes(bytes(stat.st_size))
    os.utime(day_one, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert ids(TableDataset(spec, batch_size=3)) == list(range(10, 20))
    with pytest.raises((OSError, ValueError, pa.ArrowException)):
        ids(TableDataset(TableSpec(uri, files=spec.files, columns=["id"]), batch_size=3))


def test_partition_filters_join_row_filters_and_other_partitions(tmp_path: Path) -> None:
    uri = hive(tmp_path)
    both = TableSpec(uri, columns=["id"], filter="day >= 2 AND id < 22").resolve()
    assert ids(TableDataset(both, batch_size=4)) == list(range(10, 22))
    assert len(open_source(both).splits) == 5
    assert ids(TableDataset(uri, columns=["id"], filter="city = 'paris'")) == list(range(20, 25))
    assert ids(TableDataset(uri, columns=["id"], filter="city IS NULL AND day IN (1, 3)")) == list(range(10))
    assert ids(TableDataset(uri, columns=["id"], filter="day = 2 OR id = 3", batch_size=20)) == [3, *range(10, 20)]
    none = TableSpec(uri, columns=["id"], filter="day = 4").resolve()
    assert len(open_source(none).splits) == 0 and ids(TableDataset(none)) == []
    with pytest.raises(ValueError, match="column 'day' has type int64, which the literal '2'"):
        TableDataset(uri, filter="day = '2'")


def test_partition_values_that_are_not_all_integers_are_strings(tmp_path: Path) -> None:
    write(tmp_path / "part=7" / "a.parquet", {"id": id_range(0, 2)})
    write(tmp_path / "part=x%2Fy" / "a.parquet", {"id": id_range(2, 2)})
    write(tmp_path / "part=__HIVE_DEFAULT_PARTITION__" / "a.parquet", {"id": id_range(4, 2)})
    uri = f"parquet:{tmp_path}"
    dataset = TableDataset(uri, columns=["id", "part"], batch_size=6)
    # Files in path order: "part=7", "part=__HIVE_DEFAULT_PARTITION__", "part=x%2Fy".
    assert ids(dataset) == [0, 1, 4, 5, 2, 3]
    assert rows(dataset, "part") == ["7", "7", None, None, "x/y", "x/y"]
    assert ids(TableDataset(uri, columns=["id"], filter="part = 'x/y'")) == [2, 3]


def test_a_partition_key_that_is_also_a_stored_column_is_refused_when_read(tmp_path: Path) -> None:
    write(tmp_path / "day=1" / "a.parquet", {"id": id_range(0, 2), "day": pa.array([5, 5], pa.int64())})
    uri = f"parquet:{tmp_path}"
    with pytest.raises(ValueError, match="'day' is a partition folder of the table and a column stored in"):
        TableDataset(uri)
    assert ids(TableDataset(uri, columns=["id"])) == [0, 1]


def test_the_version_pins_every_file_of_the_lake(tmp_path: Path) -> None:
    uri = hive(tmp_path)
    spec = TableSpec(uri).resolve()
    assert spec.version == TableSpec(uri).resolve().version
    write(tmp_path / "day=2" / "part.parquet", {"id": id_range(10, 10)})
    stat = (tmp_path / "day=2" / "part.parquet").stat()
    os.utime(tmp_path / "day=2" / "part.parquet", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert TableSpec(uri).resolve().version != spec.version
    with pytest.raises(ValueError, match=r"changed '.*day=2/part\.parquet'"):
        open_source(spec)


def test_a_union_table_resumes_mid_epoch(tmp_path: Path) -> None:
    two_shapes(tmp_path / "t")
    hive(tmp_path / "t" / "more")
    uri = f"parquet:{tmp_path / 't'}"
    spec = TableSpec(uri, columns=["id", "x", "name", "day"], null_fill={"x": -1, "day": 0}).resolve()
    whole = ids(TableDataset(spec, batch_size=3))
    assert sorted(whole) == sorted([*range(25), *range(16)])
    first = TableDataset(spec, batch_size=3)
    delivering = iter(first)
    before = [int(i) for _ in range(5) for i in next(delivering)["id"]]
    second = TableDataset(spec, batch_size=3)
    second.load_state_dict(first.state_dict())
    assert before + ids(second) == whole


def test_a_lake_in_an_object_store_reads_its_partitions_and_union(s3_server: S3Server) -> None:
    name = f"lake-{os.getpid()}"
    s3_server.make_bucket(name)
    filesystem = s3_server.filesystem()
    pq.write_table(
        pa.table({"id": id_range(0, 6)}), f"{name}/t/day=1/a.parquet", filesystem=filesystem, row_group_size=4
    )
    pq.write_table(
        pa.table({"id": id_range(6, 6), "x": pa.array(range(6), pa.int32())}),
        f"{name}/t/day=2/a.parquet",
        filesystem=filesystem,
        row_group_size=4,
    )
    options = {
        "aws_endpoint": s3_server.endpoint,
        "allow_http": True,
        "aws_access_key_id": s3_server.access_key,
        "aws_secret_access_key": s3_server.secret_key,
    }
    uri = f"parquet:s3://{name}/t"
    spec = TableSpec(uri, storage_options=options, columns=["id", "x", "day"], null_fill={"x": -1})
    dataset = TableDataset(spec, batch_size=5)
    assert ids(dataset) == list(range(12))
    assert rows(dataset, "x") == [-1] * 6 + list(range(6))
    assert rows(dataset, "day") == [1] * 6 + [2] * 6
    days = TableSpec(uri, storage_options=options, columns=["day"], filter="day = 1")
    assert rows(TableDataset(days, batch_size=5), "day") == [1] * 6
    taken = TableMapDataset(TableSpec(uri, storage_options=options, columns=["id"], filter="x IS NULL OR x > 4"))
    assert [int(row["id"]) for row in taken.__getitems__([6, 0])] == [11, 0]
