"""States saved by the code before the package moved into subpackages (commit cdc70bf, made by
``fixtures/make_saved_states.py``) resume exactly with today's code: same rows, same order."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from spiral_lightning import Mixture, PackedDataset, Shuffled, TableDataset, WindowDataset, Windows, balanced

SAVED = Path(__file__).parent / "fixtures" / "saved_states"
#: The mtime ``make_saved_states.py`` gave the files; a Parquet version digests it.
MTIME = 1_764_000_000
ROOT = Path("/tmp/spiral-lightning-saved-states")
CASES: dict[str, Any] = json.loads((SAVED / "states.json").read_text())


@pytest.fixture(scope="module")
def saved_tables() -> tuple[str, str]:
    """The fixture tables copied back to where they were saved (a Parquet version digests each
    file's path and mtime, and a checkout sets its own mtimes)."""
    uris = []
    for name in ("a", "b"):
        shutil.rmtree(ROOT / name, ignore_errors=True)
        shutil.copytree(SAVED / name, ROOT / name)
        for path in (ROOT / name).iterdir():
            os.utime(path, (MTIME, MTIME))
        uris.append(f"parquet:{ROOT / name}")
    return uris[0], uris[1]


def ids(batches: Iterable[Any], key: str = "id") -> list[int]:
    return [int(value) for batch in batches for value in batch[key].reshape(-1).tolist()]


BUILDERS: dict[str, Callable[[str, str], Any]] = {
    "table_stripe": lambda a, b: TableDataset(a, batch_size=5, policy="stripe"),
    "table_balanced_rank1": lambda a, b: TableDataset(a, batch_size=5, policy=balanced, rank=1, world_size=2),
    "table_shuffled_window": lambda a, b: TableDataset(
        a, batch_size=5, policy=Shuffled(7, block_rows=16, buffer_rows=32)
    ),
    "windows": lambda a, b: WindowDataset(
        a, windows=Windows(4, stride=3, group_by="run"), batch_size=3, policy="balanced"
    ),
    # Saved when stripe was these kinds' default: a state resumes under the policy it names.
    "mixture": lambda a, b: Mixture(
        [(a, 0.7), (b, 0.3)], batch_size=6, seed=3, columns=["id", "x"], table_key="table", policy="stripe"
    ),
    "packed": lambda a, b: PackedDataset(a, column="tokens", length=16, batch_size=3, separator=1000, policy="stripe"),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_state_saved_before_the_move_resumes_exactly(saved_tables: tuple[str, str], name: str) -> None:
    dataset = BUILDERS[name](*saved_tables)
    dataset.load_state_dict(CASES[name]["state"])
    assert ids(dataset, "tokens" if name == "packed" else "id") == CASES[name]["rest"]


def test_an_elastic_replan_and_its_lineage_saved_before_the_move_resume_exactly(saved_tables: tuple[str, str]) -> None:
    case = CASES["elastic"]
    shares = []
    for rank in range(3):
        dataset = TableDataset(saved_tables[0], batch_size=4, policy=balanced, rank=rank, world_size=3)
        dataset.load_elastic(case["saved"])
        shares.append(ids(dataset))
    assert shares == case["shares"]
    assert dataset.lineage() == case["lineage"]
    resumed = TableDataset(saved_tables[0], batch_size=4, policy=balanced, rank=0, world_size=3)
    resumed.load_lineage(case["lineage"])
    resumed.load_state_dict(case["state"])
    assert ids(resumed) == case["rest"]
