"""Starting the processes of a test job from the test process's forkserver, as torchrun starts
ranks, instead of a fresh interpreter each.

A fresh interpreter spends 3 s of CPU importing torch and 8 s importing Lightning, per rank and
per phase of a job; the forkserver imported both once (``warm_forkserver`` in conftest), so a
rank forked from it starts in milliseconds. Each rank is still a process of its own that meets
the others in a real gloo group and starts DataLoader workers of its own.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from tests.objectstore import free_ports

#: A job's entry point: its command-line arguments, without the program name.
Job = Callable[[Sequence[str]], object]


def torchrun(job: Job, argv: Sequence[str], world_size: int, out: Path, timeout: float = 300) -> str:
    """Run ``job(argv)`` in ``world_size`` processes with the variables torchrun sets (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so that Lightning's DDP
    finds its ranks launched; one process alone gets none of them. Returns what the ranks printed."""
    port = free_ports(1)[0]
    environments = [
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        if world_size > 1
        else {}
        for rank in range(world_size)
    ]
    return run_forked(job, [list(argv)] * world_size, environments, out, timeout)


def rank_jobs(job: Job, argv: Sequence[str], world_size: int, out: Path, timeout: float = 300) -> str:
    """Run ``job`` in ``world_size`` processes, each told ``--rank r --world-size w --port p``
    (the arguments of ``tests.ddp_group``). Returns what the ranks printed."""
    port = free_ports(1)[0]
    argvs = [
        [*argv, "--rank", str(rank), "--world-size", str(world_size), "--port", str(port)] for rank in range(world_size)
    ]
    return run_forked(job, argvs, [{}] * world_size, out, timeout)


def run_forked(
    job: Job, argvs: Sequence[Sequence[str]], environments: Sequence[Mapping[str, str]], out: Path, timeout: float
) -> str:
    """Run ``job(argv)`` for each of ``argvs`` at once, each in a process forked from the
    forkserver with its environment variables added, and wait for all. Each process prints into a
    log under ``out``; a process that fails or outlives ``timeout`` fails the test with the logs."""
    context = multiprocessing.get_context("forkserver")
    logs = Path(tempfile.mkdtemp(prefix="logs-", dir=out))
    paths = [logs / f"process{index}.log" for index in range(len(argvs))]
    processes = [
        context.Process(target=_start, args=(job, list(argv), dict(environment), str(path)))
        for argv, environment, path in zip(argvs, environments, paths, strict=True)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    running = [process for process in processes if process.is_alive()]
    for process in running:
        process.kill()
        process.join()
    printed = "".join(path.read_text(errors="replace") for path in paths if path.exists())
    assert not running, f"the job's processes ran past {timeout} s:\n{printed[-4000:]}"
    codes = [process.exitcode for process in processes]
    assert codes == [0] * len(processes), f"the job's processes ended with {codes}:\n{printed[-4000:]}"
    return printed


def _start(job: Job, argv: list[str], environment: dict[str, str], log: str) -> None:
    """In the forked process: take the environment, print into ``log``, run the job."""
    os.environ.update(environment)
    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    job(argv)
