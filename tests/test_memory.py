"""The loader streams: the peak memory of an epoch does not grow with the table.

Two tables with the same columns (``id`` int64, ``x`` float32), 1 M and 10 M rows in splits of
1 M, are each read for a whole epoch by a ``TableDataset`` in a fresh process, which reports its
peak resident memory (``ru_maxrss``). Reading ten times the rows may cost at most 20% more peak
memory; a loader that kept the epoch's rows would add their 120 MB to the larger peak.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from spiral_lightning import write_table

ROOT = Path(__file__).resolve().parent.parent
SPLIT_ROWS = 1_000_000

#: Run in a fresh process: one epoch over the table, then the rows read and the peak memory.
EPOCH = """
import json, resource, sys
from spiral_lightning import TableDataset, TableSpec

rows = 0
last = -1
for batch in TableDataset(TableSpec(sys.argv[1], columns=["id", "x"]), batch_size=4096):
    rows += len(batch["id"])
    last = int(batch["id"][-1])
print(json.dumps({"rows": rows, "last": last, "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def rows(count: int) -> pa.RecordBatchReader:
    """``count`` rows made one split at a time, so writing 10 M rows holds 1 M at most."""
    schema = pa.schema([("id", pa.int64()), ("x", pa.float32())])

    def batches() -> Iterator[pa.RecordBatch]:
        for start in range(0, count, SPLIT_ROWS):
            ids = np.arange(start, min(start + SPLIT_ROWS, count), dtype=np.int64)
            yield pa.record_batch([pa.array(ids), pa.array(ids.astype(np.float32))], schema=schema)

    return pa.RecordBatchReader.from_batches(schema, batches())


def epoch_peak(uri: str) -> dict[str, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", EPOCH, uri], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow
def test_peak_memory_of_an_epoch_does_not_grow_with_the_table(tmp_path: Path) -> None:
    small = write_table(f"spiral:{tmp_path / 'small'}", rows(1_000_000), split_rows=SPLIT_ROWS)
    large = write_table(f"spiral:{tmp_path / 'large'}", rows(10_000_000), split_rows=SPLIT_ROWS)
    small_epoch, large_epoch = epoch_peak(small.uri), epoch_peak(large.uri)
    assert (small_epoch["rows"], small_epoch["last"]) == (1_000_000, 999_999)
    assert (large_epoch["rows"], large_epoch["last"]) == (10_000_000, 9_999_999)
    ratio = large_epoch["peak_kib"] / small_epoch["peak_kib"]
    assert ratio <= 1.2, (
        f"peak RSS {large_epoch['peak_kib'] / 1024:.0f} MiB over 10 M rows against "
        f"{small_epoch['peak_kib'] / 1024:.0f} MiB over 1 M rows: {ratio:.2f}x"
    )
