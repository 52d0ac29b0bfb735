"""``shuffle=True`` and the one default policy: a switch that mixes a table of any size, sized
from the table alone, every row once and resumable; ``balanced`` wherever no policy is given;
and a warning, before any worker starts, when a policy leaves a consumer without its share."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from spiral_lightning import Mixture, PackedDataset, Shuffled, SpiralDataModule, TableDataset, TableSpec, balanced
from spiral_lightning.demos.data import demo_image_folder
from spiral_lightning.media.ingest import ingest_images
from spiral_lightning.planning.policies import shuffle_for
from spiral_lightning.sources.write import write_table
from tests.examples import examples


def ids(batches: Any, column: str = "id") -> list[int]:
    return [value for batch in batches for value in batch[column].tolist()]


def classes_table(root: Path, rows: int = 2_000, classes: int = 4) -> str:
    """A table of ``rows`` rows in ``classes`` runs of one label each, in one split, as an
    ingested folder of class subfolders is."""
    uri = f"parquet:{root / 'classes'}"
    labels = np.repeat(np.arange(classes), rows // classes)
    write_table(uri, pa.table({"id": np.arange(rows), "label": labels}), split_rows=10_000)
    return uri


def test_a_new_users_images_mix_their_classes_with_shuffle_and_no_other_setting(tmp_path: Path) -> None:
    folder = demo_image_folder(tmp_path / "photos", per_class=500)
    ingest_images(folder, f"spiral:{tmp_path / 'photos-table'}", progress=False)
    dataset = TableDataset(f"spiral:{tmp_path / 'photos-table'}", batch_size=64, shuffle=True)
    mixed = [len(set(batch["label"].tolist())) for batch in dataset]
    assert len(mixed) == 32
    assert sum(count == 4 for count in mixed) >= 0.9 * len(mixed)
    # In stored order every batch but those at a class's edge holds one class.
    stored = [len(set(batch["label"].tolist())) for batch in TableDataset(dataset.spec, batch_size=64)]
    assert sum(count == 1 for count in stored) >= 28


def test_shuffle_delivers_every_row_once_in_a_new_order_every_epoch_and_the_same_for_a_seed(tmp_path: Path) -> None:
    uri = classes_table(tmp_path)
    dataset = TableDataset(uri, batch_size=64, shuffle=True, seed=5)
    first = ids(dataset)
    dataset.set_epoch(1)
    second = ids(dataset)
    assert sorted(first) == sorted(second) == list(range(2_000))
    assert first != second
    assert ids(TableDataset(uri, batch_size=64, shuffle=True, seed=5)) == first
    assert ids(TableDataset(uri, batch_size=64, shuffle=True, seed=6)) != first


def test_shuffle_through_two_workers_reads_every_row_once_and_mixes_each_workers_batches(tmp_path: Path) -> None:
    uri = classes_table(tmp_path)
    loader = TableDataset(uri, batch_size=64, shuffle=True).loader(num_workers=2)
    batches = list(loader)
    assert sorted(ids(batches)) == list(range(2_000))
    assert sum(len(set(batch["label"].tolist())) == 4 for batch in batches) >= 0.8 * len(batches)


def test_a_shuffled_state_resumes_exactly_under_the_same_and_another_rank_count(tmp_path: Path) -> None:
    uri = classes_table(tmp_path, rows=4_000)
    whole = ids(TableDataset(uri, batch_size=50, shuffle=True, seed=1))
    saving = TableDataset(uri, batch_size=50, shuffle=True, seed=1)
    reading = iter(saving)
    head = ids(next(reading) for _ in range(7))
    state = saving.state_dict()
    resumed = TableDataset(uri, batch_size=50, shuffle=True, seed=1)
    resumed.load_state_dict(state)
    assert head + ids(resumed) == whole
    # The policy depends on the table alone, so two ranks continue the one consumer's epoch.
    rest = []
    for rank in range(2):
        part = TableDataset(uri, batch_size=50, shuffle=True, seed=1, rank=rank, world_size=2)
        part.load_elastic([state])
        rest += ids(part)
    assert sorted(head + rest) == list(range(4_000))


def test_shuffle_sizes_blocks_and_windows_from_the_table() -> None:
    assert shuffle_for(2_000) == Shuffled(0, block_rows=31, buffer_rows=2_000)
    assert shuffle_for(10_000_000, 3) == Shuffled(3, block_rows=8_192, buffer_rows=65_536)
    assert shuffle_for(10_000_000, media=True) == Shuffled(0, block_rows=512, buffer_rows=4_096)
    assert shuffle_for(5_000, windows=False) == Shuffled(0, block_rows=78, buffer_rows=0)
    assert shuffle_for(0) == Shuffled(0, block_rows=1, buffer_rows=0)


@examples(50, deadline=None)
@given(rows=st.integers(0, 10**9), media=st.booleans())
def test_a_shuffle_window_holds_at_least_eight_blocks_of_at_most_8192_rows(rows: int, media: bool) -> None:
    policy = shuffle_for(rows, media=media)
    assert 1 <= policy.block_rows <= 8_192
    assert policy.buffer_rows <= (4_096 if media else 65_536)
    if rows >= 512:
        assert policy.buffer_rows >= 8 * policy.block_rows


def test_shuffle_and_a_policy_together_are_refused(tmp_path: Path) -> None:
    uri = classes_table(tmp_path)
    with pytest.raises(ValueError, match=r"shuffle=True chooses the policy .* policy='stripe'; pass one of them"):
        TableDataset(uri, batch_size=8, shuffle=True, policy="stripe")
    with pytest.raises(ValueError, match=r"shuffle=True chooses the train table's policy"):
        SpiralDataModule(train=uri, shuffle=True, policy="shuffled")
    with pytest.raises(ValueError, match="seed"):
        TableDataset(uri, batch_size=8, shuffle=True, seed=-1)


def documents(root: Path) -> str:
    """A table of 400 documents of 1 to 5 tokens each, with their ids."""
    uri = f"parquet:{root / 'documents'}"
    tokens = [list(range(1, 2 + row % 5)) for row in range(400)]
    write_table(uri, pa.table({"id": np.arange(400), "tokens": tokens}), split_rows=200)
    return uri


def test_every_entry_point_defaults_to_balanced(tmp_path: Path) -> None:
    spec = documents(tmp_path)
    assert TableDataset(spec).policy is balanced
    assert PackedDataset(spec, column="tokens", length=8, batch_size=2).policy is balanced
    assert all(table.policy is balanced for table in Mixture([(spec, 1.0)], batch_size=4).tables)
    assert SpiralDataModule(train=spec).policy is balanced


def test_kinds_and_the_datamodule_pass_shuffle_on(tmp_path: Path) -> None:
    spec = documents(tmp_path)
    packed = PackedDataset(spec, column="tokens", length=8, batch_size=2, shuffle=True, seed=2)
    # A packed stream keeps each block's documents in stored order: blocks only.
    assert packed.policy == Shuffled(2, block_rows=6, buffer_rows=0)
    mixture = Mixture([(spec, 1.0), (spec, 1.0)], batch_size=4, shuffle=True, seed=3)
    assert [table.policy for table in mixture.tables] == [shuffle_for(400, 3)] * 2
    module = SpiralDataModule(train=spec, val=spec, shuffle=True, seed=4, columns=["id"])
    module.setup("fit")
    assert module.datasets["train"].policy == shuffle_for(400, 4)
    assert module.datasets["val"].policy is balanced


def test_a_consumer_without_its_share_is_warned_of_when_the_loader_is_made(tmp_path: Path) -> None:
    uri = classes_table(tmp_path)  # one split: stripe gives it to one worker whole
    with pytest.warns(UserWarning, match=r"stripe deals consumer \(rank 0, worker 1\) 0 of the 2000 stored rows"):
        TableDataset(uri, batch_size=64, policy="stripe").loader(num_workers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TableDataset(uri, batch_size=64).loader(num_workers=2)
        TableDataset(uri, batch_size=64, shuffle=True).loader(num_workers=2)


def test_a_rank_under_half_the_mean_is_warned_of_when_it_reads_in_process(make_table: Callable[..., TableSpec]) -> None:
    spec = make_table([900, 100])
    with pytest.warns(UserWarning, match=r"\(rank 1, worker 0\) 100 of the 1000 stored rows .* mean of 2 consumers"):
        next(iter(TableDataset(spec, batch_size=10, policy="stripe", rank=1, world_size=2)))
    counts = Counter(ids(TableDataset(spec, batch_size=100, rank=1, world_size=2)))
    assert len(counts) == 500


def test_ray_data_reads_shuffled_blocks_of_the_whole_table(tmp_path: Path) -> None:
    from ray_adapter.datasource import TableDatasource

    uri = classes_table(tmp_path)
    stored = TableDatasource(TableSpec(uri)).items
    shuffled = TableDatasource(TableSpec(uri), shuffle=True, seed=1).items
    assert [(item.start, item.end) for item in stored] == [(0, 2_000)]
    assert sorted(row for item in shuffled for row in range(item.start, item.end)) == list(range(2_000))
    assert [item.end - item.start for item in shuffled].count(31) == 64
    assert shuffled != sorted(shuffled, key=lambda item: item.start)
