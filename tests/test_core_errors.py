"""Bad input gets an error that names the thing and the fix: never a hang or wrong rows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import spiral
from torch.utils.data import DataLoader

from spiral_lightning import (
    Mixture,
    PackedDataset,
    Shard,
    Shuffled,
    Split,
    TableDataset,
    TableMapDataset,
    TableSpec,
    WindowDataset,
    Windows,
    WorkItem,
    balanced,
    stripe,
    write_table,
)
from spiral_lightning.core.media import Image
from tests.tables import BACKENDS

SIZES = [300, 500, 200]


@pytest.mark.parametrize("backend", BACKENDS)
def test_unknown_column_is_named_when_the_dataset_is_built(make_table: Callable[..., TableSpec], backend: str) -> None:
    spec = make_table(SIZES, backend=backend, columns=["id", "nope"])
    with pytest.raises(ValueError, match=r"unknown columns \['nope'\].*the table has \['id', 'score', 'x', 'v'\]"):
        TableDataset(spec)
    with pytest.raises(ValueError, match=r"unknown columns \['nope'\]"):
        TableMapDataset(spec)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unknown_media_column_and_filter_column_are_named_when_the_dataset_is_built(
    make_table: Callable[..., TableSpec], backend: str
) -> None:
    with pytest.raises(ValueError, match=r"media projections name columns \['photo'\].*it returns \['id', 'x'\]"):
        TableDataset(make_table(SIZES, backend=backend, columns=["id", "x"], media=(Image("photo"),)))
    with pytest.raises(ValueError, match="weight"):
        TableDataset(make_table(SIZES, backend=backend, filter="weight > 3"))


def test_policies_are_named_or_refused_when_the_dataset_is_built(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table(SIZES)
    assert TableDataset(spec, policy="balanced").policy is balanced
    assert TableDataset(spec, policy="shuffled").policy == Shuffled(seed=0)
    with pytest.raises(ValueError, match=r"unknown policy 'balance'; name one of \['balanced', 'stripe', 'shuffled'\]"):
        TableDataset(spec, policy="balance")
    with pytest.raises(ValueError, match="a policy is a function"):
        TableDataset(spec, policy=3)  # type: ignore[arg-type]


def test_a_filter_syntax_error_speaks_of_the_filter_not_the_parser() -> None:
    with pytest.raises(ValueError, match=r"cannot parse the filter 'x >': '>' at column 3 has nothing") as error:
        TableSpec("parquet:/tmp/t", filter="x >")
    assert "sqlglot" not in str(error.value) and "\x1b" not in str(error.value)


def test_filter_the_table_cannot_run_is_named(make_table: Callable[..., TableSpec]) -> None:
    # x is float32 and a Python float literal is float64: Spiral does not coerce.
    bad = spiral.lt(spiral.column("x"), spiral.literal(0.5))
    with pytest.raises(ValueError, match=r"the filter .* cannot scan .*Cannot compare different DTypes f32"):
        TableDataset(make_table(SIZES, filter=bad))


def test_missing_table_root(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no Spiral table at .*nothing.*the folder does not exist"):
        TableDataset(f"spiral:{tmp_path / 'nothing'}")


def test_folder_without_ids(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"holds no spiral-lightning.json.*resource_id=\.\.&version_id="):
        TableDataset(f"spiral:{tmp_path}")


def test_wrong_ids(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table(SIZES)
    root = spec.uri.split("?", 1)[0]
    version_id = spec.version.split("@")[1]
    wrong = f"{root}?resource_id=00000000-0000-0000-0000-000000000000&version_id={version_id}"
    with pytest.raises(ValueError, match="cannot open version 00000000-0000-0000-0000-000000000000@"):
        TableDataset(wrong)


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("lance:/data", "unknown table scheme .lance."),
        ("spiral:", "looks like 'spiral:<root folder>'"),
        ("spiral://project", r"looks like 'spiral://<project>/<path>\[@v<version>\]'"),
        ("spiral:/t?resource_id=a", "must give both resource_id and version_id"),
        ("spiral:/t?resource_id=a&version_id=b&x=1", r"unknown query fields \['x'\]"),
        ("no-scheme", "a table uri looks like"),
    ],
)
def test_malformed_uris(uri: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TableSpec(uri).resolve()


@pytest.mark.parametrize("batch_size", [0, -3, 2.5, True])
def test_batch_size_must_be_positive(make_table: Callable[..., TableSpec], batch_size: object) -> None:
    with pytest.raises(ValueError, match="batch_size must be a positive int or None"):
        TableDataset(make_table(SIZES), batch_size=batch_size)  # type: ignore[arg-type]


def test_bad_last_and_rank(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table(SIZES)
    with pytest.raises(ValueError, match="last must be one of"):
        TableDataset(spec, last="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank 2 is not a rank of a world of size 2"):
        TableDataset(spec, rank=2, world_size=2)
    with pytest.raises(ValueError, match="pass rank and world_size together"):
        TableDataset(spec, rank=0)


def test_require_full_names_the_leftover_rows(make_table: Callable[..., TableSpec]) -> None:
    dataset = TableDataset(make_table(SIZES), batch_size=300, last="require_full")
    batches = []
    with pytest.raises(ValueError, match="100 rows remain after this consumer's last full batch of 300"):
        batches.extend(dataset)
    assert [len(batch["id"]) for batch in batches] == [300, 300, 300]


def test_state_from_other_settings_names_each_field(make_table: Callable[..., TableSpec]) -> None:
    spec, other = make_table(SIZES), make_table(SIZES)
    saved = TableDataset(spec, batch_size=100, rank=0, world_size=2)
    next(iter(saved))
    state = saved.state_dict()
    with pytest.raises(ValueError, match="batch_size: saved 100, now 50") as error:
        TableDataset(other, batch_size=50, rank=1, world_size=2).load_state_dict(state)
    assert "version: saved" in str(error.value)
    assert "shard: saved Shard(rank=0, world_size=2, worker=0, workers=1), now Shard(rank=1" in str(error.value)


def reversed_stripe(plan: Sequence[Split], shard: Shard, epoch: int = 0) -> list[WorkItem]:
    return stripe(plan, shard, epoch)[::-1]


def test_state_from_other_policy(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table(SIZES)
    saved = TableDataset(spec, batch_size=100, policy="stripe")
    next(iter(saved))
    with pytest.raises(
        ValueError, match=r"policy: saved 'spiral_lightning\.work\.stripe', now 'tests\.test_core_errors"
    ):
        TableDataset(spec, batch_size=100, policy=reversed_stripe).load_state_dict(saved.state_dict())


class Stripes:
    """A policy whose work lists depend on a setting: the same name with other lists."""

    def __init__(self, backwards: bool) -> None:
        self.backwards = backwards

    def __call__(self, plan: Sequence[Split], shard: Shard, epoch: int) -> list[WorkItem]:
        items = stripe(plan, shard, epoch)
        return items[::-1] if self.backwards else items


def test_cursor_never_applies_to_another_work_list(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table(SIZES)
    saved = TableDataset(spec, batch_size=100, policy=Stripes(False))
    next(iter(saved))
    restored = TableDataset(spec, batch_size=100, policy=Stripes(True))
    # Refused when the state is loaded, before any row is read.
    with pytest.raises(ValueError, match="another work list in epoch 0"):
        restored.load_state_dict(saved.state_dict())


def restorer(kind: str, spec: TableSpec, tmp_path: Path) -> Callable[[Any], None]:
    """``load_state_dict`` of a small dataset of ``kind`` over ``spec`` (a packed one over a table of
    documents written under ``tmp_path``)."""
    if kind == "Mixture":
        return Mixture([(spec, 1.0)], batch_size=4).load_state_dict
    if kind == "WindowDataset":
        return WindowDataset(spec, windows=Windows(3), batch_size=4).load_state_dict
    if kind == "PackedDataset":
        documents = pa.table({"tokens": pa.array([[1, 2, 3], [4, 5, 6, 7, 8]], pa.list_(pa.int32()))})
        packed = write_table(f"parquet:{tmp_path}/documents", documents)
        return PackedDataset(packed.uri, column="tokens", length=4, batch_size=2).load_state_dict
    return TableDataset(spec, batch_size=4).load_state_dict


@pytest.mark.parametrize("kind", ["TableDataset", "Mixture", "WindowDataset", "PackedDataset"])
@pytest.mark.parametrize(
    ("state", "error", "message"),
    [
        ([1, 2], TypeError, "a {kind} state is a mapping, not list"),
        # "packing" keeps a PackedDataset from first refusing the state as another kind's.
        ({"format": 9, "packing": None}, ValueError, "unknown {kind} state format 9; this version reads format 1"),
        ({"format": 1, "packing": None}, KeyError, r"the {kind} state lacks the fields \['"),
    ],
)
def test_malformed_states_are_refused_naming_the_kind(
    make_table: Callable[..., TableSpec],
    tmp_path: Path,
    kind: str,
    state: object,
    error: type[Exception],
    message: str,
) -> None:
    load = restorer(kind, make_table([40, 40], columns=["id"]), tmp_path)
    with pytest.raises(error, match=message.format(kind=kind)):
        load(state)


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_never_overwrites(tmp_path: Path, backend: str) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is not an empty folder; write_table never overwrites"):
        write_table(f"{backend}:{tmp_path / 'busy'}", pa.table({"id": [1]}))
    assert (tmp_path / "busy" / "file").read_text() == "x"


@pytest.mark.slow
def test_fork_after_use_is_refused_with_the_fix(make_table: Callable[..., TableSpec]) -> None:
    dataset = TableDataset(make_table(SIZES), batch_size=100)
    assert len(dataset) == 1000
    loader = DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context="fork")
    with pytest.raises(RuntimeError, match="multiprocessing_context='forkserver' or 'spawn'"):
        next(iter(loader))
