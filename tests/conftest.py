"""Shared fixtures: real local Spiral tables written into temporary folders."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from spiral_lightning import TableSpec
from spiral_lightning.datasets.loader import warm_forkserver
from tests.objectstore import S3Server, weed_binary
from tests.tables import write_layout

# Property tests draw the same examples every run by default, so a change is judged on the same
# cases as the one before it, and fewer of them (35, or a third of a test's own count: see
# tests/examples.py); ./run-checks --full draws new ones each run, as many as each test asks for
# (HYPOTHESIS_PROFILE=full).
settings.register_profile("ci", derandomize=True, deadline=None, max_examples=35)
settings.register_profile("full", derandomize=False, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Ray runs its workers at niceness 15, so on a busy 2-core machine they wait behind every other
# test's processes: a TorchTrainer run that takes a minute alone took four in the parallel suite,
# and ten beside two busy loops. The suite's Rays (the fixture's, the CLI's, the README's) run
# them as every other process runs.
os.environ.setdefault("RAY_worker_niceness", "0")
# Ray Train's controller polls its workers every 2 s and a worker's ray.train.report waits for the
# poll that takes its result: a README loop that checkpoints six times spent 12 s waiting. The
# suite's runs (the README's, the CLI's, the fixture's) poll every 0.2 s; what they report is the same.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")

# A worker imports the test module that defines what its dataset pickles by reference (a collate,
# a policy), and the test modules import Lightning: a server that imported it once saves each
# worker seconds.
warm_forkserver("spiral", "lightning.pytorch", "pytest", "hypothesis")


@pytest.fixture
def make_table(tmp_path: Path) -> Callable[..., TableSpec]:
    """Writes a table with the given split sizes into a fresh folder under ``tmp_path``; extra
    keyword arguments become the spec's options."""
    count = 0

    def make(split_sizes: Sequence[int], seed: int = 0, backend: str = "spiral", **options: Any) -> TableSpec:
        nonlocal count
        count += 1
        spec = write_layout(tmp_path / f"table{count}", split_sizes, seed, backend)
        return replace(spec, **options)

    return make


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A local SeaweedFS S3 server shared by the whole session; tests make buckets of their own names."""
    try:
        weed_binary()
    except FileNotFoundError as error:
        pytest.fail(str(error), pytrace=False)
    with S3Server() as server:
        yield server


@pytest.fixture
def local_ray() -> None:
    """A small local Ray (two CPUs, a 200 MB object store), started by the first test that needs
    one and shared by those that follow it in the same test process (``ray``, and ``ray_train``
    for the TorchTrainer run, are xdist groups: see ``pytest_collection_modifyitems``). It is
    shut down after the last of them (``pytest_runtest_teardown``): an idle Ray keeps a sixth of
    a core busy, and Ray Train leaves a run's controller actors alive until then."""
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, object_store_memory=200 << 20, include_dashboard=False, log_to_driver=False)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Shut the local Ray down when the next test of this process does not use it."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    if nextitem is None or "local_ray" not in getattr(nextitem, "fixturenames", ()):
        ray.shutdown()


#: Tests that must run in one process of a parallel run: each group shares a resource there.
GROUPS = {"local_ray": "ray", "saved_tables": "saved_states"}


#: The longest tests (``--durations``), a minute or more each in a parallel run, longest first:
#: started before all others.
#: Each Ray test process runs its own Ray, so the Ray ones are spread out: three Rays starting at
#: once on 2 cores made each TorchTrainer run take twice as long.
LONGEST = (
    "Ray Train, plain loop",
    "::test_ddp_",
    "ddp_run",
    "ddp_map_run",
    "ddp-2-ranks",
    "command_fits",
    "Variable-length",
    "Elastic resume",
)


def start_order(item: pytest.Item) -> tuple[int, bool]:
    """Where ``item`` starts: the ``LONGEST`` in their order, then the other multi-process tests."""
    longest = next((index for index, name in enumerate(LONGEST) if name in item.nodeid), len(LONGEST))
    return longest, item.get_closest_marker("slow") is None


# First: xdist turns the groups into node ids in a hook of its own, and misses any added after it.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Start the multi-process tests (marked ``slow``) first, so that a long one is not left
    running alone at the end of a parallel run; put the tests that share a session resource into
    one xdist group (``--dist loadgroup`` sends a group to one worker) and let every other test go
    to any worker. A test that names its own group keeps it: the TorchTrainer run has a second Ray
    of its own, so that the Ray tests take two workers rather than one worker most of the run."""
    items.sort(key=start_order)
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        for fixture, group in GROUPS.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(pytest.mark.xdist_group(group))
