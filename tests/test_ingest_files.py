"""Ingest of real CSV, Parquet and JSON-lines files into tables, through ``spiral-lightning ingest
rows`` run in process and through ``ingest_files``, read back through TableDataset."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from spiral_lightning import TableDataset, TableSpec
from spiral_lightning.lightning.cli import main
from spiral_lightning.sources.ingest_files import FilesReport, IngestError, find_files, ingest_files


def read_back(uri: str, batch_size: int) -> dict[str, list[Any]]:
    """Every row of the table at ``uri``, column by column, through ``TableDataset``."""
    rows: dict[str, list[Any]] = {}
    for batch in TableDataset(TableSpec(uri), batch_size=batch_size):
        assert len(batch["id"]) <= batch_size
        for name, values in batch.items():
            rows.setdefault(name, []).extend(values.tolist() if isinstance(values, torch.Tensor) else values)
    return rows


def run_cli(*arguments: str) -> int:
    """``spiral-lightning ingest rows ...`` in process: its exit status."""
    try:
        main(["ingest", "rows", *arguments])
    except SystemExit as exit:
        return int(exit.code or 0)
    return 0


def write_csv(path: Path, header: str, rows: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([header, *rows]) + "\n")


def csv_folder(root: Path) -> Path:
    """Three CSV files of 4, 3 and 5 rows (ids 0..11 in name order), written out of name order,
    plus a file ingest leaves alone."""
    src = root / "csv"
    for name, first, count in [("c.csv", 7, 5), ("a.csv", 0, 4), ("b.csv", 4, 3)]:
        write_csv(src / name, "id,name,score", [f"{i},row {i},{i / 4}" for i in range(first, first + count)])
    (src / "README.txt").write_text("not rows")
    return src


def test_cli_ingests_a_csv_folder_in_name_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = csv_folder(tmp_path)
    assert run_cli(str(src), str(tmp_path / "t"), "--split-rows", "5", "--quiet") == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"wrote 12 rows of 3 columns from 3 files to spiral:{tmp_path / 't'}?") and err == ""
    uri = out.split(" to ", 1)[1].strip()
    rows = read_back(uri, batch_size=5)
    assert rows["id"] == list(range(12))
    assert rows["name"] == [f"row {i}" for i in range(12)]
    assert rows["score"] == [i / 4 for i in range(12)]
    assert TableDataset(TableSpec(uri)).source().splits[0].end == 5  # --split-rows reached the table


def test_parquet_files_from_a_glob_unify_int32_with_int64(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "pq"
    src.mkdir()
    for part, (start, kind) in enumerate([(0, pa.int32()), (3, pa.int64()), (7, pa.int32())]):
        ids = list(range(start, start + 3 + part))
        table = pa.table({"id": pa.array(ids, kind), "value": pa.array([i * 1.5 for i in ids])})
        pq.write_table(table, src / f"part-{part}.parquet", row_group_size=2)
    (src / "other.csv").write_text("id\n99\n")
    assert run_cli(str(src / "part-*.parquet"), f"parquet:{tmp_path / 't'}", "--quiet") == 0
    out = capsys.readouterr().out
    assert out == f"wrote 12 rows of 2 columns from 3 files to parquet:{tmp_path / 't'}\n"
    assert pq.read_schema(next((tmp_path / "t").glob("*.parquet"))).field("id").type == pa.int64()
    rows = read_back(f"parquet:{tmp_path / 't'}", batch_size=4)
    assert rows["id"] == list(range(12)) and rows["value"] == [i * 1.5 for i in range(12)]


def test_json_lines_files_read_back_row_for_row(tmp_path: Path) -> None:
    src = tmp_path / "json"
    src.mkdir()
    lines = [{"id": i, "tag": f"t{i % 3}", "weight": i + 0.5} for i in range(9)]
    (src / "one.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines[:5]))
    (src / "two.ndjson").write_text("".join(json.dumps(line) + "\n" for line in lines[5:]))
    report = ingest_files(src, f"spiral:{tmp_path / 't'}", split_rows=4, progress=False)
    assert isinstance(report, FilesReport)
    assert (report.rows, report.columns) == (9, ("id", "tag", "weight"))
    assert report.files == (str(src / "one.jsonl"), str(src / "two.ndjson"))
    rows = read_back(report.spec.uri, batch_size=2)
    assert rows == {name: [line[name] for line in lines] for name in ("id", "tag", "weight")}


def test_a_malformed_csv_exits_1_naming_the_file_and_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = csv_folder(tmp_path)
    write_csv(src / "b.csv", "id,name,score", ["4,row 4,1.0", "5,row 5,1.25,extra", "6,row 6,1.5"])
    dest = tmp_path / "t"
    assert run_cli(str(src), str(dest), "--split-rows", "1") == 1
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert line.startswith("spiral-lightning ingest: error: ") and f"{src / 'b.csv'}" in line
    assert "Expected 3 columns, got 4" in line and f"nothing was left in spiral:{dest}" in line
    assert not dest.exists()  # a.csv's rows were written before b.csv failed, and were removed


def test_a_failed_ingest_leaves_an_empty_destination_empty(tmp_path: Path) -> None:
    src = csv_folder(tmp_path)
    write_csv(src / "c.csv", "id,name,score", ["7,row 7,oops"])
    dest = tmp_path / "t"
    dest.mkdir()
    with pytest.raises(IngestError, match=r"c\.csv: in column 'score': CSV conversion error to double"):
        ingest_files(src, f"parquet:{dest}", split_rows=1, progress=False)
    assert dest.is_dir() and list(dest.iterdir()) == []


def test_a_later_file_that_breaks_the_inferred_types_names_column_and_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "csv"
    write_csv(src / "a.csv", "id,zip", ["0,1000", "1,2000"])
    write_csv(src / "b.csv", "id,zip", ["2,3000", "3,12A45"])
    assert run_cli(str(src), str(tmp_path / "t"), "--quiet") == 1
    line = capsys.readouterr().err.strip()
    assert f"{src / 'b.csv'}: in column 'zip': CSV conversion error to int64: invalid value '12A45'" in line
    assert "--column-types zip=<type>" in line
    assert run_cli(str(src), str(tmp_path / "t"), "--quiet", "--column-types", "zip=string") == 0
    uri = capsys.readouterr().out.split(" to ", 1)[1].strip()
    assert read_back(uri, batch_size=4)["zip"] == ["1000", "2000", "3000", "12A45"]


def test_mismatched_schemas_are_refused_naming_both_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "csv"
    write_csv(src / "a.csv", "id,name", ["0,x"])
    write_csv(src / "b.csv", "id,label", ["1,y"])
    assert run_cli(str(src), str(tmp_path / "t"), "--quiet") == 1
    line = capsys.readouterr().err.strip()
    assert f"{src / 'b.csv'}: its columns ['id', 'label'] differ from those of {src / 'a.csv'}" in line
    assert "lacks ['name'] and adds ['label']" in line
    assert not (tmp_path / "t").exists()
    parquet = tmp_path / "pq"
    parquet.mkdir()
    pq.write_table(pa.table({"id": [0], "name": ["x"]}), parquet / "a.parquet")
    pq.write_table(pa.table({"id": [1], "name": [2]}), parquet / "b.parquet")
    with pytest.raises(IngestError) as refused:
        ingest_files(parquet, f"spiral:{tmp_path / 'u'}", progress=False)
    assert str(refused.value).startswith(
        f"{parquet / 'b.parquet'}: its columns do not fit those of {parquet / 'a.parquet'}"
    )
    assert "string vs int64" in str(refused.value)


def test_progress_shows_on_stderr_unless_quiet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = csv_folder(tmp_path)
    assert run_cli(str(src), str(tmp_path / "a")) == 0
    err = capsys.readouterr().err
    assert "ingest rows: 100%" in err and "12 rows, file 3/3" in err
    assert run_cli(str(src), str(tmp_path / "b"), "--quiet") == 0
    assert capsys.readouterr().err == ""
    ingest_files(src, f"spiral:{tmp_path / 'c'}", progress=False)
    assert capsys.readouterr().err == ""


def test_sources_that_name_no_single_format_are_refused(tmp_path: Path) -> None:
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.csv").write_text("id\n0\n")
    (tmp_path / "mixed" / "b.jsonl").write_text('{"id": 1}\n')
    (tmp_path / "mixed" / "notes.txt").write_text("not rows")
    with pytest.raises(ValueError, match="holds files of 2 formats"):
        find_files(tmp_path / "mixed")
    with pytest.raises(FileNotFoundError, match="no file matches"):
        find_files(tmp_path / "*.parquet")
    with pytest.raises(ValueError, match=r"is not a \.csv"):
        find_files(tmp_path / "mixed" / "*")
    with pytest.raises(ValueError, match=r"column types name columns \['nope'\]"):
        ingest_files(tmp_path / "mixed" / "a.csv", f"spiral:{tmp_path / 't'}", column_types={"nope": "int64"})
    with pytest.raises(ValueError, match="not a pyarrow type name"):
        ingest_files(tmp_path / "mixed" / "a.csv", f"spiral:{tmp_path / 't'}", column_types={"id": "integer"})


def test_json_lines_types_come_from_the_first_file_unless_given(tmp_path: Path) -> None:
    src = tmp_path / "json"
    src.mkdir()
    (src / "a.jsonl").write_text('{"id": 0, "weight": 1, "tag": "x"}\n{"id": 1, "weight": 2, "tag": "y"}\n')
    (src / "b.jsonl").write_text('{"id": 2, "weight": 2.5}\n')  # no tag: a null there
    with pytest.raises(IngestError, match=r"b\.jsonl: Failed to convert JSON to int64.*--column-types NAME=TYPE"):
        ingest_files(src, f"parquet:{tmp_path / 't'}", progress=False)
    assert not (tmp_path / "t").exists()
    report = ingest_files(src, f"parquet:{tmp_path / 't'}", column_types={"weight": "float64"}, progress=False)
    assert report.columns == ("id", "weight", "tag")
    table = pq.read_table(tmp_path / "t")
    assert table.to_pydict() == {"id": [0, 1, 2], "weight": [1.0, 2.0, 2.5], "tag": ["x", "y", None]}


def test_parquet_values_the_unified_type_cannot_hold_are_refused(tmp_path: Path) -> None:
    src = tmp_path / "pq"
    src.mkdir()
    pq.write_table(pa.table({"id": pa.array([0, 1], pa.int64())}), src / "a.parquet")
    pq.write_table(pa.table({"id": pa.array([2, 2**63], pa.uint64())}), src / "b.parquet")
    with pytest.raises(IngestError, match=r"b\.parquet: column 'id': Integer value 9223372036854775808"):
        ingest_files(src, f"spiral:{tmp_path / 't'}", progress=False)
    assert not (tmp_path / "t").exists()
    ingest_files(src, f"parquet:{tmp_path / 't'}", column_types={"id": "string"}, progress=False)
    assert pq.read_table(tmp_path / "t")["id"].to_pylist() == ["0", "1", "2", str(2**63)]
