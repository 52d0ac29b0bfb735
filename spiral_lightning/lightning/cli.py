"""The ``spiral-lightning`` command line: Lightning's ``fit``, ``validate``, ``test`` and
``predict`` over a SpiralDataModule, configured by YAML files (``--config``) and flags, and
``ingest images|videos|rows SRC DEST``, which turns a class-per-subfolder folder, or CSV, Parquet or
JSON-lines files, into a table.

The model and the data module are named by ``class_path`` in the config, so any LightningModule
trains on any SpiralDataModule subclass; ``configs/demo.yaml`` is a complete example.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from jsonargparse import ActionSubCommands, ArgumentParser, Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

from spiral_lightning.core.secrets import masked_config
from spiral_lightning.lightning.datamodule import SpiralDataModule
from spiral_lightning.media.ingest import ingest_images, ingest_videos
from spiral_lightning.sources.ingest_files import ingest_files

#: What ``ingest`` does, in one line: its entry in ``spiral-lightning --help``.
INGEST_HELP = (
    "Write a class-per-subfolder folder of images or videos, or CSV, Parquet or JSON-lines files, as a new table."
)


def _positive(text: str) -> int:
    """A whole number of at least 1, or argparse's error naming the option."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {text!r}")
    return int(text)


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


class _Parser(LightningArgumentParser):
    """Lightning's parser, whose list of subcommands also names ``ingest``, which ``main`` runs
    before Lightning parses anything."""

    def add_subcommands(self, required: bool = True, dest: str = "subcommand", **kwargs: Any) -> ActionSubCommands:
        subcommands = super().add_subcommands(required, dest, **kwargs)
        subcommands.add_subcommand("ingest", ArgumentParser(description=INGEST_HELP), help=INGEST_HELP)
        return subcommands


class SaveMaskedConfig(SaveConfigCallback):
    """Lightning's ``SaveConfigCallback`` (the run's ``config.yaml`` in its log folder), with every
    secret masked: the value of each entry named like one (``aws_secret_access_key``,
    ``sas_token``, ``password``; see ``core.secrets.is_secret_key``) is ``***``, and a uri's query
    values and password too. A key given as ``--data.storage_options '{...}'`` thus never lands
    in a file; the run itself got the real value. To rerun from the saved file, give the keys in
    the environment (or the flag) again."""

    def __init__(self, parser: LightningArgumentParser, config: Namespace, **options: Any) -> None:
        super().__init__(parser, masked_config(config), **options)


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
    LightningCLI(
        datamodule_class=SpiralDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        # A rerun of the same experiment writes its config again instead of refusing to start.
        save_config_kwargs={"overwrite": True},
        # The saved config.yaml shows every secret as ***.
        save_config_callback=SaveMaskedConfig,
        parser_class=_Parser,
        # Lightning reads the process's arguments itself, and warns when given them as well.
        args=None if argv is None else arguments,
    )


if __name__ == "__main__":
    main()
