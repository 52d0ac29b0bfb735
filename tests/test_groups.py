"""Workers send small batches in groups; a state saved between two batches of a group resumes
exactly where it was, in the same order as a run that never stopped."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from spiral_lightning import PackedDataset, TableDataset, TableSpec, TokenBatchDataset, TokenBudget, write_table
from spiral_lightning.datasets.groups import (
    GROUP_BYTES,
    GROUP_HANDED,
    GROUP_LEFT,
    GROUP_ROWS,
    MOST_GROUPED,
    Grouped,
    Marks,
    group_size,
)
from spiral_lightning.reading import blocks
from spiral_lightning.reading.convert import group_pieces
from spiral_lightning.reading.frames import Frame, Part
from spiral_lightning.reading.tensors import NullError, Nulls, to_torch
from spiral_lightning.reading.transfer import handed_on_pieces


def test_batches_are_grouped_by_rows_and_plain_ones_are_converted_at_once(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    spec = make_table([100])
    assert group_size(TableDataset(spec, batch_size=10)) == MOST_GROUPED
    assert group_size(TableDataset(spec, batch_size=1024)) == GROUP_ROWS // 1024 == 64
    assert group_size(TableDataset(spec, batch_size=GROUP_ROWS)) == 1
    assert group_size(TableDataset(spec)) == 1  # each read batch is a batch: no size to group by
    # Packed blocks travel in groups too, batch by batch: each batch is blocks, not one frame's rows.
    tokens = write_table(f"parquet:{tmp_path / 'tokens'}", pa.table({"tokens": [[1, 2, 3]] * 10}), split_rows=5)
    packed = PackedDataset(tokens, column="tokens", length=4, batch_size=2)
    assert group_size(packed) == MOST_GROUPED and not packed.sliced()
    # Token-budget batches too, a group of them by count (no rows to size one by).
    budgeted = TokenBatchDataset(tokens, budget=TokenBudget("tokens", max_tokens=8))
    assert group_size(budgeted) == MOST_GROUPED and not budgeted.sliced()
    assert isinstance(budgeted.loader(num_workers=1).dataset, Grouped)
    assert TableDataset(spec, batch_size=10).sliced() and not TableDataset(spec, batch_size=10, transform=abs).sliced()
    assert isinstance(TableDataset(spec, batch_size=10).loader(num_workers=1).dataset, Grouped)
    assert isinstance(TableDataset(spec, batch_size=10).loader(num_workers=0).dataset, TableDataset)


def ends_of_groups(sizes: list[int], workers: int) -> set[int]:
    """The batch counts at which a loader has handed on whole groups only, when each of its
    ``workers`` sends groups of ``sizes`` batches and the loader takes them in turn."""
    ends, handed = set(), 0
    for size in sizes:
        for _ in range(workers):
            handed += size
            ends.add(handed)
    return ends


def test_a_workers_groups_grow_from_one_batch(make_table: Callable[..., TableSpec]) -> None:
    # Its first batch waits for one batch, not a whole group; then each group holds three times
    # as many batches as it sent before, up to group_size.
    spec = make_table([3 * MOST_GROUPED * 10])
    loader = TableDataset(spec, batch_size=10).loader(num_workers=1)
    lefts = []
    for _ in loader:
        state = loader.state_dict()
        lefts.append(state.get(GROUP_LEFT, {}).get("left", 0))
    ends = [count for count, left in enumerate(lefts, 1) if left == 0]
    sizes = [1, 3, 12, 48, 192, MOST_GROUPED, MOST_GROUPED]
    assert ends == list(itertools.accumulate(sizes)) and sum(sizes) == 3 * MOST_GROUPED
    # The loader's state counts the worker's batches within the epoch, and none after it.
    assert state[GROUP_HANDED] == [3 * MOST_GROUPED] and GROUP_HANDED not in loader.state_dict()
    batches = iter(loader)
    next(batches)
    assert loader.state_dict()[GROUP_HANDED] == [1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "stop", [5, 6, MOST_GROUPED + 23, 2 * MOST_GROUPED, 3 * MOST_GROUPED + 5, 4 * MOST_GROUPED + 7]
)
def test_a_state_saved_inside_a_group_resumes_in_the_uninterrupted_order(
    make_table: Callable[..., TableSpec], stop: int
) -> None:
    # Each of the 2 workers reads two splits of batches of 10 rows: growing groups up to a full
    # one, a full one, then one of 5.
    split = (2 * MOST_GROUPED + 5) * 10 // 2
    spec = make_table([split] * 4)
    assert group_size(TableDataset(spec, batch_size=10)) == MOST_GROUPED
    whole = [batch["id"].tolist() for batch in TableDataset(spec, batch_size=10).loader(num_workers=2)]
    assert sorted(row for batch in whole for row in batch) == list(range(4 * split))
    loader = TableDataset(spec, batch_size=10).loader(num_workers=2)
    batches = iter(loader)
    before = [next(batches)["id"].tolist() for _ in range(stop)]
    state = loader.state_dict()
    # Inside a group the state says which worker was sending it and what it had left.
    sizes = [1, 3, 12, 48, 192, MOST_GROUPED, 5]
    assert (GROUP_LEFT in state) == (stop not in ends_of_groups(sizes, 2))
    assert sum(state[GROUP_HANDED]) == stop
    del batches, loader
    resumed = TableDataset(spec, batch_size=10).loader(num_workers=2)
    resumed.load_state_dict(state)
    after = [batch["id"].tolist() for batch in resumed]
    assert before + after == whole
    # The next epoch of the resumed loader groups from the start again.
    assert [batch["id"].tolist() for batch in resumed] == whole


def test_a_group_of_wide_batches_ends_at_its_bytes(make_table: Callable[..., TableSpec], tmp_path: Path) -> None:
    # 100-row batches of 40 KB rows: 4 MB each, so a group ends after 4 of them, not GROUP_ROWS // 100.
    width, rows = 10_000, 2_000
    data = pa.table(
        {
            "id": np.arange(rows, dtype=np.int64),
            "v": pa.FixedSizeListArray.from_arrays(pa.array(np.ones(rows * width, dtype=np.float32)), width),
        }
    )
    spec = write_table(f"parquet:{tmp_path / 'wide'}", data, split_rows=500)
    batch_bytes = 100 * (8 + 4 * width)
    in_group = -(-GROUP_BYTES // batch_bytes)
    assert in_group < 12 < group_size(TableDataset(spec, batch_size=100))
    loader = TableDataset(spec, batch_size=100).loader(num_workers=1)
    batches = iter(loader)
    # After groups of 1 and 3 batches the next would hold 12: its bytes end it sooner.
    seen = [next(batches) for _ in range(5)]
    assert loader.state_dict()[GROUP_LEFT] == {"worker": 0, "left": in_group - 1}
    seen += list(batches)
    assert torch.cat([batch["id"] for batch in seen]).tolist() == list(range(rows))
    assert all(torch.equal(batch["v"], torch.ones(100, width)) for batch in seen)


def same(left: Any, right: Any) -> bool:
    """Whether two batch values are the same: tensors in dtype, shape and values, lists item by
    item, anything else by ``==``."""
    if isinstance(left, torch.Tensor):
        return isinstance(right, torch.Tensor) and left.dtype == right.dtype and torch.equal(left, right)
    if isinstance(left, list | dict):
        items = left.items() if isinstance(left, dict) else enumerate(left)
        return type(left) is type(right) and len(left) == len(right) and all(same(v, right[k]) for k, v in items)
    return bool(left == right)


def test_a_group_is_converted_at_once_and_its_batches_equal_those_read_in_process(tmp_path: Path) -> None:
    rows = 3_000
    generator = np.random.default_rng(1)
    offsets = np.concatenate(([0], np.cumsum(generator.integers(0, 6, rows)))).astype(np.int32)
    data = pa.table(
        {
            "id": np.arange(rows, dtype=np.int64),
            "x": pa.array(np.arange(rows, dtype=np.float32), mask=np.arange(rows) % 97 == 5),
            "emb": pa.FixedSizeListArray.from_arrays(pa.array(generator.standard_normal(rows * 3, np.float32)), 3),
            "tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.arange(offsets[-1], dtype=np.int32))),
        }
    )
    written = write_table(f"parquet:{tmp_path / 't'}", data, split_rows=700)
    spec = replace(written, null_fill={"x": -1.0}, null_mask=("x",))
    expected = list(TableDataset(spec, batch_size=64))
    got = list(TableDataset(spec, batch_size=64).loader(num_workers=1))
    # The batches of a group are slices of one conversion, in one storage: the second group holds three.
    assert got[1]["id"].untyped_storage().data_ptr() == got[3]["id"].untyped_storage().data_ptr()
    assert isinstance(got[0]["tokens"], list) and got[0]["x_valid"].dtype == torch.bool
    assert len(got) == len(expected) and all(map(same, expected, got))
    # A null that no fill covers fails the group's conversion; its frames are converted one by one,
    # and the error names the row.
    with pytest.raises(NullError, match=r"column 'x' is null at parquet:.*row 5 \(position 5 of its batch\)"):
        list(TableDataset(written, batch_size=64).loader(num_workers=1))


def shaped(shapes: list[tuple[int, int]]) -> pa.StructArray:
    """A shaped tensor column (``data`` in C order, ``shape``) of float32 arrays of ``shapes``."""
    offsets = np.concatenate([[0], np.cumsum([a * b for a, b in shapes])]).astype(np.int64)
    data = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.arange(offsets[-1], dtype=np.float32)))
    return pa.StructArray.from_arrays(
        [data, pa.array([list(s) for s in shapes], pa.list_(pa.int32(), 2))], ["data", "shape"]
    )


def read_batch(first: int, rows: int, shape: tuple[int, int] = (1, 3)) -> pa.RecordBatch:
    """Rows ``first`` on of a read batch of the column kinds a group may hold: numbers, a null
    filled and masked, booleans, fixed-size lists of float16, a permuted fixed-shape tensor (a
    strided view), strings and a shaped tensor column of one ``shape``."""
    ids = np.arange(first, first + rows, dtype=np.int64)
    permuted = pa.fixed_shape_tensor(pa.int32(), [2, 3], permutation=[1, 0])
    tensor = pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 6).astype(np.int32) * 10), 6)
    columns = {
        "id": pa.array(ids),
        "x": pa.array(ids.astype(np.float32), mask=ids % 7 == 3),
        "flag": pa.array(ids % 3 == 0),
        "v": pa.FixedSizeListArray.from_arrays(pa.array(np.repeat(ids, 4).astype(np.float16)), 4),
        "t": pa.ExtensionArray.from_storage(permuted, tensor),
        "name": pa.array([f"r{i}" for i in ids]),
        "same": shaped([shape] * rows),
    }
    fields = [pa.field(name, array.type) for name, array in columns.items()]
    fields[-1] = fields[-1].with_metadata({b"spiral_lightning.tensor": b"{}"})
    return pa.RecordBatch.from_arrays(list(columns.values()), schema=pa.schema(fields))


def test_a_groups_pieces_are_copied_into_one_block_as_its_rows_converted_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(blocks, "_pool", None)
    monkeypatch.setattr(blocks, "_mapped", {})
    chunks = [read_batch(0, 50), read_batch(50, 30), read_batch(80, 40)]
    # Frames of 32 rows cut across the read batches (rows 10 to 106), as a consumer cuts them.
    frames = [
        Frame((Part(chunks[0], 10, 32),), 32),
        Frame((Part(chunks[0], 42, 8), Part(chunks[1], 0, 24)), 32),
        Frame((Part(chunks[1], 24, 6), Part(chunks[2], 0, 26)), 32),
    ]
    nulls = Nulls({"x": -1.0}, ("x",))
    pieces = group_pieces(frames, nulls, ())
    assert pieces is not None and [len(piece["id"]) for piece in pieces] == [40, 30, 26]
    expected = to_torch(pa.concat_batches(chunks).slice(10, 96), nulls)
    from_pool = blocks.pooled_joined(pieces)
    assert from_pool is not None
    for got in (handed_on_pieces(pieces), from_pool, ForkingPickler.loads(ForkingPickler.dumps(from_pool))):
        assert list(got) == list(expected) and all(same(value, got[name]) for name, value in expected.items())
    # A shaped column whose row shape changes from one read batch to the next is a list in the
    # frame that holds both; the group is then converted frame by frame.
    other = read_batch(50, 30, shape=(3, 1))
    assert group_pieces([Frame((Part(chunks[0], 40, 10), Part(other, 0, 10)), 20)], nulls, ()) is None
    assert group_pieces([Frame((Part(chunks[0], 40, 10),), 10), Frame((Part(other, 0, 10),), 10)], nulls, ()) is None


def test_a_resumed_loader_without_persistent_workers_groups_its_next_epoch_from_the_start(
    make_table: Callable[..., TableSpec],
) -> None:
    spec = make_table([500] * 4)

    def loader() -> Any:
        return TableDataset(spec, batch_size=10).loader(num_workers=2, persistent_workers=False)

    whole = [batch["id"].tolist() for batch in loader()]
    first = loader()
    batches = iter(first)
    before = [next(batches)["id"].tolist() for _ in range(6)]
    state = first.state_dict()
    assert state[GROUP_LEFT] == {"worker": 1, "left": 2} and state[GROUP_HANDED] == [4, 2]
    del batches, first
    # A state saved again before the resumed loader's first batch still says what the group had left.
    reloaded = loader()
    reloaded.load_state_dict(state)
    assert reloaded.state_dict()[GROUP_LEFT] == state[GROUP_LEFT]
    state = reloaded.state_dict()
    del reloaded
    resumed = loader()
    resumed.load_state_dict(state)
    assert before + [batch["id"].tolist() for batch in resumed] == whole
    # Its next epoch's new workers start from the beginning, not from the loaded state.
    assert [batch["id"].tolist() for batch in resumed] == whole


def test_marks_give_the_state_after_each_batch_of_a_group(make_table: Callable[..., TableSpec]) -> None:
    # A group of plain batches carries one State and, batch by batch, the cursor and rows delivered.
    spec = make_table([250, 130])
    dataset = TableDataset(spec, batch_size=64)
    states, marks = [], []
    for _ in dataset.frames():
        states.append(dataset.state())
        marks.append(dataset.mark())
    group = Marks(states[-1], marks)
    assert len(group) == len(states) == 6
    assert [group[at] for at in range(len(group))] == states
    assert [group[at].to_dict() for at in range(len(group))] == [state.to_dict() for state in states]
    assert len({state.cursor for state in states}) == 6 and states[2].delivered == 3 * 64
