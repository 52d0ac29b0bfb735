"""DataLoader workers do not outlive a trainer killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from spiral_lightning import TableSpec

ROOT = Path(__file__).resolve().parent.parent


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_workers_end_when_their_trainer_is_killed(make_table: Callable[..., TableSpec], tmp_path: Path) -> None:
    spec = make_table([500, 500, 500, 500], columns=["id"])
    pids = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "tests.orphan_job", spec.uri, str(pids)]
    job = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert job.returncode == -signal.SIGKILL, job.stderr[-4000:]
    workers = {int(line) for line in pids.read_text().split()}
    assert len(workers) == 2
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = [pid for pid in workers if alive(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert survivors == []
