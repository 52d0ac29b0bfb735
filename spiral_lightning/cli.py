"""The ``spiral-lightning`` command line: Lightning's ``fit``, ``validate``, ``test`` and
``predict`` over a SpiralDataModule, configured by YAML files (``--config``) and flags, and
``ingest images|videos SRC DEST``, which turns a class-per-subfolder folder into a table.

The model and the data module are named by ``class_path`` in the config, so any LightningModule
trains on any SpiralDataModule subclass; ``configs/demo.yaml`` is a complete example.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning.pytorch.cli import LightningCLI

from spiral_lightning.datamodule import SpiralDataModule
from spiral_lightning.ingest import ingest_images, ingest_videos


def ingest(argv: Sequence[str]) -> None:
    """``ingest images|videos SRC DEST``: write the folder SRC as a new table at DEST."""
    parser = argparse.ArgumentParser(
        prog="spiral-lightning ingest",
        description="Write a class-per-subfolder folder of images or videos as a new table, with a label column "
        "and the class names in the table's metadata. Files that do not decode are listed, not written.",
    )
    parser.add_argument("kind", choices=["images", "videos"])
    parser.add_argument("src", help="the folder: one subfolder per class")
    parser.add_argument(
        "dest", help="a new table: a folder (a local Spiral table), spiral:<folder> or parquet:<folder>"
    )
    parser.add_argument("--split-rows", type=int, default=None, help="rows per split (row group)")
    args = parser.parse_args(argv)
    dest = args.dest if ":" in args.dest else f"spiral:{args.dest}"
    write = ingest_images if args.kind == "images" else ingest_videos
    options = {} if args.split_rows is None else {"split_rows": args.split_rows}
    report = write(args.src, dest, **options)
    print(f"wrote {report.rows} rows of {len(report.classes)} classes {list(report.classes)} to {report.spec.uri}")
    for bad in report.bad:
        print(f"left out {bad.path}: {bad.reason}")


def main(argv: Sequence[str] | None = None) -> None:
    """Run one command; ``argv`` defaults to the process's arguments."""
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
        args=arguments,
    )


if __name__ == "__main__":
    main()
