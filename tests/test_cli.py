"""The ``spiral-lightning`` command line: YAML experiments through LightningCLI, resume with
``--ckpt_path last``, the errors of bad configs, and what it prints besides."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spiral_lightning.demos.data import demo_table
from spiral_lightning.lightning.cli import main


def config(tmp_path: Path, root: Path, data_options: str = "") -> Path:
    path = tmp_path / "experiment.yaml"
    path.write_text(
        f"""
trainer:
  accelerator: cpu
  devices: 1
  max_epochs: 1
  enable_progress_bar: false
  enable_model_summary: false
  logger: false
  default_root_dir: {tmp_path}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        dirpath: {tmp_path / "checkpoints"}
        every_n_train_steps: 2
        save_last: true
model:
  class_path: spiral_lightning.demos.tabular.DemoModel
data:
  class_path: spiral_lightning.demos.tabular.DemoDataModule
  init_args:
    root: {root}
    rows: 2000
    val_from: 1600
    batch_size: 100
{data_options}"""
    )
    return path


@pytest.mark.slow
def test_fit_creates_the_demo_table_and_resumes_from_last(tmp_path: Path) -> None:
    root = tmp_path / "demo"
    experiment = config(tmp_path, root)
    main(["fit", "--config", str(experiment), "--trainer.max_steps", "6"])
    assert demo_table(root).version
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["global_step"] == 6
    position = last["DemoDataModule"]["ranks"][0]["position"]
    assert (position["epoch"], position["batches"]) == (0, 6)
    main(["fit", "--config", str(experiment), "--ckpt_path", "last"])
    finished = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    # 1600 training rows in batches of 100: the resumed run trains the 10 batches left.
    assert finished["global_step"] == 16
    assert finished["DemoDataModule"]["ranks"][0]["position"]["batches"] == 16


def test_unknown_config_key_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    experiment = config(tmp_path, tmp_path / "demo", "    batchsize: 10\n")
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(experiment)])
    assert "batchsize" in capsys.readouterr().err


def test_missing_table_is_named(tmp_path: Path) -> None:
    experiment = tmp_path / "missing.yaml"
    experiment.write_text(
        f"""
trainer: {{accelerator: cpu, devices: 1, max_steps: 1, logger: false, enable_progress_bar: false,
          default_root_dir: {tmp_path}}}
model: {{class_path: spiral_lightning.demos.tabular.DemoModel}}
data:
  class_path: spiral_lightning.SpiralDataModule
  init_args: {{train: "spiral:{tmp_path / "nowhere"}"}}
"""
    )
    with pytest.raises(FileNotFoundError, match=r"no Spiral table at .*nowhere"):
        main(["fit", "--config", str(experiment)])


def test_help_lists_ingest_beside_the_trainer_commands(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], recwarn: pytest.WarningsRecorder
) -> None:
    # The console script calls main() with the arguments in sys.argv, as here.
    monkeypatch.setattr(sys, "argv", ["spiral-lightning", "--help"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 0
    printed = capsys.readouterr().out
    for command in ("fit", "validate", "test", "predict", "ingest"):
        assert re.search(rf"^ +{command} +\S", printed, re.MULTILINE), f"{command} is not listed with its help"
    assert [str(warning.message) for warning in recwarn] == []


@pytest.mark.slow
def test_a_fit_prints_no_warnings_of_other_libraries(tmp_path: Path) -> None:
    experiment = config(tmp_path, tmp_path / "demo")
    command = [sys.executable, "-m", "spiral_lightning.lightning.cli", "fit", "--config", str(experiment)]
    done = subprocess.run([*command, "--trainer.max_steps", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "args parameter" not in done.stderr
    assert "set_vital" not in done.stderr


#: A model of the user's own, in a file beside them, with no validation_step.
USER_MODEL = """
import lightning.pytorch as pl
import torch


class TinyModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 4)

    def training_step(self, batch, index):
        return torch.nn.functional.cross_entropy(self.layer(batch["features"]), batch["label"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
"""


def test_a_config_finds_the_users_own_model_and_fits_without_a_val_table_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    (tmp_path / "mymodels.py").write_text(USER_MODEL)
    demo_table(tmp_path / "demo", rows=400, split_rows=100)
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text(
        f"""
trainer: {{accelerator: cpu, max_steps: 3, logger: false, enable_progress_bar: false,
  enable_model_summary: false, enable_checkpointing: false, default_root_dir: {tmp_path}}}
model:
  class_path: mymodels.TinyModel
data:
  class_path: spiral_lightning.SpiralDataModule
  init_args: {{train: "spiral:{tmp_path / "demo"}", columns: [features, label], batch_size: 50, shuffle: true}}
"""
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", str(tmp_path))])
    main(["fit", "--config", str(experiment)])
    assert str(tmp_path) in sys.path
    assert "mymodels" in sys.modules
    printed = [str(warning.message) for warning in recwarn]
    assert not [message for message in printed if "val_dataloader" in message or "Total length" in message]
