"""A trainer that starts two forkserver StatefulDataLoader workers (as SpiralDataModule's are),
writes their pids, and is killed.

Run as ``python -m tests.orphan_job <uri> <pid file>``; the process kills itself with SIGKILL
after its first batch, so nothing of it can stop its workers.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
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
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
