"""The ``spiral-lightning-ray`` command: a Lightning experiment trained by Ray Train workers.

The YAML holds four sections: ``ray`` (the cluster and the run: ``RayRun``), ``trainer`` (plain
``lightning.Trainer`` options), ``model`` and ``data`` (``class_path`` / ``init_args``, as in
``spiral-lightning``). Each Ray Train worker is one rank: it builds the model, the DataModule and a
Trainer on ``RayDDPStrategy`` with ``RayLightningEnvironment``, so the SpiralDataModule takes its
rank from the Trainer as under any other launcher. ``configs/ray_train.yaml`` is a complete example.

Checkpoints go to ``<storage_path>/<name>``; running the same command again resumes from the
latest one, each rank at its own position.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonargparse
import lightning.pytorch as pl
import ray
import ray.train
from jsonargparse import ArgumentParser, Namespace
from lightning.pytorch.callbacks import Callback
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, RayTrainReportCallback, prepare_trainer
from ray.train.torch import TorchTrainer

from spiral_lightning.core.secrets import masked_config
from spiral_lightning.lightning.cli import import_from_working_directory
from spiral_lightning.lightning.datamodule import SpiralDataModule

#: The file a checkpoint of this command holds: the Lightning checkpoint, written by rank 0.
CHECKPOINT = RayTrainReportCallback.CHECKPOINT_NAME


@dataclass
class RayRun:
    """Where and how the Ray Train run goes.

    ``address`` names a running cluster (``"auto"``, ``"ray://host:10001"``); ``None`` starts a
    local Ray with ``num_cpus`` CPUs for this command. ``num_workers`` Ray Train workers (ranks)
    take ``cpus_per_worker`` CPUs each, and a GPU each with ``use_gpu``. ``storage_path`` /
    ``name`` is the run's folder. ``checkpoint_every_n_steps`` also reports a checkpoint inside
    epochs (``0``: at epoch ends only). ``max_failures`` restarts the workers from the latest
    checkpoint that many times before the command fails.
    """

    address: str | None = None
    num_cpus: int = 2
    num_workers: int = 2
    cpus_per_worker: float = 1.0
    use_gpu: bool = False
    storage_path: str = "runs/ray-train"
    name: str = "experiment"
    checkpoint_every_n_steps: int = 0
    max_failures: int = 0


class Sealed:
    """The experiment's YAML on its way to the workers: whole when pickled, masked when shown.

    Ray Train records a run's ``train_loop_config`` as text (its dashboard, state API and exported
    run events), so a key given as ``--data.storage_options '{...}'`` would be shown there; this
    shows the YAML with every secret ``***`` (``core.secrets.masked_config``)."""

    def __init__(self, text: str, settings: Namespace) -> None:
        self.text = text
        self.shown = json.dumps(masked_config(settings.as_dict()), default=str)

    def __str__(self) -> str:
        return self.shown

    __repr__ = __str__


def parser() -> ArgumentParser:
    """The parser of the command's YAML and flags."""
    parse = ArgumentParser(prog="spiral-lightning-ray", description=__doc__)
    config_file = jsonargparse.ActionConfigFile  # type: ignore[attr-defined]  # public, though not in its __all__
    parse.add_argument("--config", action=config_file, help="a YAML experiment such as configs/ray_train.yaml")
    parse.add_class_arguments(RayRun, "ray")
    parse.add_argument("--trainer", type=dict[str, Any], default={}, help="lightning.Trainer options")
    parse.add_subclass_arguments(pl.LightningModule, "model", required=True)
    parse.add_subclass_arguments(SpiralDataModule, "data", required=True)
    return parse


class ReportEveryNSteps(Callback):
    """Reports a Lightning checkpoint to Ray Train every ``steps`` training steps.

    Every rank saves (the save gathers every rank's data position into the DataModule's entry)
    and reports the same folder, in which only rank 0 writes the file.
    """

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step % self.steps:
            return
        with tempfile.TemporaryDirectory() as folder:
            trainer.save_checkpoint(Path(folder, CHECKPOINT), weights_only=False)
            metrics = {name: value.item() for name, value in trainer.callback_metrics.items()}
            ray.train.report({**metrics, "step": trainer.global_step}, checkpoint=Checkpoint.from_directory(folder))
        trainer.strategy.barrier()


def fit_worker(config: dict[str, Any]) -> None:
    """One Ray Train worker: build the experiment from its YAML and fit, from the run's latest
    checkpoint when there is one."""
    if config["cwd"] is not None:
        # A local Ray's workers start elsewhere; relative paths in the YAML mean the launch folder.
        os.chdir(config["cwd"])
    parse = parser()
    sealed = config["yaml"]
    settings = parse.parse_string(sealed.text if isinstance(sealed, Sealed) else sealed)
    built = parse.instantiate_classes(settings)
    run: RayRun = built.ray
    callbacks: list[Callback] = [RayTrainReportCallback()]
    if run.checkpoint_every_n_steps:
        callbacks.append(ReportEveryNSteps(run.checkpoint_every_n_steps))
    trainer = pl.Trainer(
        **settings.trainer,
        accelerator="gpu" if run.use_gpu else "cpu",
        devices="auto",
        strategy=RayDDPStrategy(),
        plugins=[RayLightningEnvironment()],
        callbacks=callbacks,
        enable_checkpointing=False,
    )
    trainer = prepare_trainer(trainer)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        trainer.fit(built.model, datamodule=built.data)
        return
    with checkpoint.as_directory() as folder:
        trainer.fit(built.model, datamodule=built.data, ckpt_path=str(Path(folder, CHECKPOINT)))


def run_experiment(settings: Namespace, yaml: str) -> ray.train.Result:
    """Start (or join) Ray and fit the experiment ``settings`` (``yaml`` as text) on its workers."""
    run = RayRun(**settings.ray.as_dict())
    if run.num_workers < 1:
        raise ValueError(f"ray.num_workers must be at least 1, not {run.num_workers}")
    local = run.address is None
    if not ray.is_initialized():
        if local:
            ray.init(num_cpus=run.num_cpus, include_dashboard=False)
        else:
            ray.init(address=run.address)
    trainer = TorchTrainer(
        fit_worker,
        train_loop_config={"yaml": Sealed(yaml, settings), "cwd": os.getcwd() if local else None},
        scaling_config=ScalingConfig(
            num_workers=run.num_workers, use_gpu=run.use_gpu, resources_per_worker={"CPU": run.cpus_per_worker}
        ),
        run_config=RunConfig(
            name=run.name,
            storage_path=os.path.abspath(run.storage_path) if "://" not in run.storage_path else run.storage_path,
            failure_config=FailureConfig(max_failures=run.max_failures),
        ),
    )
    return trainer.fit()


def main(argv: Sequence[str] | None = None) -> None:
    """Run the experiment the arguments (default: the process's) describe, and print where its
    latest checkpoint is."""
    import_from_working_directory()
    parse = parser()
    settings = parse.parse_args(None if argv is None else list(argv))
    result = run_experiment(settings, parse.dump(settings))
    print(f"finished; latest checkpoint: {result.checkpoint.path if result.checkpoint else 'none'}")


if __name__ == "__main__":
    main()
