"""The forkserver imports what the user's script imports, once: the DataLoader workers forked
from it, which run the script again, find those imports done instead of paying for each (a
script that imports Lightning cost each worker seconds)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import os, sys
import tests.import_probe as probe
from spiral_lightning import TableDataset, write_table
import pyarrow as pa


def record(worker_id):
    with open(os.environ["WORKERS"], "a") as workers:
        workers.write(f"{os.getpid()}\\n")


if __name__ == "__main__":
    write_table(f"spiral:{sys.argv[1]}", pa.table({"id": range(1000)}), split_rows=100)
    for _ in range(2):
        loader = TableDataset(f"spiral:{sys.argv[1]}", batch_size=100).loader(num_workers=2, worker_init_fn=record)
        assert sorted(int(i) for batch in loader for i in batch["id"]) == list(range(1000))
        del loader
"""


@pytest.mark.slow
def test_workers_find_the_scripts_imports_done_by_the_forkserver(tmp_path: Path) -> None:
    script, probe, workers = tmp_path / "script.py", tmp_path / "probe", tmp_path / "workers"
    script.write_text(SCRIPT)
    environment = {**os.environ, "IMPORT_PROBE": str(probe), "WORKERS": str(workers), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "t")], env=environment, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    importers = probe.read_text().split()
    started = workers.read_text().split()
    assert len(started) == 4
    # The script and the forkserver imported the module; none of the four workers did.
    assert len(importers) == 2 and not set(importers) & set(started)
