"""SpiralDataModule(access="map"): sampler-driven training that shuffles every epoch and resumes
mid-epoch with every row exactly once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pyarrow as pa
import pytest
import torch
from torch.utils.data import DistributedSampler

from spiral_lightning import SpiralDataModule, TableSpec, write_table
from tests.lightning_job import Recorder
from tests.test_datamodule import checkpoints, ids_in, run_ddp, trainer
from tests.test_media_dataset import RESIZE, jpeg

SIZES = [300, 40, 500, 160]


@pytest.mark.slow
def test_map_access_shuffles_each_epoch_and_resumes_exactly(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    spec = make_table(SIZES, columns=["id", "x"])
    every = list(range(sum(SIZES)))

    def data() -> SpiralDataModule:
        return SpiralDataModule(spec, batch_size=50, num_workers=2, access="map", seed=7)

    whole = Recorder()
    trainer(tmp_path / "whole", max_epochs=2).fit(whole, datamodule=data())
    first_epoch, second_epoch = ids_in(whole.seen, 0), ids_in(whole.seen, 1)
    assert sorted(first_epoch) == every and sorted(second_epoch) == every
    assert first_epoch != every and first_epoch != second_epoch

    stopped = Recorder()
    run = trainer(tmp_path, max_epochs=2, max_steps=27, callbacks=[checkpoints(tmp_path, 27)])
    run.fit(stopped, datamodule=data())
    resumed = Recorder()
    trainer(tmp_path, max_epochs=2).fit(resumed, datamodule=data(), ckpt_path=tmp_path / "step=27.ckpt")
    # 20 batches an epoch: the stop falls 7 batches into the second epoch.
    assert ids_in(stopped.seen, 1) + ids_in(resumed.seen, 1) == second_epoch
    assert ids_in(resumed.seen, 0) == []


@pytest.mark.slow
def test_ddp_map_access_resumes_each_rank_in_its_sampler_order(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    spec = make_table(SIZES).resolve()
    options = ["--batch-size", "25", "--access", "map", "--seed", "7", "--max-epochs", "2"]
    # 1,000 rows on 2 ranks: 20 batches of 25 per rank and epoch. Stop 7 batches into the second.
    first = run_ddp(tmp_path, "first", spec.uri, *options, "--max-steps", "27", "--checkpoint-every", "27")
    assert [len(record["seen"]) for record in first] == [27, 27]
    ckpt = str(tmp_path / "checkpoints" / "step=27.ckpt")
    resumed = run_ddp(tmp_path, "resumed", spec.uri, *options, "--ckpt-path", ckpt)
    assert [len(record["seen"]) for record in resumed] == [13, 13]
    for epoch in range(2):
        shares = []
        for rank in range(2):
            sampler = DistributedSampler(range(1000), num_replicas=2, rank=rank, shuffle=True, seed=7, drop_last=True)
            sampler.set_epoch(epoch)
            # The table's ids are its row numbers, so each rank reads its sampler's order exactly.
            share = ids_in(first[rank]["seen"], epoch) + ids_in(resumed[rank]["seen"], epoch)
            assert share == list(sampler)
            shares += share
        assert sorted(shares) == list(range(1000))
    # A new order every epoch.
    assert ids_in(first[0]["seen"], 0)[:100] != ids_in(first[0]["seen"], 1)[:100]


def test_map_access_refuses_other_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="access must be 'iterable' or 'map'"):
        SpiralDataModule("spiral:x", access="random")  # type: ignore[arg-type]


class ImageRecorder(pl.LightningModule):
    """Trains one weight on each image's mean and keeps every batch's ids and images."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[tuple[list[int], torch.Tensor]] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.seen.append((batch["id"].tolist(), batch["img"]))
        loss: torch.Tensor = self.layer(batch["img"].mean(dim=(1, 2, 3))[:, None]).pow(2).mean()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6)


@pytest.mark.parametrize("backend", ["spiral", "parquet"])
def test_map_access_trains_on_decoded_images(tmp_path: Path, backend: str) -> None:
    data = pa.table(
        {"id": pa.array(range(10), pa.int64()), "img": pa.array([jpeg(row) for row in range(10)], pa.binary())}
    )
    stored = write_table(f"{backend}:{tmp_path / 't'}", data, split_rows=4)
    model = ImageRecorder()
    module = SpiralDataModule(TableSpec(stored.uri, media=(RESIZE,)), batch_size=4, access="map", seed=1)
    trainer(tmp_path, max_epochs=1).fit(model, datamodule=module)
    assert sorted(i for ids, _ in model.seen for i in ids) == list(range(10))
    for ids, images in model.seen:
        assert images.shape == (len(ids), 3, 12, 16) and images.dtype == torch.float32
        # jpeg(row) is solid with a red level of 20 * row: each image arrives beside its own id.
        red = torch.tensor([row * 20 / 255 for row in ids])
        assert torch.allclose(images[:, 0].mean(dim=(1, 2)), red, atol=0.03)
    skipping = SpiralDataModule(TableSpec(stored.uri, media=(RESIZE,), on_error="skip"), access="map")
    with pytest.raises(ValueError, match="on_error='skip' drops rows"):
        trainer(tmp_path / "skip", max_epochs=1).fit(ImageRecorder(), datamodule=skipping)
