"""A trainer that starts two forkserver StatefulDataLoader workers (as SpiralDataModule's are),
writes their pids, and is killed.

Run as ``python -m tests.orphan_job <uri> <pid file>``; the process kills itself with SIGKILL
once both workers have made a batch, so nothing of it can stop its workers.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
from torchdata.stateful_dataloader import StatefulDataLoader

from spiral_lightning import TableDataset, to_torch

PIDS = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("pids")


def collate(frame: pa.RecordBatch) -> dict[str, Any]:
    """``to_torch``, noting the worker's pid on the way."""
    with PIDS.open("a") as pids:
        pids.write(f"{os.getpid()}\n")
    return to_torch(frame)


def main() -> None:
    # As SpiralDataModule does: the forkserver imports these once for every worker.
    multiprocessing.set_forkserver_preload(["torch", "pyarrow", "spiral_lightning"])
    dataset = TableDataset(sys.argv[1], batch_size=10, collate=collate)
    loader = StatefulDataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="forkserver")
    next(iter(loader))
    # The first batch comes from one worker; on a loaded machine the other may not have made one
    # yet, and the test must know both pids. Both read ahead, so both write soon.
    deadline = time.monotonic() + 60
    while len(set(PIDS.read_text().split())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
