"""The ``spiral-lightning`` command line: Lightning's ``fit``, ``validate``, ``test`` and
``predict`` over a SpiralDataModule, configured by YAML files (``--config``) and flags, and
``ingest images|videos|rows SRC DEST``, which turns a class-per-subfolder folder, or CSV, Parquet or
JSON-lines files, into a table, ``bench URI``, which reads a table for a few seconds under each
loader setting and prints its rates and the setting to use, and ``record FOLDER``, which prints the
stored rows each training step of a recorded run read.

The model and the data module are named by ``class_path`` in the config, so any LightningModule
trains on any SpiralDataModule subclass; ``configs/demo.yaml`` is a complete example.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from spiral_lightning.core.spec import TableSpec
from spiral_lightning.datasets.record import rows
from spiral_lightning.media.ingest import ingest_images, ingest_videos
from spiral_lightning.sources.ingest_files import ingest_files


def _positive(text: str) -> int:
    """A whole number of at least 1, or argparse's error naming the option."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    """A number of seconds above 0, or argparse's error naming the option."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, not {text!r}")
    return seconds


def _workers(text: str) -> list[int]:
    """Worker counts separated by commas (``0,2``), or argparse's error naming the option."""
    items = text.split(",")
    if not all(item.strip().isdigit() for item in items):
        raise argparse.ArgumentTypeError(f"must be whole numbers separated by commas (such as 0,2), not {text!r}")
    return [int(item) for item in items]


def _read_threads(text: str) -> list[int | None]:
    """Thread counts of at least 1 or ``auto`` (None) separated by commas, or argparse's error."""
    items = [item.strip() for item in text.split(",")]
    if not all(item == "auto" or (item.isdigit() and int(item) > 0) for item in items):
        raise argparse.ArgumentTypeError(f"must be counts of at least 1 or auto, separated by commas, not {text!r}")
    return [None if item == "auto" else int(item) for item in items]


def _option(text: str) -> tuple[str, str]:
    """``KEY=VALUE``, or argparse's error naming the option."""
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE (such as aws_region=eu-west-1), not {text!r}")
    return key, value


def _column_type(text: str) -> tuple[str, str]:
    """``name=type``, or argparse's error naming the option."""
    name, equals, kind = text.partition("=")
    if not equals or not name or not kind:
        raise argparse.ArgumentTypeError(f"must be name=type (such as zip=string), not {text!r}")
    return name, kind


def ingest(argv: Sequence[str]) -> None:
    """``ingest images|videos|rows SRC DEST``: write SRC as a new table at DEST; a refusal (no such
    folder, DEST not empty, no file that decodes, a file that does not parse) is one line on
    stderr and exit status 1."""
    parser = argparse.ArgumentParser(
        prog="spiral-lightning ingest",
        description="Write a class-per-subfolder folder of images or videos as a new table, with a label column "
        "and the class names in the table's metadata (files that do not decode, and for videos still images, are "
        "listed, not written); or, with 'rows', the rows of CSV, Parquet or JSON-lines files (.csv, .parquet, "
        ".jsonl, .ndjson), streamed, with the columns they have.",
    )
    parser.add_argument("kind", choices=["images", "videos", "rows"])
    parser.add_argument(
        "src",
        help="images, videos: the folder, one subfolder per class; rows: a file, a folder (its files of one format, "
        "in sorted order) or a quoted glob",
    )
    parser.add_argument(
        "dest", help="a new table: a folder (a local Spiral table), spiral:<folder> or parquet:<folder>"
    )
    parser.add_argument("--split-rows", type=_positive, default=None, help="rows per split (row group)")
    parser.add_argument(
        "--column-types",
        type=_column_type,
        action="append",
        default=[],
        metavar="NAME=TYPE",
        help="rows: a column's type (int64, float64, string, bool, date32, timestamp[ms], ...), once per column; CSV "
        "and JSON-lines types are otherwise inferred from the first file's first block",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.column_types and args.kind != "rows":
        parser.error("--column-types is for 'ingest rows'")
    dest = args.dest if ":" in args.dest else f"spiral:{args.dest}"
    options: dict[str, Any] = {} if args.split_rows is None else {"split_rows": args.split_rows}
    try:
        if args.kind == "rows":
            written = ingest_files(
                args.src, dest, column_types=dict(args.column_types), progress=not args.quiet, **options
            )
        else:
            write = ingest_images if args.kind == "images" else ingest_videos
            report = write(args.src, dest, progress=not args.quiet, **options)
    except (OSError, ValueError) as error:
        message = " ".join([str(error), *getattr(error, "__notes__", ())])
        parser.exit(1, f"{parser.prog}: error: {message}\n")
    if args.kind == "rows":
        read = f"{len(written.files)} file" + ("" if len(written.files) == 1 else "s")
        print(f"wrote {written.rows} rows of {len(written.columns)} columns from {read} to {written.spec.uri}")
        return
    print(f"wrote {report.rows} rows of {len(report.classes)} classes {list(report.classes)} to {report.spec.uri}")
    if report.bad:
        files = "file that does" if len(report.bad) == 1 else "files that do"
        print(f"left out {len(report.bad)} {files} not decode, listed on stderr")


def bench(argv: Sequence[str]) -> None:
    """``bench URI``: read the table for ``--seconds`` under each setting (workers times read
    threads) and print the rates, the setting to use and, when even the best is slow, a hint; a
    refusal (no such table, an unknown column, a filter that does not parse) is one line on stderr
    and exit status 1."""
    # Imported here, as Lightning is in main: each command loads what it runs.
    from spiral_lightning.datasets.bench import MOST_WORKERS, Setting, default_workers, fill, measure, report
    from spiral_lightning.datasets.table import TableDataset

    parser = argparse.ArgumentParser(
        prog="spiral-lightning bench",
        description="Read a table for a few seconds under each setting (DataLoader workers, reading threads) as a "
        "TableDataset in stored order, and print rows/s, MB/s (10^6 bytes of tensors) and batches/s of each, timed "
        "from each worker's first batch on, and the setting to use: before a long job, on the machine it runs on.",
    )
    parser.add_argument(
        "uri",
        help="the table: spiral:<folder>, spiral://<project>/<path>, parquet:<file, folder, glob or store uri>, "
        "sds:<root>; a folder alone is a local Spiral table",
    )
    parser.add_argument(
        "--batch-size", type=_positive, default=1024, metavar="ROWS", help="rows a batch (default 1024)"
    )
    parser.add_argument("--columns", metavar="A,B", help="the columns to read, separated by commas (default: all)")
    parser.add_argument(
        "--filter", metavar="TEXT", help="the rows to read, in the filter language (such as 'label < 5')"
    )
    parser.add_argument(
        "--seconds", type=_seconds, default=3.0, metavar="S", help="seconds each setting reads (default 3)"
    )
    tried = default_workers()
    parser.add_argument(
        "--workers",
        type=_workers,
        default=tried,
        metavar="N,N",
        help="DataLoader worker counts to try, separated by commas; 0 reads in this process (default: 0 and the "
        f"cores here, at most {MOST_WORKERS}: {','.join(map(str, tried))})",
    )
    parser.add_argument(
        "--read-threads",
        type=_read_threads,
        default=[None],
        metavar="N,N",
        help="reading threads a process to try, separated by commas; auto is twice the process's share of the cores "
        "(default: auto)",
    )
    parser.add_argument(
        "--decoded-cache",
        metavar="FOLDER",
        help="also measure each setting reading a decoded cache in this local folder (decoded_cache_dir), filled by "
        "one pass first, with the folder's free space as its budget: the rate of every epoch after the first",
    )
    parser.add_argument(
        "--storage-option",
        type=_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="how to reach a Parquet table in an object store (aws_region=..., aws_endpoint=...), once per option; "
        "keys not given come from the store's environment",
    )
    args = parser.parse_args(argv)
    uri = args.uri if ":" in args.uri else f"spiral:{args.uri}"
    columns = None if args.columns is None else tuple(name.strip() for name in args.columns.split(","))
    settings = [Setting(count, threads) for count in dict.fromkeys(args.workers) for threads in args.read_threads]
    try:
        table = TableSpec(uri, columns=columns, filter=args.filter, storage_options=dict(args.storage_option) or None)
        # Built once first: a bad column or filter fails before any setting reads, and every
        # setting reads the version pinned here.
        spec = TableDataset(table).spec
        selected = "all columns" if spec.columns is None else "columns " + ",".join(spec.columns)
        count = len(settings) * (1 if args.decoded_cache is None else 2)
        print(
            f"reading {spec.uri} (version {spec.version}), {selected}"
            + ("" if spec.filter is None else f", filter {spec.filter!r}")
            + f", batch_size={args.batch_size}: {count} setting{'s' if count > 1 else ''}, "
            f"{args.seconds:g} s each after start-up",
            flush=True,
        )
        results = [measure(spec, setting, batch_size=args.batch_size, seconds=args.seconds) for setting in settings]
        if args.decoded_cache is not None:
            Path(args.decoded_cache).mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(args.decoded_cache).free
            cached = replace(spec, decoded_cache_dir=args.decoded_cache, decoded_cache_bytes=max(1, free))
            seconds, held = fill(cached, args.batch_size)
            print(f"decoded cache filled in {seconds:.1f} s: {held / 1e6:,.1f} MB in {args.decoded_cache}", flush=True)
            results += [
                measure(cached, replace(setting, decoded=True), batch_size=args.batch_size, seconds=args.seconds)
                for setting in settings
            ]
    except (OSError, ValueError) as error:
        message = " ".join([str(error), *getattr(error, "__notes__", ())])
        parser.exit(1, f"{parser.prog}: error: {message}\n")
    print(report(results, args.batch_size))


def _steps(text: str) -> range:
    """``A:B`` as the steps A to B - 1, or one step ``A``."""
    try:
        low, _, high = text.partition(":")
        steps = range(int(low), int(high) if high else int(low) + 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"steps are START:END or one step, not {text!r}") from None
    if not steps:
        raise argparse.ArgumentTypeError(f"the steps {text!r} hold no step: END must be past START")
    return steps


def record(argv: Sequence[str]) -> None:
    """``spiral-lightning record FOLDER [--steps A:B]``: which stored rows each step trained on."""
    parser = argparse.ArgumentParser(
        prog="spiral-lightning record",
        description="Print the stored rows each training step read, from the record folder a "
        "SpiralDataModule(record=...) run wrote: one line per step and rank, its rows as split:start-end ranges "
        "(table/split:start-end for a mixture).",
    )
    parser.add_argument("folder", help="the record folder (SpiralDataModule's record=)")
    parser.add_argument("--steps", type=_steps, metavar="A:B", help="steps A to B - 1 only (default: every step)")
    args = parser.parse_args(argv)
    if not Path(args.folder).is_dir():
        parser.exit(1, f"{parser.prog}: error: no record folder {args.folder!r}\n")
    for step, ranks in rows(args.folder, args.steps).items():
        for rank, ranges in ranks.items():
            # A mixture's ranges name their table first: table/split:start-end.
            print(f"step {step} rank {rank}: " + " ".join(_range(*found) for found in ranges))


def _range(*values: int) -> str:
    """A recorded range as the command prints it: ``split:start-end``, or ``table/split:start-end``."""
    *table, split, start, end = values
    return "".join(f"{number}/" for number in table) + f"{split}:{start}-{end}"


def import_from_working_directory() -> None:
    """Put the working directory first on the import path, as ``python -m`` does, so that a
    config's ``class_path: mymodels.TinyCNN`` finds ``mymodels.py`` beside the user; an installed
    command's path starts at its script's folder instead."""
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)


def main(argv: Sequence[str] | None = None) -> None:
    """Run one command; ``argv`` defaults to the process's arguments."""
    import_from_working_directory()
    arguments = sys.argv[1:] if argv is None else list(argv)
    if arguments[:1] == ["ingest"]:
        ingest(arguments[1:])
        return
    if arguments[:1] == ["bench"]:
        bench(arguments[1:])
        return
    if arguments[:1] == ["record"]:
        record(arguments[1:])
        return
    # Imported here: Lightning's imports take seconds that ingest and bench do without (and so does
    # the forkserver of their DataLoader workers, which imports what the main script imports).
    from spiral_lightning.lightning.trainer_cli import run

    run(None if argv is None else arguments)


if __name__ == "__main__":
    main()
