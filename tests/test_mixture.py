"""Mixtures of tables: each table's rows arrive in its own order and each stop rule ends the epoch
where it says, the row proportions track the weights, and resume = uninterrupted, compared by
row ids and by the table each batch came from; properties over random layouts, and through a
real StatefulDataLoader."""

from __future__ import annotations

import itertools
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader

from spiral_lightning import Mixture, TableDataset, TableSpec
from spiral_lightning.datasets.mixture import STOP_MODES, Stop, pass_epoch
from tests.examples import examples
from tests.loaders import stopped_and_resumed
from tests.tables import BACKENDS, KEEP_TEXT, write_layout

EXAMPLES = examples(40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
layouts = st.lists(
    st.tuples(
        st.lists(st.integers(0, 300), min_size=1, max_size=3),
        st.sampled_from(BACKENDS),
        st.booleans(),
        st.integers(1, 5),
    ),
    min_size=1,
    max_size=3,
)
#: One delivered batch: the index of its table and its row ids.
Delivered = tuple[int, list[int]]


@contextmanager
def tables(layout: list[tuple[list[int], str, bool, int]]) -> Iterator[list[tuple[TableSpec, float]]]:
    root = Path(tempfile.mkdtemp(prefix="mixture-"))
    try:
        yield [
            (
                replace(
                    write_layout(root / f"t{index}", sizes, index, backend), filter=KEEP_TEXT if filtered else None
                ),
                weight,
            )
            for index, (sizes, backend, filtered, weight) in enumerate(layout)
        ]
    finally:
        shutil.rmtree(root)


def delivered(batches: Any) -> list[Delivered]:
    return [(int(batch["table"]), batch["id"].tolist()) for batch in batches]


def rows_of(batches: list[Delivered], table: int) -> list[int]:
    return [row for index, ids in batches if index == table for row in ids]


def one_pass(spec: TableSpec, batch_size: int, rank: int, world_size: int) -> list[int]:
    """The rows one consumer reads from ``spec`` in one pass, as a table dataset delivers them."""
    dataset = TableDataset(spec, batch_size=batch_size, rank=rank, world_size=world_size)
    return [row for batch in dataset for row in batch["id"].tolist()]


@EXAMPLES
@given(
    layout=layouts,
    stop=st.sampled_from(STOP_MODES),
    seed=st.integers(0, 1000),
    batch_size=st.integers(4, 60),
    world_size=st.integers(1, 2),
    epoch=st.integers(0, 3),
    cut=st.floats(0, 1),
)
def test_each_table_arrives_in_order_until_the_stop_rule_and_resumes_exactly(
    layout: list[tuple[list[int], str, bool, int]],
    stop: Stop,
    seed: int,
    batch_size: int,
    world_size: int,
    epoch: int,
    cut: float,
) -> None:
    with tables(layout) as pairs:
        seen: list[set[int]] = [set() for _ in pairs]
        for rank in range(world_size):

            def mixture(specs: list[tuple[TableSpec, float]] = pairs, rank: int = rank) -> Mixture:
                made = Mixture(
                    specs,
                    batch_size=batch_size,
                    seed=seed,
                    columns=["id"],
                    stop=stop,
                    rank=rank,
                    world_size=world_size,
                    table_key="table",
                )
                made.set_epoch(epoch)
                return made

            whole = delivered(mixture())
            assert delivered(mixture()) == whole
            assert mixture().batches(0) == len(whole), "counted ahead, the epoch has another length"
            passes = [one_pass(replace(spec, columns=("id",)), batch_size, rank, world_size) for spec, _ in pairs]
            complete, ended = [], []
            for index, rows in enumerate(passes):
                got = rows_of(whole, index)
                full, rest = divmod(len(got), len(rows)) if rows else (0, len(got))
                assert got == rows * full + rows[:rest], f"table {index} arrives out of its order"
                complete.append(full >= 1 or not rows)
                ended.append(full == 1 and rest == 0)
                if stop == "first_exhausted":
                    assert full <= 1 and (full == 0 or rest == 0)
                    assert not seen[index] & set(got), "a row reached two consumers"
                    seen[index] |= set(got)
            assert all(complete) if stop == "cycle" else any(complete)
            # The epoch ends as soon as the table whose end fires the stop rule is found out: that
            # table was read through exactly once, or had no rows for this consumer.
            assert any(end or not rows for end, rows in zip(ended, passes, strict=True))

            stop_at = int(cut * len(whole))
            first = mixture()
            reading = iter(first)
            before = [next(reading) for _ in range(stop_at)]
            second = mixture()
            second.load_state_dict(first.state_dict())
            assert delivered(before) + delivered(second) == whole


def test_proportions_stay_within_two_percent_of_the_weights_over_100000_rows(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    """Three tables of two backends and three schemas, projected onto their common columns."""
    extra = pa.table(
        {"id": np.arange(30_000, dtype=np.int64), "x": np.zeros(30_000, np.float32), "label": ["a"] * 30_000}
    )
    pq.write_table(extra, tmp_path / "extra.parquet", row_group_size=7_000)
    weights = [0.5, 0.3, 0.2]
    mixture = Mixture(
        [
            (make_table([40_000, 20_000], backend="spiral"), weights[0]),
            (make_table([9_000, 6_000], backend="parquet", columns=["id", "x", "score"]), weights[1]),
            (f"parquet:{tmp_path / 'extra.parquet'}", weights[2]),
        ],
        batch_size=97,
        seed=4,
        columns=["id", "x"],
        stop="cycle",
        table_key="table",
    )
    rows = [0, 0, 0]
    for batch in mixture:
        assert sorted(batch) == ["id", "table", "x"]
        rows[batch["table"]] += len(batch["id"])
        if sum(rows) >= 100_000:
            break
    assert sum(rows) >= 100_000
    for table, weight in enumerate(weights):
        assert abs(rows[table] / sum(rows) - weight) < 0.02, (rows, weights)


def test_cycled_tables_read_a_new_table_epoch_per_pass() -> None:
    assert [pass_epoch(0, passes) for passes in range(4)] == [0, 2, 5, 9]
    pairs = {(epoch, passes) for epoch in range(30) for passes in range(30)}
    assert len({pass_epoch(*pair) for pair in pairs}) == len(pairs)


def test_bad_tables_columns_weights_and_states_are_named(make_table: Callable[..., TableSpec]) -> None:
    narrow = make_table([50], backend="parquet", columns=["id", "score"])
    wide = make_table([60], backend="spiral")
    with pytest.raises(ValueError, match=r"table 1 of the mixture .* lacks the column 'x'"):
        Mixture([(wide, 1), (narrow, 1)], batch_size=8, columns=["id", "x"])
    with pytest.raises(ValueError, match=r"table 0 of the mixture .*unknown columns \['label'\]"):
        Mixture([(wide, 1)], batch_size=8, columns=["id", "label"])
    with pytest.raises(ValueError, match="weight of table 0 of the mixture must be a positive number"):
        Mixture([(wide, 0)], batch_size=8)
    with pytest.raises(TypeError, match="has no length"):
        len(Mixture([(wide, 1)], batch_size=8))
    saved = Mixture([(wide, 1), (narrow, 3)], batch_size=8, seed=1, columns=["id"])
    next(iter(saved))
    state = saved.state_dict()
    with pytest.raises(ValueError, match="seed: saved 1, now 2"):
        Mixture([(wide, 1), (narrow, 3)], batch_size=8, seed=2, columns=["id"]).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size: saved 8, now 9"):
        Mixture([(wide, 1), (narrow, 3)], batch_size=9, seed=1, columns=["id"]).load_state_dict(state)
    with pytest.raises(ValueError, match="since must be 2 non-negative ints"):
        Mixture([(wide, 1), (narrow, 3)], batch_size=8, seed=1, columns=["id"]).load_state_dict({**state, "since": [1]})
    broken = {**state, "tables": [{**state["tables"][0], "rows": -1}, state["tables"][1]]}
    with pytest.raises(ValueError, match=r"tables\[0\]\.rows must be a non-negative int"):
        Mixture([(wide, 1), (narrow, 3)], batch_size=8, seed=1, columns=["id"]).load_state_dict(broken)
    live = next(index for index, table in enumerate(state["tables"]) if table["state"] is not None)
    moved = {
        **state,
        "tables": [{**table, "passes": 1} if index == live else table for index, table in enumerate(state["tables"])],
    }
    with pytest.raises(ValueError, match=rf"tables\[{live}\]\.state is for table epoch 0, but pass 1"):
        Mixture([(wide, 1), (narrow, 3)], batch_size=8, seed=1, columns=["id"]).load_state_dict(moved)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_the_mixture_exactly(make_table: Callable[..., TableSpec], workers: int) -> None:
    pairs = [
        (make_table([2_000, 500, 3_000], seed=4, backend="spiral", filter=KEEP_TEXT), 3.0),
        (make_table([800, 1_200], seed=2, backend="parquet"), 1.0),
    ]

    def loader() -> StatefulDataLoader:
        dataset = Mixture(pairs, batch_size=64, seed=7, columns=["id", "x"], stop="cycle", table_key="table")
        context = "forkserver" if workers else None
        return StatefulDataLoader(dataset, batch_size=None, num_workers=workers, multiprocessing_context=context)

    whole = delivered(loader())
    assert {table for table, _ in whole} == {0, 1}
    assert loader().dataset.batches(workers) == len(whole)
    before, after = stopped_and_resumed(loader, 9)
    assert delivered(before) + delivered(after) == whole


@pytest.mark.slow
def test_each_worker_cycles_its_tables_on_its_own_and_resumes_exactly(make_table: Callable[..., TableSpec]) -> None:
    # Worker 0 reads table 1's 8-row split and starts many passes of it while worker 1 is still in
    # the first pass of its 400 rows: each worker's table epochs are its own, so every worker's
    # state names its own pass, and a resume anywhere equals the uninterrupted epoch.
    pairs = [
        (make_table([400, 400], seed=4, backend="spiral"), 1.0),
        (make_table([8, 400], seed=2, backend="parquet"), 1.0),
    ]

    def loader() -> StatefulDataLoader:
        dataset = Mixture(pairs, batch_size=4, seed=7, columns=["id"], stop="cycle", table_key="table")
        return StatefulDataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context="forkserver")

    whole = delivered(loader())
    assert len(rows_of(whole, 1)) > len(set(rows_of(whole, 1)))
    for stop in (31, 150):
        before, after = stopped_and_resumed(loader, stop)
        assert delivered(before) + delivered(after) == whole


@pytest.mark.slow
def test_set_epoch_reaches_persistent_workers(make_table: Callable[..., TableSpec]) -> None:
    pairs = [(make_table([120, 80], seed=1, backend="spiral"), 2.0), (make_table([60, 90], seed=3), 1.0)]

    def mixture(epoch: int) -> Mixture:
        made = Mixture(pairs, batch_size=10, seed=5, columns=["id"], table_key="table")
        made.set_epoch(epoch)
        return made

    def loader(dataset: Mixture, persistent: bool) -> StatefulDataLoader:
        return StatefulDataLoader(
            dataset, batch_size=None, num_workers=2, multiprocessing_context="forkserver", persistent_workers=persistent
        )

    kept = mixture(0)
    persistent = loader(kept, persistent=True)
    epochs = []
    for epoch in range(3):
        kept.set_epoch(epoch)
        epochs.append(delivered(persistent))
    for epoch in (1, 2):
        assert epochs[epoch] == delivered(loader(mixture(epoch), persistent=False))
    assert epochs[1] != epochs[0]


def test_new_weights_on_resume_shape_the_rows_after_the_stop_and_lose_none(
    make_table: Callable[..., TableSpec],
) -> None:
    first_table, second_table = make_table([4000], columns=["id"]), make_table([4000], seed=1, columns=["id"])

    def mixture(weights: tuple[float, float]) -> Mixture:
        pairs = [(first_table, weights[0]), (second_table, weights[1])]
        return Mixture(pairs, batch_size=10, seed=3, columns=["id"], table_key="table")

    saving = mixture((3, 1))
    reading = iter(saving)
    before = delivered([next(reading) for _ in range(40)])
    changed = mixture((1, 3))
    changed.load_state_dict(saving.state_dict())
    after = delivered(changed)
    shares = [len(rows_of(before, table)) for table in (0, 1)], [len(rows_of(after[:40], table)) for table in (0, 1)]
    # Within a batch of each table: 3 to 1 before the stop, 1 to 3 in the 40 batches after it.
    assert abs(shares[0][0] - 300) <= 10 and abs(shares[1][1] - 300) <= 10, shares
    for table in (0, 1):
        got = rows_of(before, table) + rows_of(after, table)
        assert got == list(range(len(got))), "a row of a table came twice or was skipped"
    # A state saved under the new weights keeps where they took effect: its resume is exact.
    again = mixture((1, 3))
    again.load_state_dict(saving.state_dict())
    reading = iter(again)
    middle = delivered([next(reading) for _ in range(25)])
    assert again.state_dict()["since"] and middle == after[:25]
    last = mixture((1, 3))
    last.load_state_dict(again.state_dict())
    assert middle + delivered(last) == after


def test_a_collate_of_numpy_columns_keeps_the_proportions(make_table: Callable[..., TableSpec]) -> None:
    # The turn rule counts each batch's rows, whatever its collate makes of them.
    pairs = [(make_table([3000], columns=["id"]), 3.0), (make_table([3000], seed=1, columns=["id"]), 1.0)]
    mixture = Mixture(pairs, batch_size=10, table_key="table", collate=lambda batch: {"id": batch["id"].to_numpy()})
    tables = [int(batch["table"]) for batch in itertools.islice(mixture, 400)]
    assert tables.count(1) == pytest.approx(100, abs=2)
