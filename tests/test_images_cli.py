"""``spiral-lightning ingest`` and the image experiment: a folder of real JPEGs becomes a table
whose images train a model as ready tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spiral_lightning import TableDataset, TableSpec
from spiral_lightning.cli import main
from spiral_lightning.demo_images import COLOURS, demo_image_folder
from spiral_lightning.ingest import classes_of

CONFIG = Path(__file__).parent.parent / "configs" / "images.yaml"


@pytest.mark.parametrize("backend", ["spiral", "parquet"])
def test_ingest_writes_labels_classes_and_lists_bad_files(
    tmp_path: Path, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = demo_image_folder(tmp_path / "folder", per_class=5)
    (folder / "red" / "broken.jpg").write_bytes(b"not a jpeg")
    dest = f"{backend}:{tmp_path / 'table'}"
    main(["ingest", "images", str(folder), dest, "--split-rows", "7"])
    printed = capsys.readouterr().out
    assert "wrote 20 rows of 4 classes ['blue', 'green', 'red', 'yellow']" in printed
    assert "left out" in printed and "broken.jpg" in printed
    dataset = TableDataset(TableSpec(dest, columns=["path", "label"]), batch_size=20)
    assert classes_of(dataset.source().schema) == ("blue", "green", "red", "yellow")
    batch = next(iter(dataset))
    classes = [sorted(COLOURS)[label] for label in batch["label"].tolist()]
    assert [path.split("/")[0] for path in batch["path"]] == classes


@pytest.mark.slow
def test_the_image_experiment_trains_from_an_ingested_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    main(
        [
            "fit",
            "--config",
            str(CONFIG),
            "--trainer.max_epochs",
            "1",
            "--trainer.enable_progress_bar",
            "false",
            "--data.init_args.num_workers",
            "0",
        ]
    )
    last = torch.load(tmp_path / "runs" / "images" / "checkpoints" / "last.ckpt", weights_only=False)
    # 4 classes x 96 images, four fifths of them train, in batches of 32.
    assert last["global_step"] == 10
    assert (tmp_path / "data" / "demo-images" / "table" / "spiral-lightning.json").exists()
