"""States with integrity: every state the library writes carries a digest of its fields, and an
edited or damaged state is refused when it is loaded, naming the field where a range shows it,
before any row is read; an intact state, and one without a digest (saved before states had
one), resume exactly. Row ids are compared with an uninterrupted read every time."""

from __future__ import annotations

import copy
import io
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from spiral_lightning import Mixture, PackedDataset, SpiralDataModule, TableDataset, TableSpec, WindowDataset, Windows
from spiral_lightning.core.integrity import DIGEST, digest_of, sealed
from spiral_lightning.demos.data import corpus_tables
from tests.examples import examples
from tests.tables import write_layout

#: Three splits; after three batches of 50 the cursor is (0, 0, 150): item 0 is split 0, rows 0..300.
SIZES = [300, 200, 500]
ROWS = sum(SIZES)
DAMAGED = "was edited or damaged"
EXAMPLES = examples(25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> TableSpec:
    return replace(write_layout(tmp_path_factory.mktemp("integrity") / "t", SIZES, 0, "spiral"), columns=("id",))


def ids(batches: Iterable[Any], key: str = "id") -> list[int]:
    return [int(value) for batch in batches for value in batch[key].reshape(-1).tolist()]


def first(dataset: Any, batches: int, key: str = "id") -> tuple[list[int], dict[str, Any]]:
    """The ids of ``dataset``'s first ``batches`` batches, and its state after them."""
    stream = iter(dataset)
    seen = ids((next(stream) for _ in range(batches)), key)
    return seen, dataset.state_dict()


def table(spec: TableSpec) -> TableDataset:
    return TableDataset(spec, batch_size=50)


@pytest.fixture(scope="module")
def saved(spec: TableSpec) -> tuple[list[int], dict[str, Any]]:
    return first(table(spec), 3)


def test_an_intact_state_carries_its_digest_and_resumes_exactly(
    spec: TableSpec, saved: tuple[list[int], dict[str, Any]]
) -> None:
    before, state = saved
    assert state["cursor"] == [0, 0, 150]
    assert state[DIGEST] == digest_of(state)
    resumed = table(spec)
    resumed.load_state_dict(state)
    assert before + ids(resumed) == list(range(ROWS))


def set_cursor(index: int, value: Callable[[int], int]) -> Callable[[dict[str, Any]], None]:
    def edit(state: dict[str, Any]) -> None:
        state["cursor"][index] = value(state["cursor"][index])

    return edit


def no_cursor(state: dict[str, Any]) -> None:
    state["cursor"] = None


#: The edits that gave wrong rows before states were checked: each is refused at load_state_dict.
EDITS = {
    "cursor row +1000": set_cursor(1, lambda row: row + 1000),
    "cursor item +1": set_cursor(0, lambda item: item + 1),
    "skip 10**9": set_cursor(2, lambda skip: 10**9),
    "skip 300": set_cursor(2, lambda skip: 300),
    "cursor None": no_cursor,
    # A state without a digest is read as one saved before states had digests, so the name counts too.
    "digest renamed": lambda state: state.__setitem__("digesd", state.pop(DIGEST)),
}
#: What names the field when the state has no digest to check: the ranges.
NAMED = {
    "cursor row +1000": r"cursor \(0, 1000, 150, 0, 0\) points outside this consumer's work",
    "skip 10**9": r"skips 1000000000 rows from stored row 0, but its work item .* has 300 left",
    "cursor None": "names work list .* but its cursor is None",
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_an_edited_state_is_refused_at_load_state_dict(
    spec: TableSpec, saved: tuple[list[int], dict[str, Any]], name: str
) -> None:
    state = copy.deepcopy(saved[1])
    EDITS[name](state)
    with pytest.raises(ValueError, match=NAMED.get(name, DAMAGED)) as refused:
        table(spec).load_state_dict(state)
    assert "edited or damaged" in str(refused.value)


@pytest.mark.parametrize("name", sorted(NAMED))
def test_ranges_refuse_an_edited_state_without_a_digest(
    spec: TableSpec, saved: tuple[list[int], dict[str, Any]], name: str
) -> None:
    # A state saved before states had digests is accepted without one, so its ranges are what refuse it.
    state = copy.deepcopy(saved[1])
    del state[DIGEST]
    EDITS[name](state)
    with pytest.raises(ValueError, match=NAMED[name]):
        table(spec).load_state_dict(state)


def test_a_state_without_a_digest_resumes_exactly(spec: TableSpec, saved: tuple[list[int], dict[str, Any]]) -> None:
    before, state = saved
    old = {key: value for key, value in state.items() if key != DIGEST}
    resumed = table(spec)
    resumed.load_state_dict(old)
    assert before + ids(resumed) == list(range(ROWS))


def paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The path of every field of a nested state, containers and leaves alike."""
    found = [path] if path else []
    if isinstance(value, dict):
        for key, inner in value.items():
            found += paths(inner, (*path, key))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            found += paths(inner, (*path, index))
    return found


def edited(state: dict[str, Any], path: tuple[Any, ...], change: Any) -> dict[str, Any]:
    """A copy of ``state`` with the field at ``path`` replaced by ``change`` (deleted when ``change``
    is ``DELETE``)."""
    copied = copy.deepcopy(state)
    parent = copied
    for key in path[:-1]:
        parent = parent[key]
    if change is DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = change
    return copied


DELETE = object()
changes = st.one_of(
    st.just(DELETE), st.none(), st.booleans(), st.integers(-3, 10**6), st.text(max_size=3), st.lists(st.integers(0, 9))
)


def refused_or_exact(load: Callable[[], list[int]], expected: list[int]) -> None:
    """``load()`` refuses with a ``ValueError``, or reads exactly ``expected``."""
    try:
        rows = load()
    except ValueError as error:
        assert "edited or damaged" in str(error), error
        return
    assert rows == expected


@EXAMPLES
@given(data=st.data())
def test_a_random_field_changed_is_refused_or_resumes_exactly(
    spec: TableSpec, saved: tuple[list[int], dict[str, Any]], data: st.DataObject
) -> None:
    before, state = saved
    path = data.draw(st.sampled_from(paths(state)))
    changed = edited(state, path, data.draw(changes))

    def load() -> list[int]:
        dataset = table(spec)
        dataset.load_state_dict(changed)
        return ids(dataset)

    refused_or_exact(load, list(range(ROWS))[len(before) :])


@EXAMPLES
@given(data=st.data())
def test_a_random_byte_flipped_in_a_saved_state_is_refused_or_resumes_exactly(
    spec: TableSpec, saved: tuple[list[int], dict[str, Any]], data: st.DataObject
) -> None:
    before, state = saved
    buffer = io.BytesIO()
    torch.save(state, buffer)
    content = bytearray(buffer.getvalue())
    content[data.draw(st.integers(0, len(content) - 1))] ^= data.draw(st.integers(1, 255))
    try:
        changed = torch.load(io.BytesIO(bytes(content)), weights_only=True)
    except Exception:
        return  # refused before it is a state at all
    if not isinstance(changed, dict):
        with pytest.raises(TypeError, match="a TableDataset state is a mapping"):
            table(spec).load_state_dict(changed)
        return

    def load() -> list[int]:
        dataset = table(spec)
        dataset.load_state_dict(changed)
        return ids(dataset)

    refused_or_exact(load, list(range(ROWS))[len(before) :])


def test_sealed_is_a_digest_of_every_other_field() -> None:
    state = sealed({"format": 1, "cursor": [0, 4, 2], "nested": {"b": 1.5, "a": None}})
    assert state[DIGEST] == digest_of({"nested": {"a": None, "b": 1.5}, "cursor": (0, 4, 2), "format": 1})
    assert digest_of({**state, "cursor": [0, 4, 3]}) != state[DIGEST]
    assert digest_of({**state, "format": True}) != digest_of({**state, "format": 1})


# The DataModule's checkpoint entry, read without a Trainer: a train loader, a few batches, its entry.


def datamodule(spec: TableSpec) -> SpiralDataModule:
    data = SpiralDataModule(spec, batch_size=50, stall_meter=False)
    data.setup("fit")
    return data


@pytest.fixture(scope="module")
def entry(spec: TableSpec) -> tuple[list[int], dict[str, Any]]:
    data = datamodule(spec)
    stream = iter(data.train_dataloader())
    before = ids(next(stream) for _ in range(3))
    return before, data.state_dict()


def rest_of(spec: TableSpec, state: dict[str, Any]) -> list[int]:
    data = datamodule(spec)
    data.load_state_dict(state)
    return ids(data.train_dataloader())


def test_the_datamodule_entry_is_sealed_and_resumes_exactly(
    spec: TableSpec, entry: tuple[list[int], dict[str, Any]]
) -> None:
    before, state = entry
    assert state[DIGEST] == digest_of(state)
    assert state["ranks"][0]["position"]["loader"]["dataset_state"][DIGEST]
    assert before + rest_of(spec, state) == list(range(ROWS))


def position(state: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = state["ranks"][0]["position"]
    return found


def no_dataset_state(state: dict[str, Any]) -> None:
    position(state)["loader"]["dataset_state"] = None


def more_batches(state: dict[str, Any]) -> None:
    position(state)["batches"] += 2


def far_cursor(state: dict[str, Any]) -> None:
    position(state)["loader"]["dataset_state"]["cursor"][1] += 1000


def string_epoch(state: dict[str, Any]) -> None:
    position(state)["epoch"] = "0"


@pytest.mark.parametrize(
    ("edit", "digest", "message"),
    [
        (no_dataset_state, True, "holds dataset_state None, not a dataset's state: it was edited or damaged"),
        (no_dataset_state, False, "holds dataset_state None, not a dataset's state: it was edited or damaged"),
        (more_batches, True, f"the SpiralDataModule state of the checkpoint entry {DAMAGED}"),
        (string_epoch, False, "position of rank 0 has epoch '0', not a non-negative int"),
        (far_cursor, True, r"cursor \(0, 1000, 150, 0, 0\) points outside this consumer's work"),
    ],
    ids=["dataset_state-None", "dataset_state-None-no-digest", "batches", "epoch-no-digest", "cursor"],
)
def test_an_edited_datamodule_entry_is_refused_before_any_row(
    spec: TableSpec,
    entry: tuple[list[int], dict[str, Any]],
    edit: Callable[[dict[str, Any]], None],
    digest: bool,
    message: str,
) -> None:
    state = copy.deepcopy(entry[1])
    edit(state)
    if not digest:
        del state[DIGEST]
    data = datamodule(spec)
    rows: list[int] = []
    # The entry's own fields are refused by load_state_dict; a dataset state by the dataset's
    # load_state_dict, when the train loader restores it, before its first row.
    with pytest.raises(ValueError, match=message):
        data.load_state_dict(state)
        rows += ids(data.train_dataloader())
    assert rows == []


def test_an_access_map_entry_is_sealed_resumes_exactly_and_is_refused_when_edited(spec: TableSpec) -> None:
    def mapped() -> SpiralDataModule:
        data = SpiralDataModule(spec, batch_size=50, access="map", stall_meter=False)
        data.setup("fit")
        return data

    whole = ids(mapped().train_dataloader())
    data = mapped()
    stream = iter(data.train_dataloader())
    before = ids(next(stream) for _ in range(3))
    state = data.state_dict()
    assert state[DIGEST] == digest_of(state)
    resumed = mapped()
    resumed.load_state_dict(state)
    assert before + ids(resumed.train_dataloader()) == whole
    # The sampler's position is torchdata's: its digest covers it.
    changed = copy.deepcopy(state)
    changed["ranks"][0]["position"]["loader"]["_sampler_iter_state"]["samples_yielded"] += 50
    with pytest.raises(ValueError, match=f"the SpiralDataModule state of the checkpoint entry {DAMAGED}"):
        mapped().load_state_dict(changed)


# Ray's loader state files.


def test_ray_loader_files_are_sealed_and_refused_when_edited(spec: TableSpec, tmp_path: Path) -> None:
    pytest.importorskip("ray")
    from ray_adapter.train import restore_loader_state, save_loader_state

    loader = table(spec).loader()
    stream = iter(loader)
    before = ids(next(stream) for _ in range(3))
    path = save_loader_state(loader, tmp_path)
    state = torch.load(path, weights_only=True)
    assert state[DIGEST] == digest_of(state)
    resumed = table(spec).loader()
    restore_loader_state(resumed, tmp_path)
    assert before + ids(resumed) == list(range(ROWS))

    for edit, message in [
        (lambda s: s["loader"].__setitem__("dataset_state", None), "holds dataset_state None"),
        (lambda s: s.__setitem__("epoch", s["epoch"] + 1), f"Ray loader state of rank 0 in .* {DAMAGED}"),
    ]:
        changed = copy.deepcopy(state)
        edit(changed)
        torch.save(changed, path)
        with pytest.raises(ValueError, match=message):
            restore_loader_state(table(spec).loader(), tmp_path)


# The other kinds: sealed, refused when edited, exact when not.


def kinds(spec: TableSpec, root: Path) -> dict[str, tuple[Callable[[], Any], str]]:
    other = replace(write_layout(root / "other", [120, 80], 1, "spiral"), columns=("id",))
    tokens, _ = corpus_tables(root / "corpus", documents=200, split_rows=50)
    return {
        "Mixture": (lambda: Mixture([(spec, 0.6), (other, 0.4)], batch_size=20), "id"),
        "WindowDataset": (lambda: WindowDataset(spec, windows=Windows(4, stride=3), batch_size=5), "id"),
        "PackedDataset": (lambda: PackedDataset(tokens, column="tokens", length=16, batch_size=4), "tokens"),
    }


def inner_cursor(state: dict[str, Any]) -> None:
    inner = state["tables"][0]["state"] if "tables" in state else state["table"]
    inner["cursor"][1] += 1000


def outer_field(state: dict[str, Any]) -> None:
    name = "tables" if "tables" in state else ("lead" if "lead" in state else "offset")
    if name == "tables":
        state["tables"][0]["rows"] += 1
    else:
        state[name] += 1


@pytest.mark.parametrize("kind", ["Mixture", "WindowDataset", "PackedDataset"])
def test_every_kind_seals_its_state_and_refuses_an_edited_one(spec: TableSpec, tmp_path: Path, kind: str) -> None:
    make, key = kinds(spec, tmp_path)[kind]
    whole = ids(make(), key)
    before, state = first(make(), 4, key)
    assert state[DIGEST] == digest_of(state)
    resumed = make()
    resumed.load_state_dict(state)
    assert before + ids(resumed, key) == whole
    for edit, message in [(inner_cursor, "points outside this consumer's work"), (outer_field, DAMAGED)]:
        changed = copy.deepcopy(state)
        edit(changed)
        with pytest.raises(ValueError, match=message):
            make().load_state_dict(changed)


def test_a_loader_state_whose_dataset_state_is_gone_is_refused_at_load(spec: TableSpec) -> None:
    loader = table(spec).loader()
    next(iter(loader))
    state = loader.state_dict()
    state["dataset_state"] = None
    with pytest.raises(ValueError, match="dataset_state None, not a dataset's state: it was edited or damaged"):
        table(spec).loader().load_state_dict(state)
