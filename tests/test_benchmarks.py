"""The benchmarks stay runnable: the planning, packing, token-batch, step-record and peers benchmarks run
at a small size and print every target row and path.

Each runs as ``python benchmarks/<name>.py ...`` would, as ``__main__``, in a process forked from
the test process's forkserver (see ``tests/ranks.py``), which imported torch and pyarrow once."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from spiral_lightning.datasets.loader import default_workers
from tests.ranks import run_processes, run_script

ROOT = Path(__file__).resolve().parent.parent


class Done(NamedTuple):
    """How a benchmark's run ended: its exit code (None: killed at the timeout), what it printed
    and what it logged."""

    returncode: int | None
    stdout: str
    stderr: str


def run_benchmark(name: str, args: Sequence[str], tmp_path: Path) -> Done:
    """Run ``benchmarks/<name>.py args`` and return how it ended."""
    printed = tmp_path / f"{name}.out"
    ended = run_processes(_benchmark, [[name, str(printed), *args]], [{}], tmp_path, timeout=500)
    stdout = printed.read_text() if printed.exists() else ""
    return Done(ended.codes[0], stdout, ended.printed)


def _benchmark(argv: Sequence[str]) -> None:
    """In a forked process: run the benchmark ``argv[0]`` with ``argv[2:]``, its prints into the
    file ``argv[1]`` (apart from what it logs, so that no warning splits a table's line)."""
    name, printed, *args = argv
    with open(printed, "w") as out, contextlib.redirect_stdout(out):
        run_script([str(ROOT / "benchmarks" / f"{name}.py"), *args])


def test_the_planning_benchmark_runs_and_prints_every_target_row(tmp_path: Path) -> None:
    done = run_benchmark("planning", ["--splits", "2000", "20000", "--ranks", "4", "32", "--repeats", "1"], tmp_path)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and line.endswith(" |")]
    targets = [row for row in rows if row.endswith(("| yes |", "| NO |"))]
    # Six measures for each of the three policies (whether each is met is the report's business,
    # never a test's: it is a wall-clock number).
    assert len(targets) == 18


def test_the_packing_benchmark_runs_and_prints_every_path(tmp_path: Path) -> None:
    done = run_benchmark("packing", ["--tokens", "200000", "--split-rows", "50", "--repeats", "1"], tmp_path)
    assert done.returncode == 0, done.stderr
    rows = [line.split(" | ")[0] for line in done.stdout.splitlines() if line.startswith("| ")][2:]
    # LitData's own row appears only where litdata imports, which the project does not install.
    assert [row for row in rows if "LitData" not in row] == [
        "| raw scan, flattened to one numpy array",
        "| TokensLoader approach (flat tokens, then blocks)",
        "| `PackedDataset`",
        "| `PackedDataset(read_ahead=0)`",
        "| `PackedDataset(separator=0)`",
    ]
    assert "target PackedDataset >= 0.7x the raw scan" in done.stdout


def test_the_token_batches_benchmark_runs_and_prints_every_path(tmp_path: Path) -> None:
    done = run_benchmark("token_batches", ["--tokens", "200000", "--split-rows", "100", "--repeats", "1"], tmp_path)
    assert done.returncode == 0, done.stderr
    rows = [line.split(" | ")[0] for line in done.stdout.splitlines() if line.startswith("| ")][2:]
    assert [row.split(" (")[0] for row in rows] == [
        "| raw scan, flattened to one numpy array",
        "| fixed rows, padded",
        "| `PackedDataset`",
        "| `TokenBatchDataset` padded",
        "| `TokenBatchDataset` padded, 2 workers",
        "| `TokenBatchDataset` padded, group=False",
        "| `TokenBatchDataset` flat",
    ]
    assert "target TokenBatchDataset padded share < 0.10" in done.stdout


def test_the_step_record_benchmark_runs_and_prints_every_path(tmp_path: Path) -> None:
    done = run_benchmark("step_record", ["--rows", "20000", "--split-rows", "5000", "--repeats", "1"], tmp_path)
    assert done.returncode == 0, done.stderr
    rows = [line.split(" | ")[0] for line in done.stdout.splitlines() if line.startswith("| ")][2:]
    assert rows == [
        "| stored order, num_workers=0",
        "| stored order, num_workers=2",
        "| shuffle=True, num_workers=0",
        "| shuffle=True, num_workers=2",
        "| filtered, stored order, num_workers=0",
        "| filtered, stored order, num_workers=2",
    ]
    assert "target a record adds <= 0.2 ms a step" in done.stdout


def test_the_peers_benchmark_runs_and_prints_every_path(tmp_path: Path) -> None:
    # Every peer skipped: they may be installed here (scripts/install-peers.sh), and their
    # conversions and starts take a minute; this project's paths and the raw pyarrow one still run.
    done = run_benchmark(
        "peers", ["--rows", "4000", "--repeats", "1", "--skip", "lance", "litdata", "streaming", "ray"], tmp_path
    )
    assert done.returncode == 0, done.stderr
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| ")]
    paths = {cells[0].removeprefix("| "): cells[3] for cells in rows if len(cells) == 6}
    measured = [path for path, rate in paths.items() if rate[0].isdigit()]
    assert measured == [
        "`TableDataset` on Parquet, in process",
        "`TableDataset` on Parquet with `decoded_cache_dir`, in process, 2nd+ pass",
        "`TableDataset` on Spiral, in process",
        "`TableDataset` on Spiral with `decoded_cache_dir`, in process, 2nd+ pass",
        "pyarrow `ParquetFile.iter_batches` + `torch.from_numpy`, in process",
        "`TableDataset` on Parquet, `loader(num_workers=2)`, 2nd+ epoch",
        "`TableDataset` on Spiral, `loader(num_workers=2)`, 2nd+ epoch",
    ]
    # The skipped peers still have their rows, saying so.
    assert sum(rate == "skipped (`--skip`)" for rate in paths.values()) == 5
    assert "no result (Lance did not run)" in done.stdout


def test_the_handoff_benchmark_runs_and_prints_every_batch_size(tmp_path: Path) -> None:
    done = run_benchmark("handoff", ["--rows", "20000", "--repeats", "1", "--root", str(tmp_path)], tmp_path)
    assert done.returncode == 0, done.stderr
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| ")][2:]
    assert [row[0] for row in rows] == ["| 256", "| 1,024", "| 4,096"]
    assert all(len(row) == 6 and row[-1].endswith("x |") for row in rows)


def test_the_defaults_benchmark_runs_and_prints_every_workload(tmp_path: Path) -> None:
    done = run_benchmark(
        "defaults",
        ["--rows", "20000", "--images", "24", "--tokens", "100000", "--samples", "1", "--sample-seconds", "0"],
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| ")][2:]
    assert [row[0].removeprefix("| ").split(" (")[0] for row in rows] == [
        "plain columns",
        "JPEGs to float32 3x64x64, batch 64",
        "packed tokens, blocks of 2048, 8 a batch",
    ]
    # The default's resolved count: in process for plain columns and tokens, workers for images.
    assert [row[1] for row in rows] == [
        "`num_workers=0`",
        f"`num_workers={default_workers(True)}`",
        "`num_workers=0`",
    ]
    assert all(len(row) == 6 and row[-1].endswith("x |") for row in rows)
    assert "target the default >= 0.9x the best worker count on every workload" in done.stdout
