"""Shared fixtures: real local Spiral tables written into temporary folders."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from spiral_lightning import TableSpec
from tests.objectstore import S3Server, weed_binary
from tests.tables import write_layout

# Forkserver children are forked from a server that imported these once, so each DataLoader
# worker starts quickly instead of importing torch again; the server never opens a table.
multiprocessing.set_forkserver_preload(["torch", "pyarrow", "spiral", "spiral_lightning.datasets.table"])


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
