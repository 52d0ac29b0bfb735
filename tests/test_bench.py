"""``spiral-lightning bench``: a table read under each setting for a few seconds, its rates, the
setting it recommends, and its refusals as one line and exit status 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from spiral_lightning import TableSpec, write_table
from spiral_lightning.datasets.bench import SLOW_MB_PER_S, Measured, Setting, measure, recommended, report
from spiral_lightning.lightning.cli import main
from spiral_lightning.sources.cache import kept_entries

#: Rows of the test table, and the bytes of one row's tensors: id int64, x float32, emb float32[16].
ROWS = 2_000
ROW_BYTES = 8 + 4 + 16 * 4


@pytest.fixture
def table(tmp_path: Path) -> TableSpec:
    """A Parquet table of ``ROWS`` rows in row groups of 500."""
    generator = np.random.default_rng(0)
    data = pa.table(
        {
            "id": pa.array(np.arange(ROWS, dtype=np.int64)),
            "x": pa.array(generator.random(ROWS, dtype=np.float32)),
            "emb": pa.FixedSizeListArray.from_arrays(pa.array(generator.random(ROWS * 16, dtype=np.float32)), 16),
        }
    )
    return write_table(f"parquet:{tmp_path / 'points'}", data, split_rows=500)


def test_measure_counts_whole_batches_and_their_bytes(table: TableSpec) -> None:
    # 100 divides every pass's 2,000 rows, so every batch is whole, pass after pass.
    result = measure(table, Setting(0, 1), batch_size=100, seconds=0.2)
    assert result.setting == Setting(0, 1)
    assert result.rows > 0
    assert result.seconds >= 0.2
    assert result.rows == result.batches * 100
    assert result.bytes == result.rows * ROW_BYTES
    assert result.rows_per_s == pytest.approx(result.rows / result.seconds)


def test_the_command_prints_every_setting_and_the_one_to_use(
    table: TableSpec, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["bench", table.uri, "--seconds", "0.3", "--workers", "0,1", "--batch-size", "250", "--columns", "id,emb"])
    out = capsys.readouterr().out
    assert f"reading {table.uri} (version parquet-" in out
    assert "columns id,emb, batch_size=250: 2 settings" in out
    lines = out.splitlines()
    assert lines[1].split() == ["setting", "rows/s", "MB/s", "batches/s", "vs", "best"]
    rows = [line for line in lines if line.startswith("num_workers=")]
    assert [row.split()[:2] for row in rows] == [
        ["num_workers=0", "read_threads=auto"],
        ["num_workers=1", "read_threads=auto"],
    ]
    assert "1.00x" in "".join(rows)
    assert "first batch on: process start-up and the first reads are left out" in out
    assert [line for line in lines if line.startswith("recommended: num_workers=")]


def test_the_command_measures_each_setting_again_on_a_filled_decoded_cache(
    table: TableSpec, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "decoded"
    main(["bench", table.uri, "--seconds", "0.2", "--workers", "0", "--decoded-cache", str(folder)])
    out = capsys.readouterr().out
    assert ": 2 settings," in out
    # One pass kept every row group: 4 entries of 500 rows, each about its tensors' bytes.
    assert len(kept_entries(folder)) == 4
    assert f"MB in {folder}" in out.splitlines()[1]
    rows = [line.split() for line in out.splitlines() if line.startswith("num_workers=")]
    assert [row[:3] for row in rows] == [
        ["num_workers=0", "read_threads=auto", rows[0][2]],
        ["num_workers=0", "read_threads=auto", "decoded_cache"],
    ]
    assert not rows[0][2].startswith("decoded")


def recorded(workers: int, rows_per_s: float, batch_bytes: int = 1 << 22) -> Measured:
    """What a setting of ``workers`` would report after reading at ``rows_per_s`` for one second
    in batches of 1,000 rows of ``batch_bytes``."""
    batches = int(rows_per_s) // 1000
    return Measured(Setting(workers), batches * 1000, batches * batch_bytes, batches, 1.0)


def test_the_fewest_workers_within_five_percent_of_the_fastest_are_recommended() -> None:
    assert recommended([recorded(0, 96_000), recorded(2, 100_000), recorded(4, 99_000)]).setting.workers == 0
    assert recommended([recorded(0, 90_000), recorded(2, 100_000), recorded(4, 99_000)]).setting.workers == 2
    shown = report([recorded(0, 90_000), recorded(2, 100_000)], 1000)
    assert "num_workers=0 read_threads=auto" in shown and "0.90x" in shown
    assert "recommended: num_workers=2 read_threads=auto batch_size=1000 (the fastest)" in shown
    assert "hint" not in shown


def test_a_slow_best_gets_a_hint_by_its_batch_size() -> None:
    small = report([recorded(0, 10_000, batch_bytes=64_000)], 1000)
    assert recorded(0, 10_000, batch_bytes=64_000).mb_per_s < SLOW_MB_PER_S
    assert "hint: even the fastest reads 0.6 MB/s in batches of 64.0 kB" in small
    assert "--batch-size than 1000" in small
    large = report([recorded(0, 10_000, batch_bytes=4_000_000)], 1000)
    assert "hint: even the fastest reads 40.0 MB/s in batches of 4.0 MB: reading is the limit" in large


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        (["{missing}"], "no Parquet file or folder at"),
        (["{uri}", "--columns", "id,nosuch"], "unknown columns ['nosuch']"),
        (["{uri}", "--filter", "nosuch < 3"], "unknown column 'nosuch' in the filter"),
        (["{uri}", "--filter", "id <<< 3"], "cannot parse the filter 'id <<< 3'"),
        (["{uri}", "--filter", "id < 0", "--workers", "0"], "has no rows to read under its filter"),
    ],
)
def test_a_refusal_is_one_line_and_status_1(
    table: TableSpec, tmp_path: Path, capsys: pytest.CaptureFixture[str], arguments: list[str], named: str
) -> None:
    filled = [item.format(uri=table.uri, missing=f"parquet:{tmp_path / 'missing'}") for item in arguments]
    with pytest.raises(SystemExit) as exited:
        main(["bench", *filled, "--seconds", "0.1"])
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("spiral-lightning bench: error: ") and named in err
    assert err.count("\n") == 1


def test_bench_starts_without_lightning() -> None:
    """The command's module and the measuring load no Lightning: it would cost the command seconds
    before it reads, and the forkserver of its workers too (it imports the main script's modules)."""
    code = (
        "import sys\n"
        "import spiral_lightning.lightning.cli, spiral_lightning.datasets.bench\n"
        "print([name for name in ('lightning', 'pytorch_lightning', 'jsonargparse') if name in sys.modules])"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
