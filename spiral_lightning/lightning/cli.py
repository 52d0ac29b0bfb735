"""The ``spiral-lightning`` command line: Lightning's ``fit``, ``validate``, ``test`` and
``predict`` over a SpiralDataModule, configured by YAML files (``--config``) and flags, and
``ingest images|videos SRC DEST``, which turns a class-per-subfolder folder into a table.

The model and the data module are named by ``class_path`` in the config, so any LightningModule
trains on any SpiralDataModule subclass; ``configs/demo.yaml`` is a complete example.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from jsonargparse import ActionSubCommands, ArgumentParser
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from spiral_lightning.lightning.datamodule import SpiralDataModule
from spiral_lightning.media.ingest import ingest_images, ingest_videos

#: What ``ingest`` does, in one line: its entry in ``spiral-lightning --help``.
INGEST_HELP = "Write a class-per-subfolder folder as a new table."


def _positive(text: str) -> int:
    """A whole number of at least 1, or argparse's error naming the option."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {text!r}")
    return int(text)


def ingest(argv: Sequence[str]) -> None:
    """``ingest images|videos SRC DEST``: write the folder SRC as a new table at DEST; a refusal
    (no such folder, DEST not empty, no file that decodes) is one line on stderr and exit status 1."""
    parser = argparse.ArgumentParser(
        prog="spiral-lightning ingest",
        description="Write a class-per-subfolder folder of images or videos as a new table, with a label column "
        "and the class names in the table's metadata. Files that do not decode (and, for videos, still images) "
        "are listed, not written.",
    )
    parser.add_argument("kind", choices=["images", "videos"])
    parser.add_argument("src", help="the folder: one subfolder per class")
    parser.add_argument(
        "dest", help="a new table: a folder (a local Spiral table), spiral:<folder> or parquet:<folder>"
    )
    parser.add_argument("--split-rows", type=_positive, default=None, help="rows per split (row group)")
    args = parser.parse_args(argv)
    dest = args.dest if ":" in args.dest else f"spiral:{args.dest}"
    write = ingest_images if args.kind == "images" else ingest_videos
    options = {} if args.split_rows is None else {"split_rows": args.split_rows}
    try:
        report = write(args.src, dest, **options)
    except (OSError, ValueError) as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")
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
        parser_class=_Parser,
        # Lightning reads the process's arguments itself, and warns when given them as well.
        args=None if argv is None else arguments,
    )


if __name__ == "__main__":
    main()
