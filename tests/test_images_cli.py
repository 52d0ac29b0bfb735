"""``spiral-lightning ingest`` and the image experiment: a folder of real JPEGs becomes a table
whose images train a model as ready tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spiral_lightning import TableDataset, TableSpec
from spiral_lightning.demos.images import COLOURS, ImageDemoDataModule, demo_image_folder
from spiral_lightning.lightning.cli import main
from spiral_lightning.media.ingest import classes_of, ingest_images

CONFIG = Path(__file__).parent.parent / "configs" / "images.yaml"


@pytest.mark.parametrize("backend", ["spiral", "parquet"])
def test_ingest_writes_labels_classes_and_lists_bad_files(
    tmp_path: Path, backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = demo_image_folder(tmp_path / "folder", per_class=5)
    (folder / "red" / "broken.jpg").write_bytes(b"not a jpeg")
    dest = f"{backend}:{tmp_path / 'table'}"
    main(["ingest", "images", str(folder), dest, "--split-rows", "7"])
    printed = capsys.readouterr()
    assert "wrote 20 rows of 4 classes ['blue', 'green', 'red', 'yellow']" in printed.out
    assert "left out 1 file that does not decode" in printed.out
    # The list comes once, on stderr, after the progress bar's last line instead of inside it.
    assert "red/broken.jpg" not in printed.out
    listed = printed.err.index("left out red/broken.jpg: not a readable image")
    assert printed.err.rindex("ingest image") < listed
    dataset = TableDataset(TableSpec(dest, columns=["path", "label"]), batch_size=20)
    assert classes_of(dataset.source().schema) == ("blue", "green", "red", "yellow")
    batch = next(iter(dataset))
    classes = [sorted(COLOURS)[label] for label in batch["label"].tolist()]
    assert [path.split("/")[0] for path in batch["path"]] == classes


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing folder", "is not a folder; ingest reads a folder with one subfolder per class"),
        ("occupied destination", "is not an empty folder; ingest writes a new table, give DEST a new folder"),
        ("unknown kind", "invalid choice: 'audio'"),
        ("SDS destination", "ingest writes a 'spiral:<folder>' or 'parquet:<folder>' table, not 'sds:"),
        ("images as videos", "none of the 20 files under"),
    ],
)
def test_ingest_refuses_with_one_line_and_writes_nothing(
    tmp_path: Path, case: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = demo_image_folder(tmp_path / "folder", per_class=5)
    dest = tmp_path / "table"
    kind, src, dest_uri = "images", str(folder), str(dest)
    if case == "missing folder":
        src = str(tmp_path / "nowhere")
    elif case == "occupied destination":
        dest.mkdir()
        (dest / "notes.txt").write_text("keep me")
    elif case == "unknown kind":
        kind = "audio"
    elif case == "SDS destination":
        dest_uri = f"sds:{dest}"
    else:
        kind = "videos"
    with pytest.raises(SystemExit) as exited:
        main(["ingest", kind, src, dest_uri])
    assert exited.value.code not in (0, None)
    printed = capsys.readouterr()
    assert message in printed.err and "Traceback" not in printed.err
    if case in ("missing folder", "occupied destination", "SDS destination"):
        # Refused before a file is read: no progress bar, only the one line.
        assert printed.err.count("\n") == 1 and printed.err.startswith("spiral-lightning ingest: error: ")
    if case == "occupied destination":
        assert [path.name for path in dest.iterdir()] == ["notes.txt"]
    else:
        assert not dest.exists()


def test_the_image_experiment_size_is_height_then_width(tmp_path: Path) -> None:
    folder = demo_image_folder(tmp_path / "folder", per_class=5)
    ingest_images(folder, f"spiral:{tmp_path / 'table'}", progress=False)
    module = ImageDemoDataModule(str(folder), str(tmp_path / "table"), size=(48, 24), batch_size=4)
    module.setup("fit")
    assert next(iter(module.datasets["train"]))["image"].shape == (4, 3, 48, 24)


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
