"""The resume matrix: every dataset kind saved mid-epoch and continued under a change of layout
or settings, checked by ids against what the kind promises (README, "What resumes under what").

Kinds: ``TableDataset`` under ``stripe``, ``balanced``, ``Shuffled`` by blocks and with a buffer;
``WindowDataset``; ``Mixture`` with ``stop="first_exhausted"`` and ``"cycle"``; ``PackedDataset``.
Changes: 2 -> 1 ranks, 2 -> 3 ranks, batch 64 -> 96 and, for a mixture, new weights, with
Hypothesis over where each rank stopped (in process, each rank one consumer); and 2 -> 3
DataLoader workers through real loaders. ``access="map"`` re-plans through the DataModule's sampler
(tests/test_elastic_kinds.py), and 2-process DDP runs resumed as one process are in
tests/test_datamodule_mixture.py and tests/test_packing_elastic.py. ``TokenBatchDataset`` re-plans
(two in a row, over budgets, seeds and stops) are in tests/test_token_elastic.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from spiral_lightning import Mixture, PackedDataset, Shuffled, TableDataset, TableSpec, WindowDataset, Windows
from spiral_lightning.lightning.loader import consumer_states
from tests.examples import examples
from tests.tables import layout_table, write_uneven
from tests.test_elastic_kinds import check_mixed
from tests.test_packing import SEPARATOR, corpus
from tests.test_packing_elastic import LENGTH, check_re_planned
from tests.test_windows import episode_table

EXAMPLES = examples(10, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors])
SIZES = [700, 300, 500]
LENGTHS = [int(n) for n in np.random.default_rng(3).integers(0, 60, 600)]


class Change(NamedTuple):
    """Saved by ``ranks[0]`` ranks in batches of ``batches[0]``, continued by ``ranks[1]`` in
    batches of ``batches[1]``; ``weights``: the mixture's weights after the change."""

    ranks: tuple[int, int]
    batches: tuple[int, int] = (64, 64)
    weights: tuple[float, float] = (1.0, 1.0)


CHANGES = {
    "2 -> 1 ranks": Change((2, 1)),
    "2 -> 3 ranks": Change((2, 3)),
    "batch 64 -> 96": Change((2, 2), (64, 96)),
    "new weights": Change((2, 2), weights=(1.0, 3.0)),
}


@dataclass(frozen=True)
class Kind:
    """How to build a kind for rank ``rank`` of ``world_size`` in batches of ``batch_size`` (and
    mixture ``weights``), what a batch delivered, and the check of everything delivered."""

    make: Callable[[dict[str, TableSpec], int, int, int, tuple[float, float]], Any]
    delivered: Callable[[Any, Any], list[Any]]
    check: Callable[[list[Any], list[Any], int, int], None]


def rows(dataset: Any, batch: Any) -> list[int]:
    return [int(row) for row in batch["id"].tolist()]


def every_row_once(before: list[int], after: list[int], saved: int, new: int) -> None:
    assert sorted(before + after) == list(range(sum(SIZES))), "a row came twice or was left out"


def table(policy: Any) -> Callable[..., TableDataset]:
    def make(specs: dict[str, TableSpec], rank: int, world_size: int, batch_size: int, _: Any) -> TableDataset:
        return TableDataset(specs["rows"], batch_size=batch_size, policy=policy, rank=rank, world_size=world_size)

    return make


def windows(specs: dict[str, TableSpec], rank: int, world_size: int, batch_size: int, _: Any) -> WindowDataset:
    # Windows of 4 rows: a batch of 8 windows holds as many rows as the others' 32.
    return WindowDataset(
        specs["episodes"],
        windows=Windows(4, 3, "episode"),
        batch_size=batch_size // 8,
        rank=rank,
        world_size=world_size,
    )


def window_rows(dataset: Any, batch: Any) -> list[tuple[int, ...]]:
    return [tuple(window) for window in batch["id"].tolist()]


def windows_once(before: list[Any], after: list[Any], saved: int, new: int) -> None:
    whole = [
        window
        for rank in range(saved)
        for batch in windows(SPECS, rank, saved, 64, ())
        for window in window_rows(None, batch)
    ]
    assert sorted(before + after) == sorted(whole), "a window came twice or was left out"


def mixture(stop: str) -> Callable[..., Mixture]:
    def make(
        specs: dict[str, TableSpec], rank: int, world_size: int, batch_size: int, weights: tuple[float, float]
    ) -> Mixture:
        pairs = [(specs["rows"], weights[0]), (specs["small"], weights[1])]
        return Mixture(
            pairs, batch_size=batch_size, columns=["id"], stop=stop, rank=rank, world_size=world_size, table_key="table"
        )

    return make


def mixed(dataset: Any, batch: Any) -> list[tuple[int, int, list[int]]]:
    table = int(batch["table"])
    return [(table, dataset.state_dict()["tables"][table]["passes"], batch["id"].tolist())]


def mixture_check(stop: str) -> Callable[..., None]:
    def check(before: list[Any], after: list[Any], saved: int, new: int) -> None:
        check_mixed(before + after, [list(range(sum(SIZES))), list(range(90))], stop)

    return check


def packed(specs: dict[str, TableSpec], rank: int, world_size: int, batch_size: int, _: Any) -> PackedDataset:
    return PackedDataset(
        specs["corpus"],
        column="tokens",
        length=LENGTH,
        batch_size=batch_size // 16,
        separator=SEPARATOR,
        rank=rank,
        world_size=world_size,
    )


def tokens(dataset: Any, batch: Any) -> list[int]:
    return [token for token in batch["tokens"].flatten().tolist() if token != SEPARATOR]


def packed_check(before: list[int], after: list[int], saved: int, new: int) -> None:
    check_re_planned(LENGTHS, before, after, saved, new)


KINDS = {
    "stripe": Kind(table("stripe"), rows, every_row_once),
    "balanced": Kind(table("balanced"), rows, every_row_once),
    "shuffled blocks": Kind(table(Shuffled(block_rows=128, seed=5)), rows, every_row_once),
    "shuffled buffer": Kind(table(Shuffled(block_rows=128, buffer_rows=256, seed=5)), rows, every_row_once),
    "windows": Kind(windows, window_rows, windows_once),
    "mixture first_exhausted": Kind(mixture("first_exhausted"), mixed, mixture_check("first_exhausted")),
    "mixture cycle": Kind(mixture("cycle"), mixed, mixture_check("cycle")),
    "packed": Kind(packed, tokens, packed_check),
}
SPECS: dict[str, TableSpec] = {}


@pytest.fixture(scope="module", autouse=True)
def specs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    root = tmp_path_factory.mktemp("matrix")
    SPECS["rows"] = write_uneven(root / "rows", layout_table(SIZES), SIZES)
    SPECS["small"] = write_uneven(root / "small", layout_table([90], seed=1), [40, 50])
    SPECS["episodes"] = write_uneven(root / "episodes", episode_table(SIZES, 2), SIZES)
    SPECS["corpus"] = write_uneven(root / "corpus", corpus(LENGTHS), [200, 150, 250])
    yield
    SPECS.clear()


def taken(kind: Kind, dataset: Any, batches: int | None) -> list[Any]:
    """What ``dataset`` (one consumer, read in process) delivers in its first ``batches`` batches."""
    reading: Iterator[Any] = iter(dataset)
    return [item for batch in itertools.islice(reading, batches) for item in kind.delivered(dataset, batch)]


#: Every kind with every change that applies to it (new weights: mixtures only).
MATRIX = [
    pytest.param(kind, change, id=f"{kind}, {change}")
    for kind, change in itertools.product(KINDS, CHANGES)
    if CHANGES[change].weights == (1.0, 1.0) or kind.startswith("mixture")
]


@pytest.mark.parametrize(("kind", "change"), MATRIX)
@EXAMPLES
@given(stops=st.lists(st.integers(0, 9), min_size=2, max_size=2))
def test_every_kind_continues_every_change_as_it_promises(kind: str, change: str, stops: list[int]) -> None:
    chosen, how = KINDS[kind], CHANGES[change]
    saved, new = how.ranks
    before, states = [], []
    for rank in range(saved):
        dataset = chosen.make(SPECS, rank, saved, how.batches[0], (1.0, 1.0))
        before += taken(chosen, dataset, stops[rank])
        states.append(dataset.state_dict())
    after = []
    for rank in range(new):
        dataset = chosen.make(SPECS, rank, new, how.batches[1], how.weights)
        dataset.load_elastic(states)
        after += taken(chosen, dataset, None)
    chosen.check(before, after, saved, new)


def loader_items(kind: str, batch: Any) -> list[Any]:
    """What a batch from a loader delivered (a mixture's pass is 0: first_exhausted reads no other)."""
    return (
        [(int(batch["table"]), 0, batch["id"].tolist())]
        if kind.startswith("mixture")
        else KINDS[kind].delivered(None, batch)
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["balanced", "shuffled buffer", "windows", "mixture first_exhausted", "packed"])
def test_every_kind_saved_by_2_workers_continues_with_3(kind: str) -> None:
    chosen = KINDS[kind]
    saving = chosen.make(SPECS, 0, 1, 64, (1.0, 1.0))
    loader = saving.loader(num_workers=2)
    before = [item for batch in itertools.islice(iter(loader), 5) for item in loader_items(kind, batch)]
    states = consumer_states(loader.state_dict())
    del loader
    resumed = chosen.make(SPECS, 0, 1, 64, (1.0, 1.0))
    resumed.load_elastic(states)
    after = [item for batch in resumed.loader(num_workers=3) for item in loader_items(kind, batch)]
    chosen.check(before, after, 2, 3)
