"""write_table from any iterable of record batches: a Parquet file's batches, a generator, a
list, under the first batch's schema or one given; clear errors for what cannot be written."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from spiral_lightning import TableDataset, write_table


def ids(uri: str) -> list[int]:
    return [value for batch in TableDataset(uri, batch_size=100) for value in batch["id"].tolist()]


@pytest.mark.parametrize("backend", ["spiral", "parquet"])
def test_a_parquet_files_batches_write_a_table_of_every_row(tmp_path: Path, backend: str) -> None:
    pq.write_table(pa.table({"id": range(1_000), "x": [row / 4 for row in range(1_000)]}), tmp_path / "in.parquet")
    batches = pq.ParquetFile(tmp_path / "in.parquet").iter_batches(batch_size=300)
    spec = write_table(f"{backend}:{tmp_path / 'out'}", batches, split_rows=250)
    assert ids(spec.uri) == list(range(1_000))


def test_a_generator_writes_under_the_schema_given(tmp_path: Path) -> None:
    schema = pa.schema([("id", pa.int64())])

    def batches() -> Iterator[pa.RecordBatch]:
        for start in range(0, 500, 100):
            yield pa.record_batch({"id": pa.array(range(start, start + 100), pa.int64())})

    assert ids(write_table(f"spiral:{tmp_path / 't'}", batches(), schema=schema).uri) == list(range(500))
    empty = write_table(f"parquet:{tmp_path / 'empty'}", iter([]), schema=schema)
    assert ids(empty.uri) == []


def test_what_cannot_be_written_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no record batches and no schema; pass schema="):
        write_table(f"spiral:{tmp_path / 'a'}", [])
    mixed = [pa.record_batch({"id": [1, 2]}), pa.record_batch({"id": [1.5]})]
    with pytest.raises(ValueError, match=r"record batch 1 given to write_table has the schema 'id: double', unlike"):
        write_table(f"parquet:{tmp_path / 'b'}", mixed)
    with pytest.raises(TypeError, match="item 1 of the data given to write_table is a dict, not a RecordBatch"):
        write_table(f"parquet:{tmp_path / 'c'}", [pa.record_batch({"id": [1]}), {"id": [2]}])
    with pytest.raises(TypeError, match="or an iterable of RecordBatches, not int"):
        write_table(f"parquet:{tmp_path / 'd'}", 3)  # type: ignore[arg-type]


def test_parquet_float_columns_are_written_plain_and_the_others_with_a_dictionary_and_snappy(tmp_path: Path) -> None:
    rows = 2_000
    tensor = pa.fixed_shape_tensor(pa.float16(), [2, 2])
    data = pa.table(
        {
            "id": pa.array(range(rows), pa.int64()),
            "x": pa.array([row / 3 for row in range(rows)], pa.float32()),
            "emb": pa.FixedSizeListArray.from_arrays(pa.array([row / 7 for row in range(rows * 4)], pa.float64()), 4),
            "ragged": pa.array([[0.5] * (row % 3) for row in range(rows)], pa.list_(pa.float32())),
            "t": pa.ExtensionArray.from_storage(
                tensor, pa.FixedSizeListArray.from_arrays(pa.array([1.0] * rows * 4, pa.float16()), 4)
            ),
            "name": pa.array([f"n{row % 5}" for row in range(rows)]),
            "tokens": pa.array([[row, row + 1] for row in range(rows)], pa.list_(pa.int32())),
        }
    )
    spec = write_table(f"parquet:{tmp_path / 't'}", data, split_rows=500)
    (path,) = [file.path for file in spec.files or ()]
    group = pq.ParquetFile(path).metadata.row_group(0)
    written = {
        group.column(i).path_in_schema.split(".")[0]: (group.column(i).compression, group.column(i).has_dictionary_page)
        for i in range(group.num_columns)
    }
    plain, packed = ("UNCOMPRESSED", False), ("SNAPPY", True)
    assert written == {
        "id": packed,
        "x": plain,
        "emb": plain,
        "ragged": plain,
        "t": plain,
        "name": packed,
        "tokens": packed,
    }
    # Every value reads back as written, in the column's type.
    assert pq.read_table(path).equals(data)
    got = next(iter(TableDataset(spec, batch_size=2_000)))
    assert got["emb"].dtype == torch.float64 and got["emb"][1].tolist() == [4 / 7, 5 / 7, 6 / 7, 1.0]
