"""Elastic resume: an epoch saved by W1 ranks of K1 workers continues under W2 ranks of K2
workers with every row exactly once, checked by row ids."""

from __future__ import annotations

import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader

from spiral_lightning import Shard, Shuffled, TableDataset, TableSpec, balanced, stripe
from spiral_lightning.core.plan import fingerprint
from spiral_lightning.core.state import Cursor, State
from spiral_lightning.lightning.loader import consumer_states
from spiral_lightning.planning.lineage import RowLineage
from spiral_lightning.planning.policies import policy_name
from spiral_lightning.reading.frames import read_frames, start_of
from tests.examples import examples
from tests.tables import BACKENDS, KEEP_TEXT, kept_ids, write_layout

EXAMPLES = examples(25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextmanager
def table(sizes: list[int], seed: int, filtered: bool, backend: str) -> Iterator[TableSpec]:
    root = Path(tempfile.mkdtemp(prefix="elastic-"))
    try:
        spec = write_layout(root / "t", sizes, seed, backend)
        yield replace(spec, columns=("id",), filter=KEEP_TEXT if filtered else None)
    finally:
        shutil.rmtree(root)


def consume(dataset: TableDataset, shard: Shard, frames: int | None) -> tuple[list[int], dict[str, Any]]:
    """The ids consumer ``shard`` delivers in its first ``frames`` frames (all when ``None``), and
    the state its worker would save after them."""
    items = dataset.work(shard)
    rows: list[int] = []
    cursor: Cursor | None = None
    for count, (frame, after) in enumerate(
        read_frames(dataset.source(), items, start_of(items), dataset.batch_size, "keep_partial")
    ):
        if frames is not None and count == frames:
            break
        rows += frame.rows().column("id").to_pylist()
        cursor = after
    work = fingerprint(items)
    lineage = dataset.lineage()
    state = State(
        dataset.spec.version,
        shard,
        dataset.batch_size,
        dataset.epoch,
        policy_name(dataset.policy),
        work,
        cursor,
        remainder=None if lineage is None else RowLineage.from_dict(lineage).digest,
    )
    return rows, state.to_dict()


@EXAMPLES
@given(
    sizes=st.lists(st.integers(0, 6000), min_size=1, max_size=5),
    seed=st.integers(0, 50),
    filtered=st.booleans(),
    backend=st.sampled_from(BACKENDS),
    policy=st.sampled_from([stripe, balanced]),
    old=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    new=st.tuples(st.integers(1, 4), st.integers(1, 3)),
    batch_size=st.integers(1, 2500),
    new_batch=st.one_of(st.none(), st.integers(1, 2500)),
    stops=st.lists(st.one_of(st.none(), st.integers(0, 6)), min_size=9, max_size=9),
    epoch=st.integers(0, 2),
)
def test_a_saved_epoch_continues_under_any_topology_and_batch_size_exactly_once(
    sizes: list[int],
    seed: int,
    filtered: bool,
    backend: str,
    policy: Any,
    old: tuple[int, int],
    new: tuple[int, int],
    batch_size: int,
    new_batch: int | None,
    stops: list[int | None],
    epoch: int,
) -> None:
    with table(sizes, seed, filtered, backend) as spec:
        delivered: list[int] = []
        states = []
        for rank in range(old[0]):
            saved = TableDataset(spec, batch_size=batch_size, policy=policy, rank=rank, world_size=old[0])
            saved.set_epoch(epoch)
            for worker in range(old[1]):
                rows, state = consume(saved, Shard(rank, old[0], worker, old[1]), stops[rank * old[1] + worker])
                delivered += rows
                states.append(state)
        for rank in range(new[0]):
            resumed = TableDataset(
                spec, batch_size=new_batch or batch_size, policy=policy, rank=rank, world_size=new[0]
            )
            resumed.load_elastic(states)
            assert resumed.epoch == epoch
            for worker in range(new[1]):
                delivered += consume(resumed, Shard(rank, new[0], worker, new[1]), None)[0]
        assert sorted(delivered) == (kept_ids(sizes, seed) if filtered else list(range(sum(sizes))))


@EXAMPLES
@given(
    sizes=st.lists(st.integers(0, 4000), min_size=1, max_size=5),
    seed=st.integers(0, 50),
    filtered=st.booleans(),
    policy=st.sampled_from([stripe, balanced, Shuffled(seed=4, block_rows=700)]),
    topologies=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3)), min_size=3, max_size=3),
    batch_size=st.integers(1, 1500),
    stops=st.lists(st.one_of(st.none(), st.integers(0, 4)), min_size=18, max_size=18),
)
def test_an_epoch_re_planned_twice_delivers_every_row_once_from_small_states(
    sizes: list[int],
    seed: int,
    filtered: bool,
    policy: Any,
    topologies: list[tuple[int, int]],
    batch_size: int,
    stops: list[int | None],
) -> None:
    with table(sizes, seed, filtered, "spiral") as spec:
        delivered: list[int] = []
        states: list[dict[str, Any]] = []
        lineage: dict[str, Any] | None = None
        stop = iter(stops)
        for hop, (world_size, workers) in enumerate(topologies):
            last = hop == len(topologies) - 1
            saved: list[dict[str, Any]] = []
            for rank in range(world_size):
                dataset = TableDataset(spec, batch_size=batch_size, policy=policy, rank=rank, world_size=world_size)
                dataset.set_epoch(1)
                if states:
                    dataset.load_elastic(states, lineage=lineage)
                for worker in range(workers):
                    rows, state = consume(
                        dataset, Shard(rank, world_size, worker, workers), None if last else next(stop)
                    )
                    delivered += rows
                    saved.append(state)
                    # A state names its re-plan's lineage by digest: small whatever the table or the re-plans.
                    assert len(pickle.dumps(state)) < 1024
                next_lineage = dataset.lineage()
            states, lineage = saved, next_lineage
            assert (lineage is None) == (hop == 0)
        assert sorted(delivered) == (kept_ids(sizes, seed) if filtered else list(range(sum(sizes))))


def test_a_re_planned_epoch_needs_its_lineage_to_continue(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([700, 300, 500], columns=["id"])
    first = [consume(TableDataset(spec, batch_size=100, rank=r, world_size=2), Shard(r, 2), 2)[1] for r in range(2)]
    replanned = TableDataset(spec, batch_size=100)
    replanned.load_elastic(first)
    lineage = replanned.lineage()
    assert lineage is not None and len(lineage["links"]) == 1
    _, state = consume(replanned, Shard(), 1)
    assert state["remainder"] == RowLineage.from_dict(lineage).digest
    with pytest.raises(ValueError, match=r"re-planned before \(lineage [0-9a-f]{16}\); pass the lineage"):
        TableDataset(spec, batch_size=100, rank=0, world_size=2).load_elastic([state])
    with pytest.raises(ValueError, match="which this dataset has not re-planned"):
        TableDataset(spec, batch_size=100).load_state_dict(state)
    with pytest.raises(ValueError, match="the lineage given is"):
        TableDataset(spec, batch_size=100).load_elastic([state], lineage={**lineage, "epoch": 3})
    damaged = {**lineage, "links": [{**lineage["links"][0], "items": [0]}]}
    with pytest.raises(ValueError, match="holds 1 and 2 positions"):
        TableDataset(spec, batch_size=100).load_elastic([state], lineage=damaged)
    # The same dataset restores its own consumer's state, and a second re-plan continues it.
    replanned.load_state_dict(state)
    again = TableDataset(spec, batch_size=100, rank=0, world_size=2)
    again.load_elastic([state], lineage=lineage)
    second = again.lineage()
    assert second is not None and len(second["links"]) == 2


def ids(batches: list[dict[str, Any]]) -> list[int]:
    return [row for batch in batches for row in batch["id"].tolist()]


def loader(dataset: TableDataset, workers: int) -> StatefulDataLoader:
    context = "forkserver" if workers else None
    return StatefulDataLoader(dataset, batch_size=None, num_workers=workers, multiprocessing_context=context)


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "workers"), [(3, 1), (1, 0), (4, 2)])
def test_real_loaders_saved_as_2x2_resume_as_other_topologies(
    make_table: Callable[..., TableSpec], world_size: int, workers: int
) -> None:
    sizes = [3000, 700, 0, 4100, 2500, 1800]
    spec = make_table(sizes, seed=9, columns=["id"], filter=KEEP_TEXT)
    delivered: list[int] = []
    states: list[dict[str, Any]] = []
    for rank, stop in ((0, 5), (1, 9)):
        saving = loader(TableDataset(spec, batch_size=300, rank=rank, world_size=2), 2)
        reading = iter(saving)
        delivered += ids([next(reading) for _ in range(stop)])
        states += consumer_states(saving.state_dict())
    for rank in range(world_size):
        dataset = TableDataset(spec, batch_size=300, rank=rank, world_size=world_size)
        dataset.load_elastic(states)
        delivered += ids(list(loader(dataset, workers)))
    assert sorted(delivered) == kept_ids(sizes, seed=9)


def test_elastic_resume_refuses_what_it_cannot_replan(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([500, 500], columns=["id"])
    one = TableDataset(spec, batch_size=100, rank=0, world_size=2)
    next(iter(one))
    with pytest.raises(ValueError, match=r"needs each of the 2 consumers of the saved 2 ranks x 1 workers once"):
        TableDataset(spec, batch_size=100).load_elastic([one.state_dict()])
    other = make_table([500, 500], columns=["id"])
    with pytest.raises(ValueError, match="the states were saved reading version"):
        TableDataset(other, batch_size=100).load_elastic([one.state_dict()])


def test_a_state_of_another_batch_size_names_load_elastic_which_continues_it(
    make_table: Callable[..., TableSpec],
) -> None:
    spec = make_table([500, 300], columns=["id"])
    saving = loader(TableDataset(spec, batch_size=64), 0)
    reading = iter(saving)
    delivered = ids([next(reading) for _ in range(3)])
    states = consumer_states(saving.state_dict())
    with pytest.raises(ValueError, match=r"batch_size: saved 64, now 96\); .* another size with load_elastic"):
        TableDataset(spec, batch_size=96).load_state_dict(states[0])
    resumed = TableDataset(spec, batch_size=96)
    resumed.load_elastic(states)
    rest = list(loader(resumed, 0))
    assert [len(batch["id"]) for batch in rest] == [96] * 6 + [32]
    assert sorted(delivered + ids(rest)) == list(range(800))
