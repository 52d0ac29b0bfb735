"""Bad input made by hypothesis: saved states, filter text, table uris and CLI config keys.

The contract under test: malformed input raises ``ValueError``, ``TypeError`` or ``KeyError``
(``FileNotFoundError`` for a uri naming nothing) with a message, and nothing else escapes. A state
that is accepted anyway must resume inside the consumer's own work list: the rows it then
delivers are a tail of the rows the consumer delivers in a run that never stopped.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, example, given
from hypothesis import strategies as st

from spiral_lightning import TableDataset, TableSpec, balanced
from spiral_lightning.core.filters import parse
from spiral_lightning.core.state import State
from spiral_lightning.lightning.cli import main
from tests.examples import examples
from tests.tables import write_layout
from tests.test_cli import config

#: The errors bad input may raise.
CLEAN = (ValueError, TypeError, KeyError)
FUZZ = examples(150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

#: Any JSON-like value, as a corrupted or hand-written state might hold.
values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=12,
)
FIELDS = ("format", "version", "shard", "batch_size", "epoch", "policy", "work", "cursor")
OPTIONAL = ("rows_per_consumer", "delivered", "skipped", "remainder")


def assert_clean(error: BaseException) -> None:
    """Fails unless ``error`` is one bad input may raise, and says what was wrong."""
    assert isinstance(error, CLEAN), f"{type(error).__name__} escaped: {error!r}"
    assert str(error).strip("'\" "), f"{type(error).__name__} without a message"


@given(values)
@FUZZ
def test_any_value_as_a_state(value: Any) -> None:
    try:
        State.from_dict(value)
    except Exception as error:
        assert_clean(error)


@given(st.fixed_dictionaries({name: values for name in FIELDS}, optional={name: values for name in OPTIONAL}))
@FUZZ
def test_a_dict_with_every_field_of_any_value(state: dict[str, Any]) -> None:
    try:
        State.from_dict(state)
    except Exception as error:
        assert_clean(error)


@pytest.fixture(scope="module", params=["spiral", "parquet"])
def table(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TableSpec:
    """120 rows in splits of 50, 30 and 40: ``balanced`` over two ranks cuts the middle split,
    so rank 1's work list starts at stored row 10 of a split whose rows 0..9 are rank 0's."""
    root = tmp_path_factory.mktemp("fuzz") / "table"
    return replace(write_layout(root, [50, 30, 40], 0, request.param), columns=("id",))


def rank_one(spec: TableSpec) -> TableDataset:
    return TableDataset(spec, batch_size=16, policy=balanced, rank=1, world_size=2)


def ids_of(batches: Iterator[dict[str, Any]]) -> list[int]:
    return [i for batch in batches for i in batch["id"].tolist()]


#: Cursors near the real ones: item, stored row and skip in the table's range, sometimes with a
#: shuffle window and its taken rows.
cursors = st.lists(st.integers(-1, 130), min_size=3, max_size=3) | st.lists(
    st.integers(-1, 130), min_size=5, max_size=5
)


def mutations() -> st.SearchStrategy[tuple[str, Any]]:
    """One field of a state and a new value for it: any value, or a plausible one."""
    plausible = {
        "cursor": cursors,
        "shard": st.lists(st.integers(-1, 3), min_size=4, max_size=4),
        "epoch": st.integers(-1, 3),
        "batch_size": st.integers(-1, 40),
        "delivered": st.integers(-1, 200),
        "rows_per_consumer": st.integers(-1, 200),
        "remainder": st.lists(st.lists(st.integers(-1, 60), min_size=3, max_size=3), max_size=3),
    }
    any_field = st.tuples(st.sampled_from(FIELDS + OPTIONAL), values)
    near = st.sampled_from(sorted(plausible)).flatmap(lambda name: st.tuples(st.just(name), plausible[name]))
    return any_field | near


@given(saved_after=st.integers(1, 4), mutation=mutations())
# Rank 1's first item starts at stored row 10; rows 0..9 of that split are rank 0's.
@example(saved_after=1, mutation=("cursor", [0, 0, 0]))
@FUZZ
def test_a_mutated_state_raises_or_resumes_inside_its_work_list(
    table: TableSpec, saved_after: int, mutation: tuple[str, Any]
) -> None:
    uninterrupted = ids_of(iter(rank_one(table)))
    saving = rank_one(table)
    batches = iter(saving)
    for _ in range(saved_after):
        next(batches)
    state = {**saving.state_dict(), mutation[0]: mutation[1]}
    restored = rank_one(table)
    try:
        restored.load_state_dict(state)
        delivered = ids_of(iter(restored))
    except Exception as error:
        assert_clean(error)
        return
    assert delivered == uninterrupted[len(uninterrupted) - len(delivered) :], (
        f"the state with {mutation[0]}={mutation[1]!r} was accepted and delivered {delivered}, "
        f"not a tail of this consumer's rows {uninterrupted}"
    )


#: Words of the filter language and near misses, for text that is almost a filter.
WORDS = [
    "x", "id", "score", "v", "nope", "'a'", "'cat%'", "1", "-2", "0.5", "1e3", "NULL", "TRUE", "<", "<=", ">", ">=",
    "=", "!=", "<>", "AND", "OR", "NOT", "IN", "BETWEEN", "IS", "LIKE", "(", ")", ",", "+", "*", "SELECT", ";", "--",
]  # fmt: skip
filter_texts = st.text(max_size=30) | st.lists(st.sampled_from(WORDS), min_size=1, max_size=9).map(" ".join)


@given(filter_texts)
@FUZZ
def test_filter_text_parses_or_says_why(text: str) -> None:
    try:
        parse(text)
    except Exception as error:
        assert_clean(error)
        assert isinstance(error, ValueError)
    try:
        TableSpec("parquet:anywhere", filter=text)
    except Exception as error:
        assert_clean(error)


#: Filters the language has, on columns that exist or not, with literals of any type.
columns = st.sampled_from(["x", "id", "score", "v", "nope"])
literals = st.sampled_from(["'a'", "'cat%'", "1", "-2", "0.5", "1e3", "NULL", "TRUE", "''"])
atoms = (
    st.tuples(columns, st.sampled_from(["<", "<=", ">", ">=", "=", "!=", "<>"]), literals).map(" ".join)
    | columns.map("{} IS NULL".format)
    | columns.map("{} IS NOT NULL".format)
    | st.tuples(columns, st.lists(literals, min_size=1, max_size=3).map(", ".join)).map("{0[0]} IN ({0[1]})".format)
    | st.tuples(columns, literals, literals).map("{0[0]} BETWEEN {0[1]} AND {0[2]}".format)
    | st.tuples(columns, literals).map("{0[0]} LIKE {0[1]}".format)
)
filters = st.recursive(
    atoms,
    lambda inner: (
        st.tuples(inner, st.sampled_from([" AND ", " OR "]), inner).map("".join) | inner.map("NOT ({})".format)
    ),
    max_leaves=4,
)


@given(filters)
@FUZZ
def test_a_filter_compiles_against_the_table_or_says_why(table: TableSpec, text: str) -> None:
    try:
        rows = len(TableDataset(replace(table, filter=text)))
    except Exception as error:
        assert_clean(error)
        return
    assert 0 <= rows <= 120


#: Text after a scheme: relative names only, so a fuzzed uri never lists the machine's folders or
#: reaches for a network filesystem.
uri_texts = st.tuples(
    st.sampled_from(["spiral:", "parquet:", "sds:", "lance:", "", "spiral:?", "parquet:*"]), st.text(max_size=25)
).map("".join)


@given(uri_texts)
@FUZZ
def test_a_uri_resolves_or_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    rest = text.split(":", 1)[-1]
    assume("://" not in text and not rest.startswith(("/", "~", "\\")) and ".." not in rest)
    # Relative names resolve inside an empty folder, and the test's end restores the folder.
    monkeypatch.chdir(tmp_path)
    try:
        TableSpec(text).resolve()
    except FileNotFoundError as error:
        assert str(error)
    except Exception as error:
        assert_clean(error)


def data_arguments() -> set[str]:
    """The keys the demo config's data section may hold: its DataModule's arguments."""
    from spiral_lightning.demos.tabular import DemoDataModule

    return {
        name
        for cls in DemoDataModule.__mro__
        if "__init__" in vars(cls)
        for name in inspect.signature(vars(cls)["__init__"]).parameters
    }


@given(st.from_regex(r"[a-z][a-z_]{2,14}", fullmatch=True))
@examples(8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_an_unknown_data_key_in_the_yaml_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str) -> None:
    assume(key not in data_arguments())
    experiment = config(tmp_path, tmp_path / "demo", f"    {key}: 1\n")
    with pytest.raises(SystemExit) as stopped:
        main(["fit", "--config", str(experiment)])
    assert stopped.value.code != 0
    assert key in capsys.readouterr().err
