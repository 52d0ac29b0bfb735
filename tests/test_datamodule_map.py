"""SpiralDataModule(access="map"): sampler-driven training that shuffles every epoch and resumes
mid-epoch with every row exactly once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from spiral_lightning import SpiralDataModule, TableSpec
from tests.lightning_job import Recorder
from tests.test_datamodule import checkpoints, ids_in, trainer

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


def test_map_access_refuses_other_settings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="access must be 'iterable' or 'map'"):
        SpiralDataModule("spiral:x", access="random")  # type: ignore[arg-type]
