"""Runs every benchmark in ``benchmarks/`` and writes the report: ``benchmarks/RESULTS.md`` (each
benchmark's table, every target met or not, the machine and the versions) and
``benchmarks/results.png`` (a bar per target: the measured ratio beside the target ratio).

Run ``.venv/bin/python benchmarks/run.py``: quick settings by default (the whole report in a few
minutes on 2 cores); ``--full`` runs each benchmark with its own defaults instead, ``--only
throughput resume_cost`` runs some of them, ``--out`` writes the report elsewhere.

A *target* is a ratio one benchmark's table must reach, as its issue set it: the row and column
it is read from, and the bound. A benchmark this script has no settings for (a new file in
``benchmarks/``) still runs, with its own defaults, and its table is reported without a target.
Each benchmark runs in its own process, one after another; what it prints to stdout is its
report, and its markdown tables are copied into RESULTS.md as they are.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: One parsed markdown table: its header cells, then each row's cells.
Table = tuple[list[str], list[list[str]]]


@dataclass(frozen=True)
class Target:
    """A ratio to reach: the cell in ``column`` of the rows whose first cell ``row`` matches (a
    regular expression; the worst of several rows counts), in the ``table``-th table printed,
    divided by that column's cell in the row named ``over`` when the table has no ratio column;
    at least (``at_least``) or at most ``bound``."""

    name: str
    row: str
    column: str
    bound: float
    at_least: bool = True
    table: int = 0
    over: str | None = None

    def measure(self, tables: list[Table]) -> float | None:
        """The measured ratio, ``None`` when the benchmark printed no such cell."""
        if self.table >= len(tables):
            return None
        header, rows = tables[self.table]
        if self.column not in header:
            return None
        column = header.index(self.column)
        values = [_ratio(cells[column]) for cells in rows if re.search(self.row, cells[0]) and column < len(cells)]
        found = [value for value in values if value is not None]
        if self.over is not None:
            base = [_ratio(cells[column]) for cells in rows if cells[0] == self.over and column < len(cells)]
            found = [value / base[0] for value in found] if base and base[0] else []
        if not found:
            return None
        return min(found) if self.at_least else max(found)

    def met(self, value: float) -> bool:
        return value >= self.bound if self.at_least else value <= self.bound


@dataclass(frozen=True)
class Benchmark:
    """A script in ``benchmarks/``, its quick flags and its targets."""

    script: str
    quick: list[str] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)


BENCHMARKS = [
    Benchmark(
        "throughput",
        ["--rows", "2000000", "--repeats", "5"],
        [
            # The dataset as users get it (its defaults), in process; not the in-line row beside it.
            Target(
                "TableDataset in process (every pass reads the table) >= 1.5x raw Spiral `to_reader`",
                r"^`TableDataset\(batch_size=1024\)`, in process$",
                "vs raw to_reader",
                1.5,
            ),
            Target(
                "TableDataset >= 1.1x `ScanDataset`",
                r"^`TableDataset\(batch_size=1024\)`, in process$",
                "vs ScanDataset",
                1.1,
            ),
            Target(
                "TableDataset with `decoded_cache_dir`, 2nd+ pass, >= 1.5x raw Spiral `to_reader`",
                r"^`TableDataset\(batch_size=1024\)` with `decoded_cache_dir`",
                "vs raw to_reader",
                1.5,
            ),
        ],
    ),
    Benchmark(
        "handoff",
        ["--rows", "2000000", "--repeats", "5"],
        [
            Target("`loader(num_workers=2)` >= 0.6x in process at 256 rows", r"^256$", "2 workers / in process", 0.6),
            Target(
                "`loader(num_workers=2)` >= 0.9x in process at 1024 and 4096 rows",
                r"^(1,024|4,096)$",
                "2 workers / in process",
                0.9,
            ),
        ],
    ),
    Benchmark(
        "defaults",
        # Plain columns read at one rate in process and through 2 workers here (a median ratio of 1.00
        # over 15 rounds, single rounds 0.74-1.22x): 5 samples left the ratio anywhere from 0.80x to 0.98x.
        ["--rows", "1000000", "--images", "1000", "--tokens", "5000000", "--samples", "9"],
        [
            Target(
                "`loader()` (no worker setting) >= 0.9x the best worker count: plain columns, images, packed tokens",
                r".",
                "default / best",
                0.9,
            )
        ],
    ),
    Benchmark(
        "parquet_read",
        ["--rows", "1000000", "--repeats", "2"],
        [Target("TableDataset on Parquet >= 0.9x raw pyarrow scan", r"^`TableDataset`$", "/ raw", 0.9)],
    ),
    Benchmark(
        "object_store",
        ["--rows", "500000", "--repeats", "3"],
        [
            Target(
                "TableDataset on S3 behind 20 ms latency >= 1.0x `pq.read_table`",
                r"^S3 \+ [\d.]+ ms latency: `TableDataset`$",
                "vs `pq.read_table` here",
                1.0,
            ),
            Target(
                "requests per pass behind latency <= 1.5x (row groups + files)",
                r"^S3 \+ [\d.]+ ms latency: `TableDataset`$",
                "requests / (row groups + files)",
                1.5,
                at_least=False,
            ),
            Target(
                "cached epoch 2 behind latency >= 0.8x TableDataset on local disk",
                r"^S3 \+ [\d.]+ ms latency: `TableDataset` \+ cache, epoch 2$",
                "vs local-disk `TableDataset`",
                0.8,
            ),
        ],
    ),
    Benchmark(
        "shuffled",
        ["--rows", "1000000", "--repeats", "2"],
        [Target("`Shuffled` (8192-row blocks) >= 0.8x `stripe`", r"^`Shuffled\(block_rows=8192\)`$", "vs stripe", 0.8)],
    ),
    Benchmark(
        "map_access",
        ["--rows", "1000000", "--repeats", "5", "--split-rows", "100000", "50000", "20000"],
        [
            Target(
                "`__getitems__` >= 10x `__getitem__` per row",
                r"^Spiral `__getitem__` per row$",
                "time / Spiral `__getitems__`",
                10.0,
            )
        ],
    ),
    Benchmark(
        "lightning_overhead",
        # Epochs of 0.4 s: at 400,000 rows an epoch took 0.08 s, and one run's ratios spread 0.57-1.16x.
        ["--rows", "2000000", "--repeats", "3"],
        [
            Target(
                "`Trainer.fit` >= 0.8x a bare loop (in process and with 2 workers)",
                r"^Trainer\.fit$",
                "vs bare loop",
                0.8,
            )
        ],
    ),
    Benchmark(
        "media",
        ["--images", "2000", "--videos", "24", "--epochs", "4", "--clip-epochs", "3"],
        [
            Target("image projections >= 1.5x plain Pillow `Dataset`", r"^`TableDataset`", "/ plain", 1.5, table=0),
            Target("clip projections >= 1.0x plain PyAV `Dataset`", r"^`TableDataset`", "/ plain", 1.0, table=1),
        ],
    ),
    Benchmark(
        "ray_read",
        ["--rows", "1000000", "--repeats", "2"],
        [
            Target(
                "`read_table` (Parquet) >= 1.0x `ray.data.read_parquet`",
                r"^read_table \(Parquet\)$",
                "vs read_parquet",
                1.0,
            )
        ],
    ),
    Benchmark(
        "peers",
        # Half the million rows: splits of 25,000 rows, as a real table's, not the 2,500 of a
        # 50,000-row run, whose per-pass and per-read-batch costs hid the decoded cache's gain over
        # Lance (0.65x there, 2.7x here); MosaicML Streaming's one pass (a few thousand rows/s in
        # process) takes most of its three minutes.
        ["--rows", "500000", "--repeats", "3", "--path-seconds", "5"],
        [
            # No result where Lance is not installed (scripts/install-peers.sh installs it).
            Target(
                "TableDataset on Parquet in process >= 1.0x Lance `to_batches`",
                r"^`TableDataset` on Parquet, in process$",
                "vs Lance to_batches",
                1.0,
            ),
            Target(
                "TableDataset on Parquet with `decoded_cache_dir`, 2nd+ pass, >= 1.0x Lance `to_batches`",
                r"^`TableDataset` on Parquet with `decoded_cache_dir`",
                "vs Lance to_batches",
                1.0,
            ),
        ],
    ),
    Benchmark(
        "resume_cost",
        ["--repeats", "5"],
        [
            Target(
                "TableDataset resume at 95% <= 1.5x at 5% (seek)", r"^`TableDataset`", "95% / 5%", 1.5, at_least=False
            ),
            Target(
                "TableDataset resume at 95% of one 3 M-row split <= 1.5x the storage's own seek",
                r"^`TableDataset` in process",
                "vs seek at 95%",
                1.5,
                at_least=False,
                table=1,
            ),
        ],
    ),
    Benchmark(
        "sds",
        [],
        [
            Target(
                "`TableMapDataset` on SDS >= 2x the guide's adapter",
                r"^TableMapDataset$",
                "adapter time / path time",
                2.0,
            )
        ],
    ),
    Benchmark(
        "planning",
        ["--splits", "10000", "100000", "1000000", "--ranks", "8", "4096", "--repeats", "1"],
        [
            # Each measure as a fraction of the bound at 10^6 splits and 4,096 x 16.
            Target("one consumer's list <= 0.1 s", r"^one consumer's list", "of the target", 1.0, at_least=False),
            Target("a rank's counts per epoch <= 2 s", r"^counts, ", "of the target", 1.0, at_least=False),
            Target(
                "re-plan of 65,536 states onto 2,048 x 16 <= 5 s",
                r"^re-plan onto",
                "of the target",
                1.0,
                at_least=False,
            ),
            Target(
                "a consumer's state after a re-plan <= 1 KB",
                r"^one consumer's state",
                "of the target",
                1.0,
                at_least=False,
            ),
            Target(
                "all consumers' states and lineage <= 64 MB",
                r"^every consumer's state",
                "of the target",
                1.0,
                at_least=False,
            ),
        ],
    ),
    Benchmark(
        "step_record",
        ["--rows", "1000000", "--repeats", "2"],
        [
            Target(
                "a step record adds <= 0.2 ms a step (2% of a 10 ms step), in stored order and shuffled",
                r"^(stored order|shuffle=True)",
                "ms a step",
                0.2,
                at_least=False,
            )
        ],
    ),
    Benchmark(
        "token_batches",
        ["--repeats", "2"],
        [
            Target(
                "`TokenBatchDataset` padded, grouped by length: padding share <= 0.10 of its batches",
                r"^`TokenBatchDataset` padded$",
                "padding share",
                0.10,
                at_least=False,
            )
        ],
    ),
    Benchmark(
        "packing",
        ["--repeats", "5"],
        [
            Target(
                "`PackedDataset` (its defaults) >= 0.7x a raw scan of the token column flattened to numpy",
                r"^`PackedDataset`$",
                "vs raw scan",
                0.7,
            )
        ],
    ),
]


def _ratio(cell: str) -> float | None:
    """The number in a cell such as ``1.05x`` or ``1,473,481``; ``None`` when there is none."""
    match = re.search(r"-?[\d,]*\.?\d+", cell)
    return float(match[0].replace(",", "")) if match else None


def tables_in(text: str) -> list[Table]:
    """The markdown tables in ``text``, in order."""
    tables: list[Table] = []
    block: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if len(block) >= 2:
            cells = [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in block]
            tables.append((cells[0], cells[2:]))
        block = []
    return tables


@dataclass
class Outcome:
    """What one benchmark printed, how long it ran, and each target's measured ratio."""

    benchmark: Benchmark
    stdout: str
    seconds: float
    returncode: int
    ratios: list[tuple[Target, float | None]]


def run(benchmark: Benchmark, full: bool, timeout: float) -> Outcome:
    """Runs one benchmark script in its own process and reads its targets from its tables."""
    command = [sys.executable, str(HERE / f"{benchmark.script}.py"), *([] if full else benchmark.quick)]
    began = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
        stdout, returncode = done.stdout, done.returncode
        if returncode:
            stdout += f"\n\nfailed with status {returncode}:\n\n```\n{done.stderr[-3000:]}\n```\n"
    except subprocess.TimeoutExpired:
        stdout, returncode = f"did not finish within {timeout:.0f} s", -1
    seconds = time.perf_counter() - began
    tables = tables_in(stdout)
    return Outcome(benchmark, stdout, seconds, returncode, [(t, t.measure(tables)) for t in benchmark.targets])


def machine() -> list[str]:
    """The machine and the versions the numbers were measured with."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    versions = []
    for package in ("torch", "torchdata", "pyarrow", "spiral-sdk", "lightning", "ray", "signal-dataset"):
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package} not installed")
    return [
        f"- Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- Machine: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), {memory:.0f} GiB memory, "
        f"{platform.system()} {platform.release()}",
        f"- Python {platform.python_version()}; " + ", ".join(versions),
    ]


def report(outcomes: list[Outcome], full: bool, note: str) -> str:
    """RESULTS.md: the headline of targets, then every benchmark's own output."""
    lines = [
        "# Benchmark results",
        "",
        "Written by `benchmarks/run.py`"
        + (" with each benchmark's own defaults." if full else " with its quick settings (`--full` for the defaults)."),
        "Ratios measured within one run are the result; absolute rates swing by up to about 30% between runs on",
        "shared machines, so compare rates only inside one table.",
        "",
        *machine(),
    ]
    if note:
        lines += [f"- Note: {note}"]
    lines += ["", "## Targets", "", "| benchmark | target | measured | met |", "| --- | --- | ---: | --- |"]
    for outcome in outcomes:
        for target, value in outcome.ratios:
            measured = "no result" if value is None else f"{value:.2f}x"
            met = "no result" if value is None else ("met" if target.met(value) else "**not met**")
            lines.append(f"| {outcome.benchmark.script} | {target.name} | {measured} | {met} |")
    for outcome in outcomes:
        command = [".venv/bin/python", f"benchmarks/{outcome.benchmark.script}.py"]
        command += [] if full else outcome.benchmark.quick
        lines += [
            "",
            f"## {outcome.benchmark.script}",
            "",
            f"`{' '.join(command)}` ({outcome.seconds:.0f} s)",
            "",
            *[line for line in outcome.stdout.strip().splitlines() if not line.startswith("table ready")],
        ]
    return "\n".join(lines) + "\n"


def chart(outcomes: list[Outcome], path: Path) -> bool:
    """A horizontal bar per target: the measured ratio, and a mark at the target's bound; no
    chart (``False``) when no target has a result, as when every benchmark run failed."""
    measured = [(o.benchmark.script, t, v) for o in outcomes for t, v in o.ratios if v is not None]
    if not measured:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(10, 0.5 * len(measured) + 1.5))
    labels = [f"{script}: {target.name}" for script, target, _ in measured]
    colors = ["tab:green" if target.met(value) else "tab:red" for _, target, value in measured]
    positions = range(len(measured))
    axes.barh(positions, [value for _, _, value in measured], color=colors)
    axes.scatter([target.bound for _, target, _ in measured], positions, marker="|", s=400, color="black", zorder=3)
    for position, (_, target, value) in zip(positions, measured, strict=True):
        # Beyond both the bar and the target mark, so the number never sits on the mark.
        place = max(value, target.bound)
        axes.annotate(f"{value:.2f}x", (place, position), xytext=(6, -4), textcoords="offset points", fontsize=8)
    axes.set_yticks(list(positions), labels, fontsize=8)
    axes.invert_yaxis()
    axes.set_xscale("log")
    axes.set_xlabel("ratio to the baseline (log scale); mark: target; green: met, red: not met")
    axes.set_title("spiral-lightning benchmarks: ratios against each baseline")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


def main() -> None:
    known = {benchmark.script: benchmark for benchmark in BENCHMARKS}
    found = sorted(path.stem for path in HERE.glob("*.py") if path.stem not in ("run", "__init__"))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=found, help="run these benchmarks only")
    parser.add_argument("--full", action="store_true", help="each benchmark's own defaults instead of quick settings")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds one benchmark may take (default 1200)")
    parser.add_argument("--note", default="", help="a line about the run for RESULTS.md, e.g. other load")
    parser.add_argument("--out", type=Path, default=HERE, help="folder for RESULTS.md and results.png")
    options = parser.parse_args()
    order = [name for name in known if name in found] + [name for name in found if name not in known]
    chosen = [known.get(name, Benchmark(name)) for name in order if not options.only or name in options.only]
    outcomes: list[Outcome] = []
    for benchmark in chosen:
        print(f"running {benchmark.script} ...", flush=True)
        outcomes.append(run(benchmark, options.full, options.timeout))
        print(f"  {outcomes[-1].seconds:.0f} s, status {outcomes[-1].returncode}", flush=True)
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "RESULTS.md").write_text(report(outcomes, options.full, options.note))
    charted = chart(outcomes, options.out / "results.png")
    print(
        f"wrote {options.out / 'RESULTS.md'}"
        + (f" and {options.out / 'results.png'}" if charted else ", no chart: no target has a result")
    )


if __name__ == "__main__":
    main()
