"""The shipped YAML experiments: settings a user copies should be the ones that run well."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from spiral_lightning import PackedDataset
from spiral_lightning.demos.data import corpus_tables
from spiral_lightning.lightning.cli import main

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
