"""Nothing outlives a loader: ten loaders built, read and dropped, and a Trainer that rebuilds its
loaders every epoch, leave the process with the descriptors and child processes it had after the
first (the forkserver and its resource tracker start once and stay, by design)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.ranks import run_processes, run_script

#: Run in a process of its own (forked from the forkserver, see ``tests/ranks.py``), so no other
#: test's threads or sockets move the counts.
SCRIPT = """
import gc, json, os, sys
import lightning.pytorch as pl
import pyarrow as pa
from spiral_lightning import SpiralDataModule, TableDataset, write_table
from spiral_lightning.demos.data import demo_table
from spiral_lightning.demos.tabular import DemoModel


def counts():
    mine = str(os.getpid())
    children = 0
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                children += stat.read().rsplit(")", 1)[1].split()[1] == mine
        except (OSError, IndexError):
            continue
    gc.collect()
    return len(os.listdir("/proc/self/fd")), children


class Counting(pl.Callback):
    def __init__(self):
        self.seen = []

    def on_train_epoch_end(self, trainer, module):
        self.seen.append(counts())


if __name__ == "__main__":
    root = sys.argv[1]
    write_table(f"spiral:{root}/t", pa.table({"id": range(4000)}), split_rows=500)
    loaders = []
    for _ in range(10):
        loader = TableDataset(f"spiral:{root}/t", batch_size=250).loader(num_workers=2)
        assert sorted(int(i) for batch in loader for i in batch["id"]) == list(range(4000))
        del loader
        loaders.append(counts())
    demo_table(f"{root}/demo", rows=2000, split_rows=250)
    counting = Counting()
    data = SpiralDataModule(train=f"spiral:{root}/demo", columns=["features", "label"], batch_size=250, num_workers=2)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=4, reload_dataloaders_every_n_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[counting])
    trainer.fit(DemoModel(), datamodule=data)
    with open(sys.argv[2], "w") as out:
        json.dump({"loaders": loaders, "epochs": counting.seen}, out)
"""


@pytest.mark.slow
def test_loaders_and_reloaded_epochs_leave_no_descriptor_or_process_behind(tmp_path: Path) -> None:
    script = tmp_path / "leaks.py"
    script.write_text(SCRIPT)
    counts = tmp_path / "counts.json"
    # A server of its own, so that its workers are its children, counted.
    argv = [str(script), str(tmp_path), str(counts)]
    codes, printed, _ = run_processes(run_script, [argv], [{}], tmp_path, 300, own_server=True)
    assert codes == [0], printed[-3000:]
    found = json.loads(counts.read_text())
    loaders, epochs = found["loaders"], found["epochs"]
    assert len(loaders) == 10 and len(epochs) == 4
    # The first loader starts the forkserver; after it nothing accumulates.
    assert loaders[1:] == [loaders[1]] * 9, loaders
    assert epochs[1:] == [epochs[1]] * 3, epochs
