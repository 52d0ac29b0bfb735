"""The Lightning half of the ``spiral-lightning`` command: ``fit``, ``validate``, ``test`` and
``predict`` over a SpiralDataModule, configured by YAML files (``--config``) and flags. The command
(``cli.main``) imports it only for those: Lightning's imports take seconds that ``ingest`` and
``bench`` do without."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jsonargparse import ActionSubCommands, ArgumentParser, Namespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

from spiral_lightning.core.secrets import masked_config
from spiral_lightning.lightning.datamodule import SpiralDataModule

#: What ``ingest`` does, in one line: its entry in ``spiral-lightning --help``.
INGEST_HELP = (
    "Write a class-per-subfolder folder of images or videos, or CSV, Parquet or JSON-lines files, as a new table."
)
#: What ``bench`` does, in one line: its entry in ``spiral-lightning --help``.
BENCH_HELP = "Read a table for a few seconds under each loader setting; print rows/s, MB/s, batches/s and the best."


class _Parser(LightningArgumentParser):
    """Lightning's parser, whose list of subcommands also names ``ingest`` and ``bench``, which
    ``cli.main`` runs before Lightning parses anything, and whose ``--print_config`` shows every
    secret masked, as ``SaveMaskedConfig`` saves it."""

    def add_subcommands(self, required: bool = True, dest: str = "subcommand", **kwargs: Any) -> ActionSubCommands:
        subcommands = super().add_subcommands(required, dest, **kwargs)
        subcommands.add_subcommand("ingest", ArgumentParser(description=INGEST_HELP), help=INGEST_HELP)
        subcommands.add_subcommand("bench", ArgumentParser(description=BENCH_HELP), help=BENCH_HELP)
        return subcommands

    def dump(self, cfg: Namespace, *args: Any, **kwargs: Any) -> str:
        """The config ``cfg`` as text; masked (``core.secrets.masked_config``) when ``--print_config``
        asked for it. jsonargparse keeps that request on the top parser (``print_config``) until it
        has printed and exited, and the subcommand's parser dumps what it prints. Other dumps stay
        whole: Lightning hands its own dump to the model as the hyperparameters it was built with."""
        parser: Any = self
        while parser is not None and not hasattr(parser, "print_config"):
            parser = getattr(parser, "parent_parser", None)
        text: str = super().dump(cfg if parser is None else masked_config(cfg), *args, **kwargs)
        return text


class SaveMaskedConfig(SaveConfigCallback):
    """Lightning's ``SaveConfigCallback`` (the run's ``config.yaml`` in its log folder), with every
    secret masked: the value of each entry named like one (``aws_secret_access_key``,
    ``sas_token``, ``password``; see ``core.secrets.is_secret_key``) is ``***``, and a uri's query
    values and password too. A key given as ``--data.storage_options '{...}'`` thus never lands
    in a file; the run itself got the real value. To rerun from the saved file, give the keys in
    the environment (or the flag) again."""

    def __init__(self, parser: LightningArgumentParser, config: Namespace, **options: Any) -> None:
        super().__init__(parser, masked_config(config), **options)


def run(arguments: Sequence[str] | None) -> None:
    """Run Lightning's command ``arguments`` (the process's own when ``None``)."""
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
        args=None if arguments is None else list(arguments),
    )
