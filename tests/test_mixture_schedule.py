"""Mixture weights that change with the step: the rows of each stretch of steps follow the weights
in force there (within a batch per table and consumer), every table's rows arrive in order and once,
a stop anywhere resumes to the uninterrupted epoch, a new schedule on resume shapes only the rows
after the stop, and an elastic re-plan keeps counting steps where the saved ranks were; all
compared by table and row ids, in process and through real DataLoader workers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from spiral_lightning import Mixture, TableSpec
from spiral_lightning.lightning.loader import consumer_states
from tests.loaders import stopped_and_resumed

#: 3:1 for the first 40 steps, then 1:3.
POINTS = [(0, [3, 1]), (40, [1, 3])]


def three_to_one_then_one_to_three(step: int) -> Sequence[float]:
    """``POINTS`` as a function: picklable, so that it reaches DataLoader workers."""
    return [3, 1] if step < 40 else [1, 3]


def delivered(batches: Any) -> list[tuple[int, list[int]]]:
    return [(int(batch["table"]), batch["id"].tolist()) for batch in batches]


def shares(batches: list[tuple[int, list[int]]]) -> list[int]:
    return [sum(len(ids) for index, ids in batches if index == table) for table in (0, 1)]


def each_once_in_order(*parts: list[tuple[int, list[int]]], ordered: bool = True) -> None:
    """Every table's rows over ``parts`` come once each: its first rows in stored order when one
    consumer read them; with several, each reads its own share of it, so only once."""
    for table in (0, 1):
        rows = [row for part in parts for index, ids in part if index == table for row in ids]
        if ordered:
            assert rows == list(range(len(rows))), f"table {table}: a row came twice, out of order or was skipped"
        assert len(set(rows)) == len(rows), f"table {table}: a row came twice"


@pytest.fixture
def pair(make_table: Callable[..., TableSpec]) -> list[tuple[TableSpec, float]]:
    return [(make_table([4000], columns=["id"]), 1.0), (make_table([4000], seed=1, columns=["id"]), 1.0)]


def mixture(pair: list[tuple[TableSpec, float]], schedule: Any = POINTS, **options: Any) -> Mixture:
    return Mixture(pair, batch_size=10, seed=3, columns=["id"], table_key="table", schedule=schedule, **options)


def test_each_stretch_of_steps_follows_its_weights_and_a_stop_anywhere_resumes_exactly(
    pair: list[tuple[TableSpec, float]],
) -> None:
    whole = delivered(mixture(pair))
    assert shares(whole[:40]) == pytest.approx([300, 100], abs=10) and shares(whole[40:80]) == pytest.approx(
        [100, 300], abs=10
    )
    each_once_in_order(whole)
    # The first table runs out first under 1:3 only after the change: the epoch's length follows the schedule.
    assert mixture(pair).batches(0) == len(whole)
    assert delivered(mixture(pair, three_to_one_then_one_to_three)) == whole
    for stop in (1, 39, 40, 41, 77):
        saving = mixture(pair)
        reading = iter(saving)
        before = delivered(next(reading) for _ in range(stop))
        assert saving.state_dict()["step"] == stop
        resumed = mixture(pair)
        resumed.load_state_dict(saving.state_dict())
        assert before + delivered(resumed) == whole, stop


def test_two_workers_take_the_ranks_steps_in_turn_and_resume_exactly(pair: list[tuple[TableSpec, float]]) -> None:
    def loader() -> Any:
        return mixture(pair, three_to_one_then_one_to_three).loader(num_workers=2)

    whole = delivered(loader())
    assert shares(whole[:40]) == pytest.approx([300, 100], abs=20) and shares(whole[40:80]) == pytest.approx(
        [100, 300], abs=20
    )
    each_once_in_order(whole, ordered=False)
    assert mixture(pair).batches(2) == len(whole)
    before, after = stopped_and_resumed(loader, 45)
    assert delivered(before) + delivered(after) == whole


def test_a_new_schedule_on_resume_shapes_only_the_rows_after_the_stop(pair: list[tuple[TableSpec, float]]) -> None:
    saving = mixture(pair)
    reading = iter(saving)
    before = delivered(next(reading) for _ in range(20))
    changed = mixture(pair, [(0, [1, 1]), (30, [1, 4])])
    changed.load_state_dict(saving.state_dict())
    after = delivered(changed)
    # Steps 20-29 at 1:1, from step 30 on at 1:4.
    assert shares(after[:10]) == pytest.approx([50, 50], abs=10) and shares(after[10:50]) == pytest.approx(
        [80, 320], abs=10
    )
    each_once_in_order(before, after)


def test_an_elastic_resume_keeps_counting_the_saved_ranks_steps(pair: list[tuple[TableSpec, float]]) -> None:
    states, before = [], []
    for rank in range(2):
        saving = mixture(pair, rank=rank, world_size=2)
        reading = iter(saving)
        before += delivered(next(reading) for _ in range(30))
        states.append(saving.state_dict())
    after = []
    resumed = mixture(pair, rank=0, world_size=1)
    resumed.load_elastic(states)
    after = delivered(resumed)
    # The saved ranks had taken 30 steps each: 10 more at 3:1, then 1:3.
    assert shares(after[:10]) == pytest.approx([75, 25], abs=10) and shares(after[10:50]) == pytest.approx(
        [100, 300], abs=10
    )
    each_once_in_order(before, after, ordered=False)
    lineage = resumed.lineage()
    assert lineage is not None and lineage["step"] == 30


def test_an_elastic_resume_through_workers_keeps_the_steps(pair: list[tuple[TableSpec, float]]) -> None:
    first = mixture(pair, three_to_one_then_one_to_three).loader(num_workers=2)
    batches = iter(first)
    before = delivered(next(batches) for _ in range(30))
    states = consumer_states(first.state_dict())
    del batches, first
    resumed = mixture(pair, three_to_one_then_one_to_three)
    resumed.load_elastic(states)
    after = delivered(resumed)
    assert shares(after[:10]) == pytest.approx([75, 25], abs=20) and shares(after[10:50]) == pytest.approx(
        [100, 300], abs=20
    )
    each_once_in_order(before, after, ordered=False)


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ([(0, [1, 1]), (0, [1, 2])], r"schedule\[1\] is at step 0, not after the point before it \(0\)"),
        ([(5, [1, 1, 1])], r"a mixture of 2 tables takes 2 weights, not \[1, 1, 1\] \(schedule\[0\]\)"),
        ([(5, [1, -1])], r"the weight of table 1 of the mixture must be a positive number, not -1 \(schedule\[0\]\)"),
        ([(-1, [1, 1])], r"the step of schedule\[0\] must be a non-negative int, not -1"),
        ("0: [1, 1]", "schedule must be a list of"),
    ],
)
def test_a_wrong_schedule_is_refused_naming_the_point(
    pair: list[tuple[TableSpec, float]], schedule: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        mixture(pair, schedule)


def test_a_schedule_function_returning_wrong_weights_names_the_step(pair: list[tuple[TableSpec, float]]) -> None:
    with pytest.raises(ValueError, match=r"positive number, not 0 \(the schedule's weights at step 40\)"):
        delivered(mixture(pair, lambda step: [1, 1] if step < 40 else [1, 0]))


def test_a_table_added_on_resume_starts_at_its_first_pass(
    pair: list[tuple[TableSpec, float]], make_table: Callable[..., TableSpec]
) -> None:
    saving = Mixture(pair[:1], batch_size=10, columns=["id"], table_key="table")
    reading = iter(saving)
    before = delivered(next(reading) for _ in range(20))
    state = saving.state_dict()
    grown = Mixture([pair[0], (make_table([300], seed=2, columns=["id"]), 1.0)], batch_size=10, table_key="table")
    grown.load_state_dict(state)
    assert grown.state_dict()["tables"][1] == {"passes": 0, "rows": 0, "empty": False, "state": None}
    after = delivered(grown)
    # From the stop on, 1:1 until the new table's 300 rows run out: the first table's rows 200-499.
    assert shares(after) == [300, 300]
    each_once_in_order(before, after)
    with pytest.raises(ValueError, match="holds 2 tables, but the mixture has 1: a table can be added"):
        Mixture(pair[:1], batch_size=10, columns=["id"]).load_state_dict(grown.state_dict())
