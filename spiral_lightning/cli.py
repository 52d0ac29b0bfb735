"""The ``spiral-lightning`` command line: Lightning's ``fit``, ``validate``, ``test`` and
``predict`` over a SpiralDataModule, configured by YAML files (``--config``) and flags.

The model and the data module are named by ``class_path`` in the config, so any LightningModule
trains on any SpiralDataModule subclass; ``configs/demo.yaml`` is a complete example.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch.cli import LightningCLI

from spiral_lightning.datamodule import SpiralDataModule


def main(argv: Sequence[str] | None = None) -> None:
    """Run one Lightning command; ``argv`` defaults to the process's arguments."""
    LightningCLI(
        datamodule_class=SpiralDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        # A rerun of the same experiment writes its config again instead of refusing to start.
        save_config_kwargs={"overwrite": True},
        args=None if argv is None else list(argv),
    )


if __name__ == "__main__":
    main()
