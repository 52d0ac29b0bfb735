"""The Parquet backend: pinned versions, row-group splits, takes, and files changed under a reader."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from torch.utils.data import DataLoader

from spiral_lightning import NullError, TableDataset, TableMapDataset, TableSpec, WorkItem, write_table
from spiral_lightning.sources import Take, open_source


def numbers(start: int, rows: int) -> pa.Table:
    return pa.table(
        {"id": pa.array(np.arange(start, start + rows, dtype=np.int64)), "odd": [i % 2 == 1 for i in range(rows)]}
    )


def test_write_table_makes_row_groups_of_split_rows(tmp_path: Path) -> None:
    spec = write_table(f"parquet:{tmp_path / 'p'}", numbers(0, 2500), split_rows=1000)
    assert spec.files is not None and [file.row_groups for file in spec.files] == [(1000, 1000, 500)]
    source = open_source(spec)
    assert [(split.start, split.end) for split in source.splits] == [(0, 1000), (0, 1000), (0, 500)]
    assert [row for batch in TableDataset(spec, batch_size=700) for row in batch["id"].tolist()] == list(range(2500))


def test_file_folder_and_glob_name_the_same_sorted_files(tmp_path: Path) -> None:
    for number in (2, 0, 1):
        pq.write_table(numbers(number * 10, 10), tmp_path / f"part-{number}.parquet")
    (tmp_path / "_SUCCESS").write_text("")
    (tmp_path / ".part-9.parquet").write_bytes(b"hidden")
    folder = TableSpec(f"parquet:{tmp_path}").resolve()
    glob = TableSpec(f"parquet:{tmp_path}/part-*.parquet").resolve()
    assert folder.files == glob.files
    assert folder.files is not None and [Path(file.path).name for file in folder.files] == [
        "part-0.parquet",
        "part-1.parquet",
        "part-2.parquet",
    ]
    assert folder.version == glob.version
    single = TableSpec(f"parquet:{tmp_path}/part-1.parquet").resolve()
    assert [row for batch in TableDataset(single) for row in batch["id"].tolist()] == list(range(10, 20))
    with pytest.raises(FileNotFoundError, match="no Parquet file or folder at"):
        TableSpec(f"parquet:{tmp_path}/missing").resolve()
    with pytest.raises(FileNotFoundError, match="names no Parquet files"):
        TableSpec(f"parquet:{tmp_path}/*.csv").resolve()


def test_take_reads_positions_after_the_filter(tmp_path: Path) -> None:
    spec = write_table(f"parquet:{tmp_path / 'p'}", numbers(0, 300), split_rows=100)
    plain = open_source(TableSpec(spec.uri, files=spec.files))
    assert plain.take([Take(1, [5, 0, 5])]).column("id").to_pylist() == [105, 100, 105]
    assert plain.take([Take(2, [1]), Take(0, [7, 7]), Take(2, [0])]).column("id").to_pylist() == [201, 7, 7, 200]
    assert plain.take([]).num_rows == 0
    assert plain.count([WorkItem(2, 40, 100)]) == [60]
    odd = open_source(TableSpec(spec.uri, columns=["id"], filter="odd = TRUE", files=spec.files))
    assert odd.take([Take(2, [0, 49, 3])]).column("id").to_pylist() == [201, 299, 207]
    assert odd.take([Take(1, [0]), Take(0, [49])]).column("id").to_pylist() == [101, 99]
    assert odd.count([WorkItem(0, 0, 100), WorkItem(1, 10, 21)]) == [50, 5]
    with pytest.raises(IndexError):
        odd.take([Take(0, [50])])


def test_files_of_another_schema_read_as_their_union(tmp_path: Path) -> None:
    # More in test_parquet_lake.py: a column a file lacks is null in its rows.
    pq.write_table(numbers(0, 10), tmp_path / "a.parquet")
    pq.write_table(numbers(10, 10).drop_columns(["odd"]), tmp_path / "b.parquet")
    spec = TableSpec(f"parquet:{tmp_path}").resolve()
    assert [row for batch in TableDataset(spec, columns=["id"]) for row in batch["id"].tolist()] == list(range(20))
    with pytest.raises(NullError, match=r"column 'odd' is null .* row 10"):
        list(TableDataset(spec))


@pytest.mark.slow
def test_a_version_of_more_files_than_the_open_file_limit_reads(tmp_path: Path) -> None:
    # 400 files under a limit of 256 open files: every pass (each read thread's, up to 4, and
    # each thread's of a map-style take) keeps at most 32 of them open.
    for part in range(400):
        pq.write_table(numbers(part * 3, 3), tmp_path / f"part-{part:05d}.parquet")
    script = textwrap.dedent(
        f"""
        import resource
        from spiral_lightning import TableDataset, TableMapDataset
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        uri = "parquet:{tmp_path}"
        ids = [int(i) for batch in TableDataset(uri, batch_size=100) for i in batch["id"]]
        taken = [int(row["id"]) for row in TableMapDataset(uri, read_threads=2).__getitems__(list(range(1199, -1, -5)))]
        print(ids == list(range(1200)), taken == list(range(1199, -1, -5)))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.split() == ["True", "True"]


def rewrite(path: Path, table: pa.Table) -> None:
    pq.write_table(table, path)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def test_changed_added_and_removed_files_are_named(tmp_path: Path) -> None:
    pq.write_table(numbers(0, 10), tmp_path / "a.parquet")
    pq.write_table(numbers(10, 10), tmp_path / "b.parquet")
    spec = TableSpec(f"parquet:{tmp_path}").resolve()
    rewrite(tmp_path / "a.parquet", numbers(100, 10))
    (tmp_path / "b.parquet").unlink()
    pq.write_table(numbers(20, 10), tmp_path / "c.parquet")
    with pytest.raises(ValueError, match=r"changed since version parquet-\w+ was planned") as error:
        open_source(spec)
    message = str(error.value)
    assert f"added {str(tmp_path / 'c.parquet')!r}" in message
    assert f"removed {str(tmp_path / 'b.parquet')!r}" in message
    assert f"changed {str(tmp_path / 'a.parquet')!r}" in message


def test_a_file_changed_between_epochs_fails_loudly_in_process(tmp_path: Path) -> None:
    spec = write_table(f"parquet:{tmp_path / 'p'}", numbers(0, 4000), split_rows=1000)
    dataset = TableDataset(spec, batch_size=500)
    assert [int(i) for batch in dataset for i in batch["id"]] == list(range(4000))
    # The source stays open in this process; the next pass must still notice the new file.
    rewrite(tmp_path / "p" / "part-00000.parquet", numbers(0, 4000))
    with pytest.raises(ValueError, match=r"changed '.*part-00000\.parquet'.*rows of another version are never mixed"):
        next(iter(dataset))


def test_a_file_rewritten_in_place_mid_pass_fails_before_any_row_of_it_is_delivered(tmp_path: Path) -> None:
    # Uncompressed plain pages put the new file's values at the old offsets, so an open file
    # would read them as rows of the planned version without the check after each read.
    layout = {"row_group_size": 1000, "compression": "none", "use_dictionary": False, "write_statistics": False}
    path = tmp_path / "a.parquet"
    pq.write_table(numbers(0, 4000), path, **layout)
    spec = TableSpec(f"parquet:{path}").resolve()
    # Read in line: a thread reading ahead would have read (and checked) every row group by now.
    batches = iter(TableDataset(spec, batch_size=500, read_ahead=0))
    delivered = [int(i) for _ in range(2) for i in next(batches)["id"]]
    pq.write_table(numbers(100_000, 4000), path, **layout)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    with pytest.raises(ValueError, match=rf"changed {str(path)!r} while it was read.*never mixed in") as error:
        delivered += [int(i) for batch in batches for i in batch["id"]]
    assert "resolve the spec again" in str(error.value)
    assert delivered == list(range(1000))


def test_a_take_from_a_file_rewritten_in_place_fails(tmp_path: Path) -> None:
    spec = write_table(f"parquet:{tmp_path / 'p'}", numbers(0, 4000), split_rows=1000)
    dataset = TableMapDataset(spec, read_threads=1)
    assert int(dataset[1500]["id"]) == 1500
    rewrite(tmp_path / "p" / "part-00000.parquet", numbers(100_000, 4000))
    with pytest.raises(ValueError, match=r"changed '.*part-00000\.parquet' while it was read"):
        dataset.__getitems__([2500, 10])


@pytest.mark.slow
def test_a_file_changed_mid_epoch_fails_loudly_in_the_worker(tmp_path: Path) -> None:
    spec = write_table(f"parquet:{tmp_path / 'p'}", numbers(0, 4000), split_rows=1000)
    loader = DataLoader(
        TableDataset(spec, batch_size=500), batch_size=None, num_workers=1, multiprocessing_context="forkserver"
    )
    assert len(list(loader)) == 8
    rewrite(tmp_path / "p" / "part-00000.parquet", numbers(0, 4000))
    with pytest.raises(ValueError, match=r"changed '.*part-00000\.parquet'.*rows of another version are never mixed"):
        next(iter(loader))
