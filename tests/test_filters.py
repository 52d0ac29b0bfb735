"""The filter language: one text, the same rows on every backend; errors quote the offending part."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from spiral_lightning import (
    PackedDataset,
    TableDataset,
    TableMapDataset,
    TableSpec,
    WindowDataset,
    Windows,
    write_table,
)
from spiral_lightning.core.filters import And, Compare, InSet, IsNull, Like, Not, Or, parse
from tests.tables import BACKENDS, KEEP_TEXT

ROWS = 200


def mixed_table() -> pa.Table:
    generator = np.random.default_rng(1)
    names = ["cat", "catalog", "dog", "cow", None, "Cat", "c_t", "scatter"]
    return pa.table(
        {
            "id": pa.array(np.arange(ROWS, dtype=np.int64)),
            "label": pa.array(generator.integers(0, 10, ROWS).astype(np.int32)),
            "small": pa.array(generator.integers(0, 200, ROWS).astype(np.uint8)),
            "score": pa.array(generator.random(ROWS).astype(np.float32)),
            "weight": pa.array([None if i % 7 == 0 else float(i) for i in range(ROWS)], pa.float64()),
            "name": pa.array([names[i % len(names)] for i in range(ROWS)]),
            "flag": pa.array([i % 3 == 0 for i in range(ROWS)]),
        }
    )


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TableSpec]:
    root = tmp_path_factory.mktemp("filters")
    data = mixed_table()
    return {
        "spiral": write_table(f"spiral:{root / 'spiral'}", data, split_rows=64),
        "parquet": write_table(f"parquet:{root / 'parquet'}", data, split_rows=64),
    }


def rows(spec: TableSpec, text: str) -> list[int]:
    dataset = TableDataset(TableSpec(spec.uri, columns=["id"], filter=text, files=spec.files), batch_size=50)
    return [row for batch in dataset for row in batch["id"].tolist()]


def expected(predicate: Callable[[dict[str, object]], bool | None]) -> list[int]:
    return [row["id"] for row in mixed_table().to_pylist() if predicate(row)]  # type: ignore[misc]


CASES: list[tuple[str, Callable[[dict[str, object]], bool | None]]] = [
    ("label < 5", lambda r: r["label"] < 5),  # type: ignore[operator]
    ("5 > label", lambda r: r["label"] < 5),  # type: ignore[operator]
    ("small >= 100 AND flag = TRUE", lambda r: r["small"] >= 100 and r["flag"]),  # type: ignore[operator]
    ("score < 0.25 OR label IN (1, 2, 3)", lambda r: r["score"] < 0.25 or r["label"] in (1, 2, 3)),  # type: ignore[operator]
    ("label BETWEEN 2 AND 4", lambda r: 2 <= r["label"] <= 4),  # type: ignore[operator]
    ("NOT label BETWEEN 2 AND 4", lambda r: not 2 <= r["label"] <= 4),  # type: ignore[operator]
    ("name LIKE 'cat%'", lambda r: r["name"] is not None and r["name"].startswith("cat")),  # type: ignore[attr-defined]
    ("name LIKE 'c_t'", lambda r: r["name"] in ("cat", "c_t")),
    ("name IS NULL", lambda r: r["name"] is None),
    ("name IS NOT NULL AND weight IS NOT NULL", lambda r: r["name"] is not None and r["weight"] is not None),
    ("NOT name = 'dog'", lambda r: r["name"] is not None and r["name"] != "dog"),
    (
        "name != 'dog' AND (weight > 50 OR label = 0)",
        lambda r: (
            r["name"] not in (None, "dog") and ((r["weight"] is not None and r["weight"] > 50) or r["label"] == 0)
        ),
    ),  # type: ignore[operator]
    ("weight > -1.5", lambda r: r["weight"] is not None),
    # A long list: spiral-sdk decodes no expression nested hundreds deep, so its ORs are a balanced tree.
    (f"id NOT IN ({', '.join(map(str, range(0, 600, 2)))})", lambda r: r["id"] % 2 == 1),  # type: ignore[operator]
]


@pytest.mark.parametrize(("text", "predicate"), CASES, ids=[case[0] for case in CASES])
def test_one_text_keeps_the_same_rows_on_every_backend(
    both: dict[str, TableSpec], text: str, predicate: Callable[[dict[str, object]], bool | None]
) -> None:
    want = expected(predicate)
    assert rows(both["spiral"], text) == want
    assert rows(both["parquet"], text) == want


def test_parse_builds_the_tree() -> None:
    tree = parse("a < 1 AND (b IN ('x', 'y') OR NOT c IS NULL) AND d LIKE 'p%' AND e BETWEEN -2 AND 2.5")
    assert tree == And(
        And(
            And(Compare("a", "<", 1), Or(InSet("b", ("x", "y")), Not(IsNull("c")))),
            Like("d", "p%"),
        ),
        And(Compare("e", ">=", -2), Compare("e", "<=", 2.5)),
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("label <", "cannot parse the filter 'label <'"),
        ("label + 1 > 2", r"expected a column name, not 'label \+ 1'"),
        ("label = other", "expected a literal, not 'other'"),
        ("lower(name) = 'x'", r"expected a column name, not 'LOWER\(name\)'"),
        ("name LIKE 3", "LIKE takes a string pattern"),
        ("label IN (SELECT 1)", "which the filter language does not have"),
    ],
)
def test_text_the_language_lacks_is_quoted(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TableSpec("spiral:/anywhere", filter=text)


@pytest.mark.parametrize("backend", ["spiral", "parquet"])
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nope = 1", r"unknown column 'nope' in the filter 'nope = 1'; the table has \['id', 'label'"),
        ("label = 'x'", "column 'label' has type int32, which the literal 'x' in \"label = 'x'\" is not"),
        ("label < 2.5", "column 'label' has type int32, which the literal 2.5"),
        ("small < -1", "the literal -1 in 'small < -1' is out of the range of column 'small' \\(uint8\\)"),
        ("name LIKE 'a%' AND flag = 1", "column 'flag' has type bool, which the literal 1"),
        ("label LIKE 'a%'", "column 'label' has type int32, which the literal 'a%'"),
    ],
)
def test_text_that_does_not_fit_the_schema_is_quoted(
    both: dict[str, TableSpec], backend: str, text: str, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        rows(both[backend], text)


@given(st.text(max_size=40))
def test_any_text_parses_or_fails_with_a_value_error(text: str) -> None:
    try:
        parse(text)
    except ValueError as error:
        assert str(error)


def test_floats_compare_with_float32_columns_without_coercion_errors(tmp_path: Path) -> None:
    data = pa.table({"id": pa.array([0, 1, 2]), "x": pa.array([0.5, 1.5, 2.5], pa.float32())})
    spec = write_table(f"spiral:{tmp_path / 't'}", data)
    assert rows(spec, "x > 1") == [1, 2]
    assert rows(spec, "x <= 1.5") == [0, 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_datasets_take_columns_and_a_filter_as_the_spec_does(
    make_table: Callable[..., TableSpec], backend: str
) -> None:
    spec = make_table([300, 200], backend=backend)
    selected = replace(spec, columns=("id",), filter=KEEP_TEXT)
    expected = [int(i) for batch in TableDataset(selected) for i in batch["id"]]
    assert expected
    dataset = TableDataset(spec.uri, columns=["id"], filter=KEEP_TEXT, batch_size=64)
    assert dataset.spec.columns == ("id",)
    assert [int(i) for batch in dataset for i in batch["id"]] == expected
    assert all(sorted(batch) == ["id"] for batch in dataset)
    rows = TableMapDataset(spec.uri, columns=["id"], filter=KEEP_TEXT)
    assert [int(rows[index]["id"]) for index in range(len(rows))] == expected
    with pytest.raises(ValueError, match="selects its own columns"):
        TableDataset(selected, columns=["x"])


def test_windows_and_packed_streams_take_a_filter_too(make_table: Callable[..., TableSpec], tmp_path: Path) -> None:
    spec = make_table([300, 200])
    windows = Windows(size=4, stride=4)
    by_spec = WindowDataset(replace(spec, filter=KEEP_TEXT), windows=windows, batch_size=8, collate=None)
    by_argument = WindowDataset(spec.uri, windows=windows, batch_size=8, collate=None, filter=KEEP_TEXT)
    expected = [batch.column("id").to_pylist() for batch in by_spec]
    assert expected
    assert [batch.column("id").to_pylist() for batch in by_argument] == expected

    # Document i holds the token i + 1, so the tokens show which documents were packed.
    documents = pa.array([[i + 1] * (1 + i % 5) for i in range(40)], pa.list_(pa.int32()))
    corpus = write_table(
        f"parquet:{tmp_path / 'corpus'}", pa.table({"id": range(40), "tokens": documents}), split_rows=10
    )
    packed = PackedDataset(corpus.uri, column="tokens", length=8, batch_size=2, filter="id < 20")
    whole = PackedDataset(replace(corpus, filter="id < 20"), column="tokens", length=8, batch_size=2)
    blocks = [batch["tokens"].tolist() for batch in packed]
    assert blocks == [batch["tokens"].tolist() for batch in whole]
    tokens = {token for batch in blocks for block in batch for token in block}
    assert tokens <= set(range(21))
    assert 20 in tokens
