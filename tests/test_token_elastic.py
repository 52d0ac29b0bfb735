"""Token-budget epochs re-planned under other ranks and workers: every document delivered once
across the saved run and the resumed ones (a re-plan of a re-plan included, a filtered table, a
split document partly delivered coming again whole), a re-planned epoch resumed under its own
topology, and states and lineages of another budget, seed or kind refused by name."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from spiral_lightning import TableDataset, TableSpec, TokenBatchDataset, TokenBudget
from tests.examples import examples
from tests.test_token_batches import corpus, pieces_of

DOCUMENTS = 240


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> TableSpec:
    lengths = np.random.default_rng(7).integers(1, 700, DOCUMENTS)
    return corpus(tmp_path_factory.mktemp("corpus"), lengths, split_rows=60).resolve()


def documents(batches: Iterator[dict[str, Any]], budget: TokenBudget, count: int | None = None) -> list[int]:
    """The document of every piece of ``count`` of ``batches`` (all when ``None``)."""
    taken = batches if count is None else (next(batches) for _ in range(count))
    return [document for batch in taken for document, _, _ in pieces_of(batch, budget)]


def read_some(
    datasets: list[TokenBatchDataset], stops: list[int], budget: TokenBudget
) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """What each rank's dataset (in process) delivers in its first ``stops[rank]`` batches (at
    most all of them), and its state after them."""
    seen, states = [], []
    for dataset, stop in zip(datasets, stops, strict=True):
        seen.append(documents(iter(dataset), budget, min(stop, dataset.batches(0))))
        states.append(dataset.state_dict())
    return seen, states


@examples(24, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    max_tokens=st.integers(300, 2000),
    form=st.sampled_from(["padded", "flat"]),
    window=st.integers(8, 120),
    group=st.booleans(),
    seed=st.integers(0, 5),
    first=st.integers(1, 3),
    second=st.integers(1, 3),
    stops=st.lists(st.integers(0, 40), min_size=6, max_size=6),
)
def test_every_document_arrives_once_across_two_re_plans(
    spec: TableSpec,
    max_tokens: int,
    form: Any,
    window: int,
    group: bool,
    seed: int,
    first: int,
    second: int,
    stops: list[int],
) -> None:
    budget = TokenBudget("tokens", max_tokens=max_tokens, form=form, long="truncate", window=window, group=group)

    def ranks(world_size: int) -> list[TokenBatchDataset]:
        return [
            TokenBatchDataset(spec, budget=budget, shuffle=True, seed=seed, rank=rank, world_size=world_size)
            for rank in range(world_size)
        ]

    seen, saved = read_some(ranks(first), stops[:first], budget)
    replanned = ranks(second)
    for dataset in replanned:
        dataset.load_elastic(saved)
    whole = [documents(iter(dataset), budget) for dataset in replanned]
    assert [dataset.batches(0) for dataset in replanned] == [sum(1 for _ in dataset) for dataset in replanned]
    for dataset in replanned:
        dataset.load_elastic(saved)
    more, states = read_some(replanned, stops[3 : 3 + second], budget)
    lineage = replanned[0].lineage()
    assert lineage is not None and all(dataset.lineage() == lineage for dataset in replanned)
    # Under the re-plan's own topology each state continues where it stood.
    for rank, dataset in enumerate(ranks(second)):
        dataset.load_lineage(lineage)
        dataset.load_state_dict(states[rank])
        assert more[rank] + documents(iter(dataset), budget) == whole[rank]
    # A re-plan of the re-planned epoch: one rank reads everything left.
    last = TokenBatchDataset(spec, budget=budget, shuffle=True, seed=seed)
    last.load_elastic(states, lineage=lineage)
    rest = documents(iter(last), budget)
    assert len((last.lineage() or {})["links"]) == 2
    delivered = [document for rank in seen + more for document in rank] + rest
    assert sorted(delivered) == list(range(DOCUMENTS))


def test_states_and_lineages_of_another_budget_seed_or_kind_are_refused_by_name(spec: TableSpec) -> None:
    budget = TokenBudget("tokens", max_tokens=1000, window=50)
    plain = TokenBatchDataset(spec, budget=budget)
    next(iter(plain))
    with pytest.raises(ValueError, match=r"another token budget \(saved \['tokens', 1000"):
        TokenBatchDataset(spec, budget=replace(budget, max_tokens=999)).load_elastic([plain.state_dict()])
    edited = {**plain.state_dict(), "window": [0, 0]}
    with pytest.raises(ValueError, match=r"TokenBatchDataset state of rank 0, worker 0 was edited or damaged"):
        TokenBatchDataset(spec, budget=budget, rank=0, world_size=2).load_elastic([edited])
    replanned = TokenBatchDataset(spec, budget=budget, rank=0, world_size=2)
    replanned.load_elastic([plain.state_dict()])
    lineage = replanned.lineage()
    assert lineage is not None
    with pytest.raises(
        ValueError, match=r"made for windows 'tokens \[0,\"tokens\",1000.*this dataset's are 'tokens \[1,"
    ):
        TokenBatchDataset(spec, budget=budget, seed=1).load_lineage(lineage)
    with pytest.raises(ValueError, match=r"this dataset's are 'of shuffled rows'"):
        TableDataset(spec, columns=["tokens"]).load_lineage(lineage)


@pytest.mark.parametrize("backend", ["parquet", "spiral"])
def test_a_filtered_table_re_plans_inside_a_window(tmp_path: Path, backend: str) -> None:
    lengths = np.random.default_rng(9).integers(1, 400, 500)
    spec = corpus(tmp_path / "corpus", lengths, backend=backend, split_rows=120)
    # Documents whose id is not a multiple of 3: a window's documents are not consecutive stored rows.
    budget = TokenBudget("tokens", max_tokens=900, window=40)

    dropped = f"id NOT IN ({', '.join(str(document) for document in range(0, len(lengths), 3))})"

    def dataset(rank: int = 0, world_size: int = 1) -> TokenBatchDataset:
        return TokenBatchDataset(spec, budget=budget, filter=dropped, rank=rank, world_size=world_size)

    saving = dataset()
    read = iter(saving)
    before = documents(read, budget, 7)
    rest = []
    for rank in range(3):
        resumed = dataset(rank, 3)
        resumed.load_elastic([saving.state_dict()])
        rest += documents(iter(resumed), budget)
    assert sorted(before + rest) == [document for document in range(len(lengths)) if document % 3]


def test_a_split_document_partly_delivered_comes_again_whole(tmp_path: Path) -> None:
    split = corpus(tmp_path / "split", [10, 25, 5])
    budget = TokenBudget("tokens", max_tokens=10, long="split", group=False, window=8)
    saving = TokenBatchDataset(split, budget=budget)
    read = iter(saving)
    # Document 0, then the first of document 1's three pieces.
    assert [piece for _ in range(2) for piece in pieces_of(next(read), budget)] == [(0, 0, 10), (1, 0, 10)]
    after = []
    for rank in range(2):
        resumed = TokenBatchDataset(split, budget=budget, rank=rank, world_size=2)
        resumed.load_elastic([saving.state_dict()])
        after += [piece for batch in resumed for piece in pieces_of(batch, budget)]
    # Document 1 whole again (its first piece twice in the epoch), and document 2.
    assert sorted(after) == [(1, 0, 10), (1, 10, 10), (1, 20, 5), (2, 0, 5)]
