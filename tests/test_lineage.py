"""Every re-plan's lineage is one type, ``planning.lineage.Lineage``: the same plain-dict form,
digest and refusal of a damaged dictionary for rows, mixtures and map access. The dictionaries
and digests below are pinned: checkpoints saved before the type was shared keep them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from spiral_lightning.planning.elastic_map import MapLineage, MapLink
from spiral_lightning.planning.elastic_mixture import MixtureLineage, MixtureStart
from spiral_lightning.planning.lineage import Lineage, Link, RowLineage

BALANCED = "spiral_lightning.work.balanced"


def ints(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


PLAIN = Link(2, 1, ints(1, 3), ints(10, 70), ints(0, 0), ints(0, 0), ints(0, 0))
WINDOWED = Link(1, 2, ints(0, 2), ints(5, 40), ints(3, 0), ints(7, 0), ints(0, 2))
ROWS = RowLineage("v1", BALANCED, 2, (PLAIN, WINDOWED), "spiral_lightning.work.stripe")
MIXTURE = MixtureLineage(MixtureStart(2, (0, 1), (30, 12)), (RowLineage("v1", BALANCED, 2, (PLAIN,)),))
MAP = MapLineage(100, 7, 1, (MapLink(2, (4, 6)),), 3)

PLAIN_DICT = {"world_size": 2, "workers": 1, "items": [1, 3], "rows": [10, 70]}
ROWS_DICT = {
    "format": 1,
    "version": "v1",
    "policy": BALANCED,
    "epoch": 2,
    "links": [
        PLAIN_DICT,
        {"world_size": 1, "workers": 2, "items": [0, 2], "rows": [5, 40], "windows": [3, 0], "taken": [7, 0]}
        | {"leads": [0, 2]},
    ],
    "share": "spiral_lightning.work.stripe",
}
MIXTURE_DICT = {
    "format": 1,
    "epoch": 2,
    "passes": [0, 1],
    "rows": [30, 12],
    "tables": [{"format": 1, "version": "v1", "policy": BALANCED, "epoch": 2, "links": [PLAIN_DICT]}],
}
MAP_DICT = {
    "format": 1,
    "rows": 100,
    "seed": 7,
    "epoch": 1,
    "links": [{"world_size": 2, "delivered": [4, 6]}],
    "batches": 3,
}


@pytest.mark.parametrize(
    ("lineage", "written", "digest"),
    [(ROWS, ROWS_DICT, "906e512aaa8e57a0"), (MIXTURE, MIXTURE_DICT, "f17d0520b4a82f26"), (MAP, MAP_DICT, None)],
    ids=["rows", "mixture", "map"],
)
def test_every_kind_writes_and_reads_its_pinned_dictionary_and_digest(
    lineage: Lineage, written: dict[str, Any], digest: str | None
) -> None:
    assert isinstance(lineage, Lineage)
    assert lineage.to_dict() == written
    read = type(lineage).from_dict(written)
    assert read.to_dict() == written and read.digest == lineage.digest
    if digest is not None:
        assert lineage.digest == digest
    assert len(lineage.digest) == 16 and lineage.digest != RowLineage("v2", BALANCED, 2, (PLAIN,)).digest


@pytest.mark.parametrize(
    ("kind", "damaged", "message"),
    [
        (RowLineage, {**ROWS_DICT, "format": 2}, "not a re-plan lineage of format 1"),
        (RowLineage, {**ROWS_DICT, "epoch": "two"}, "the re-plan lineage is damaged: ValueError"),
        (RowLineage, {**ROWS_DICT, "links": [{**PLAIN_DICT, "rows": [10]}]}, "holds 2 and 1 positions"),
        (MixtureLineage, MAP_DICT | {"format": 0}, "not a Mixture re-plan lineage of format 1"),
        (MixtureLineage, {**MIXTURE_DICT, "rows": [30]}, "holds 2 passes, 1 row counts and 1 table"),
        (MixtureLineage, {k: v for k, v in MIXTURE_DICT.items() if k != "tables"}, "damaged: KeyError"),
        (MapLineage, {**MAP_DICT, "links": [{"world_size": 2, "delivered": [4]}]}, r"of 2 ranks holds \[4\]"),
        (MapLineage, ["not", "a", "dict"], "not a map re-plan lineage"),
    ],
)
def test_a_damaged_dictionary_is_refused_naming_the_kind_and_field(
    kind: type[Lineage], damaged: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        kind.from_dict(damaged)
