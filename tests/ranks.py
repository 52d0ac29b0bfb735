"""Starting the processes of a test job from the test process's forkserver, as torchrun starts
ranks, instead of a fresh interpreter each.

A fresh interpreter spends 3 s of CPU importing torch and 8 s importing Lightning, per rank and
per phase of a job; the forkserver imported both once (``warm_forkserver`` in conftest), so a
rank forked from it starts in milliseconds. Each rank is still a process of its own that meets
the others in a real gloo group and starts DataLoader workers of its own.

A rank would also start a forkserver of its own for those workers, a fresh interpreter that
imports torch, pyarrow and the reader again (3-4 s of CPU, per rank and phase: most of a short DDP
test). So a rank asks the test process's forkserver for its workers instead (``_share_server``).
The workers are then that server's children rather than a server of the rank's: a job that checks
what a process leaves behind (``own_group``, ``own_server``) keeps its own, and so does one whose
environment adds more than torchrun's variables, which a shared server's workers would not see.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing import forkserver, resource_tracker
from pathlib import Path
from typing import NamedTuple

from tests.objectstore import free_ports

#: A job's entry point: its command-line arguments, without the program name.
Job = Callable[[Sequence[str]], object]


class Ended(NamedTuple):
    """How a job's processes ended: each one's exit code (``-9``: SIGKILL; None: still running
    at the timeout, then killed), what they printed, process by process, and their pids."""

    codes: list[int | None]
    printed: str
    pids: list[int]


#: The variables ``torchrun`` sets, which no DataLoader worker reads: a process whose environment
#: adds only these may share the test process's forkserver.
TORCHRUN_VARIABLES = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})


def torchrun(job: Job, argv: Sequence[str], world_size: int, out: Path, timeout: float = 300) -> str:
    """Run ``job(argv)`` in ``world_size`` processes with the variables torchrun sets (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so that Lightning's DDP
    finds its ranks launched; one process alone gets none of them. Fails the test unless every
    rank succeeds; returns what the ranks printed."""
    return succeeded(torchrun_ended(job, argv, world_size, out, timeout))


def torchrun_ended(
    job: Job, argv: Sequence[str], world_size: int, out: Path, timeout: float = 300, own_group: bool = False
) -> Ended:
    """``torchrun`` that returns how the ranks ended, whatever it was (see ``run_processes``)."""
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
    return run_processes(job, [list(argv)] * world_size, environments, out, timeout, own_group)


def rank_jobs(job: Job, argv: Sequence[str], world_size: int, out: Path, timeout: float = 300) -> str:
    """Run ``job`` in ``world_size`` processes, each told ``--rank r --world-size w --port p``
    (the arguments of ``tests.ddp_group``). Fails the test unless every rank succeeds; returns
    what the ranks printed."""
    port = free_ports(1)[0]
    argvs = [
        [*argv, "--rank", str(rank), "--world-size", str(world_size), "--port", str(port)] for rank in range(world_size)
    ]
    return succeeded(run_processes(job, argvs, [{}] * world_size, out, timeout))


def succeeded(ended: Ended) -> str:
    """What the processes printed, when every one ended with 0; else the test fails with it."""
    codes, printed, _ = ended
    assert codes == [0] * len(codes), f"the job's processes ended with {codes} (None: hung):\n{printed[-4000:]}"
    return printed


def run_processes(
    job: Job,
    argvs: Sequence[Sequence[str]],
    environments: Sequence[Mapping[str, str]],
    out: Path,
    timeout: float,
    own_group: bool = False,
    own_server: bool = False,
) -> Ended:
    """Run ``job(argv)`` for each of ``argvs`` at once, each in a process forked from the
    forkserver with its environment variables added, and wait for all, killing those that
    outlive ``timeout``. Each process prints into a log under ``out``. With ``own_group`` each
    process leads a process group of its own (the group's id is its pid), as a job started in a
    new session does, so that what it leaves behind can be found. With ``own_server`` (implied by
    ``own_group``) a process starts a forkserver of its own for its workers, as a script does."""
    context = multiprocessing.get_context("forkserver")
    forkserver.ensure_running()
    # The address of this process's server, which a forked process cannot learn from its own state.
    address = forkserver._forkserver._forkserver_address  # type: ignore[attr-defined]
    logs = Path(tempfile.mkdtemp(prefix="logs-", dir=out))
    paths = [logs / f"process{index}.log" for index in range(len(argvs))]
    shared = None if own_group or own_server else address
    processes = [
        context.Process(
            target=_start,
            args=(
                job,
                list(argv),
                dict(environment),
                str(path),
                own_group,
                shared if set(environment) <= TORCHRUN_VARIABLES else None,
            ),
        )
        for argv, environment, path in zip(argvs, environments, paths, strict=True)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    codes: list[int | None] = [process.exitcode for process in processes]
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    printed = "".join(path.read_text(errors="replace") for path in paths if path.exists())
    return Ended(codes, printed, [process.pid for process in processes if process.pid is not None])


def _start(
    job: Job, argv: list[str], environment: dict[str, str], log: str, own_group: bool, server: str | None
) -> None:
    """In the forked process: take the environment, print into ``log``, start workers from the
    forkserver at ``server`` (if any), run the job."""
    if own_group:
        os.setsid()
    if server:
        _share_server(server)
    os.environ.update(environment)
    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    job(argv)


def run_script(argv: Sequence[str]) -> None:
    """A job that runs the script ``argv[0]`` from its folder as ``python script argv[1:]``
    would, with ``__name__`` set to ``"__main__"``."""
    script = Path(argv[0])
    os.chdir(script.parent)
    sys.argv = [str(script), *argv[1:]]
    sys.path[0] = str(script.parent)
    runpy.run_path(str(script), run_name="__main__")


def _share_server(address: str) -> None:
    """In a process the forkserver at ``address`` forked: start this process's forkserver
    children from that server rather than from a new one. The server handed this process its
    keep-alive descriptor and the resource tracker's when it forked it; only the address is
    missing, and ``ensure_running`` must not look for a server this process started."""
    server = forkserver._forkserver  # type: ignore[attr-defined]
    server._forkserver_address = address
    server.ensure_running = resource_tracker.ensure_running
