"""The shipped YAML experiments: settings a user copies should be the ones that run well."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import yaml

from spiral_lightning import PackedDataset
from spiral_lightning.demos.data import corpus_tables
from spiral_lightning.lightning.checkpoint import CHECKPOINT_KEY
from spiral_lightning.lightning.cli import main
from tests.ranks import torchrun

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[path.name for path in CONFIGS])
def test_configs_that_train_several_epochs_keep_their_workers(path: Path) -> None:
    config = yaml.safe_load(path.read_text())
    data = config["data"]["init_args"]
    if config["trainer"].get("max_epochs", 1) > 1 and data.get("num_workers", 0) > 0:
        # Workers restarted every epoch pay their start-up again, each epoch.
        assert data.get("persistent_workers") is True, f"{path.name} trains several epochs without persistent workers"


@pytest.mark.slow
def test_the_language_model_config_trains_on_packed_blocks_and_validates_padded_documents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = str(Path(__file__).resolve().parent.parent / "configs" / "lm.yaml")
    small = ["--data.init_args.documents", "300", "--data.init_args.num_workers", "0", "--trainer.max_epochs", "1"]
    main(["fit", "--config", config, *small, "--trainer.enable_progress_bar", "false"])
    # Every step is one batch of 16 whole blocks of the corpus's packed stream, in one epoch.
    train, _ = corpus_tables("data/corpus", 300)
    blocks = PackedDataset(train.resolve(), column="tokens", length=256, batch_size=16, separator=0).batches(0)
    last = torch.load(tmp_path / "runs" / "lm" / "checkpoints" / "last.ckpt", weights_only=True)
    assert blocks > 0 and last["global_step"] == blocks
    metrics = (tmp_path / "runs" / "lm" / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "val_loss" in metrics.splitlines()[0]


def cli_in(argv: Sequence[str]) -> None:
    """The command line ``argv[1:]``, run in the folder ``argv[0]`` (a rank forked from the test's
    forkserver starts in the server's folder)."""
    os.chdir(argv[0])
    main(list(argv[1:]))


@pytest.mark.slow
def test_the_mixture_config_trains_on_two_ranks_and_resumes_as_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = str(Path(__file__).resolve().parent.parent / "configs" / "mixture.yaml")
    small = ["--data.init_args.rows", "4000", "--data.init_args.batch_size", "32", "--trainer.max_epochs", "1"]
    quiet = ["--trainer.enable_progress_bar", "false"]
    ddp = ["--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.max_steps", "20"]
    torchrun(cli_in, [str(tmp_path), "fit", "--config", config, *small, *quiet, *ddp], 2, tmp_path)
    checkpoints = tmp_path / "runs" / "mixture" / "checkpoints"
    stopped = torch.load(checkpoints / "last.ckpt", weights_only=True)
    assert stopped["global_step"] == 20 and stopped[CHECKPOINT_KEY]["world_size"] == 2
    monkeypatch.chdir(tmp_path)
    main(["fit", "--config", config, *small, *quiet, "--ckpt_path", str(checkpoints / "last.ckpt")])
    resumed = torch.load(checkpoints / "last.ckpt", weights_only=True)
    # One process goes on with the rows the two ranks had not read, each table's pass re-planned.
    assert resumed["global_step"] > 20 and resumed[CHECKPOINT_KEY]["world_size"] == 1
