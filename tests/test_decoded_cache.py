"""The decoded cache: a pass read from its entries yields the rows, batches and states of a pass read
from the table, whatever stopped a pass before, and a folder shared by settings never mixes them."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from spiral_lightning import Image, PackedDataset, TableDataset, TableSpec, WindowDataset, Windows, write_table
from spiral_lightning.sources.cache import _PARTIAL, kept_entries
from tests.loaders import stopped_and_resumed
from tests.tables import KEEP_TEXT, kept_ids
from tests.test_media_pixels import ROWS as PICTURES
from tests.test_media_pixels import picture, pixel_table, with_media

SIZES = [700, 0, 1300, 500, 900]
ROWS = sum(SIZES)


def unfinished(folder: Path) -> list[Path]:
    """The entries a cache in ``folder`` is writing or left unfinished."""
    return sorted(folder.glob(f"*{_PARTIAL}"))


def cached(spec: TableSpec, folder: Path, budget: int = 1 << 30) -> TableSpec:
    return replace(spec, decoded_cache_dir=str(folder), decoded_cache_bytes=budget)


def batches_and_states(dataset: TableDataset) -> list[tuple[list[int], dict[str, Any]]]:
    """Each batch's ids with the dataset's state right after it, for one pass in process."""
    return [(batch["id"].tolist(), dataset.state_dict()) for batch in dataset]


@pytest.mark.parametrize("backend", ["spiral", "parquet"])
@pytest.mark.parametrize("where", [None, KEEP_TEXT])
def test_a_pass_from_the_cache_equals_a_pass_from_the_table(
    make_table: Callable[..., TableSpec], tmp_path: Path, backend: str, where: str | None
) -> None:
    spec = make_table(SIZES, backend=backend, filter=where)
    expected = batches_and_states(TableDataset(spec, batch_size=256, shuffle=True, seed=3))
    folder = tmp_path / "decoded"
    dataset = TableDataset(cached(spec, folder), batch_size=256, shuffle=True, seed=3)
    filling = batches_and_states(dataset)
    kept = kept_entries(folder)
    # Every work item read whole was kept: the shuffle's blocks of the non-empty splits.
    assert kept and len(kept) == len(dataset.work())
    assert filling == expected == batches_and_states(dataset)
    assert sorted(id for ids, _ in expected for id in ids) == (kept_ids(SIZES) if where else list(range(ROWS)))


def test_every_kind_reads_the_cache_alike(make_table: Callable[..., TableSpec], tmp_path: Path) -> None:
    # Every dataset kind reads through the same opened source: packed token blocks and windows too.
    documents = [list(range(start, start + start % 37)) for start in range(0, 3_000, 7)]
    corpus = write_table(f"spiral:{tmp_path / 'corpus'}", pa.table({"tokens": documents}), split_rows=100)
    folder = tmp_path / "decoded"

    def packed(table: TableSpec) -> list[list[int]]:
        dataset = PackedDataset(table, column="tokens", length=64, batch_size=4)
        return [batch["tokens"].flatten().tolist() for batch in dataset]

    def windows(table: TableSpec) -> list[list[int]]:
        dataset = WindowDataset(table, windows=Windows(16, stride=8), batch_size=4)
        return [batch["id"].flatten().tolist() for batch in dataset]

    for read, spec in ((packed, corpus), (windows, make_table(SIZES))):
        expected = read(spec)
        assert expected and read(cached(spec, folder)) == expected == read(cached(spec, folder))
    assert kept_entries(folder)


@pytest.mark.parametrize(
    "image", [Image("img", size=(8, 6)), Image("img", layout="HWC", dtype="uint8", normalize=None)]
)
def test_pixels_the_scan_decodes_come_back_from_the_cache_alike(tmp_path: Path, image: Image) -> None:
    # Spiral's decoded pixels are an extension type the scan turns into tensors: the cache keeps
    # the scan's batches, resized and ragged alike.
    spec = with_media(pixel_table(tmp_path / "pixels", [picture(row) for row in range(PICTURES)]), image)

    def pixels(table: TableSpec) -> list[list[Any]]:
        images = [batch["img"] for batch in TableDataset(table, batch_size=5)]
        return [[(part.dtype, part.tolist()) for part in batch] for batch in images]

    expected = pixels(spec)
    assert pixels(cached(spec, tmp_path / "decoded")) == expected == pixels(cached(spec, tmp_path / "decoded"))


def test_a_pass_from_the_cache_reads_nothing_of_the_table(make_table: Callable[..., TableSpec], tmp_path: Path) -> None:
    spec = make_table(SIZES, backend="parquet")
    dataset = TableDataset(cached(spec, tmp_path / "decoded"), batch_size=100)
    ids = [id for batch in dataset for id in batch["id"].tolist()]
    assert ids == list(range(ROWS))
    # Without its files the table cannot be read; the kept items still can.
    table = Path(spec.uri.removeprefix("parquet:"))
    shutil.move(table, tmp_path / "moved")
    assert [id for batch in dataset for id in batch["id"].tolist()] == ids
    uncached = TableDataset(spec, batch_size=100)
    with pytest.raises(ValueError, match=r"changed '.*part-0\.parquet' while it was read"):
        list(uncached)


def test_a_pass_stopped_early_keeps_only_the_items_it_read_whole(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    folder = tmp_path / "decoded"
    dataset = TableDataset(cached(make_table(SIZES), folder), batch_size=100, read_ahead=0)
    # Items in stored order: 700 rows, then 1300; 9 batches end inside the second item.
    for number, _ in enumerate(dataset, start=1):
        if number == 9:
            break
    # The item being written when the pass stopped left no file behind.
    assert len(kept_entries(folder)) == 1 and not unfinished(folder)
    # A file a killed process left while writing is removed an hour after its last write, when
    # another process (here, another dataset's source) first keeps an entry.
    left = folder / "killed.partial"
    left.write_bytes(b"half an entry")
    os.utime(left, (time.time() - 3700, time.time() - 3700))
    dataset = TableDataset(dataset.spec, batch_size=100, read_ahead=0)
    assert [id for batch in dataset for id in batch["id"].tolist()] == list(range(ROWS))
    assert len(kept_entries(folder)) == len(dataset.work())
    assert not unfinished(folder)


def test_a_resume_inside_a_pass_read_from_the_cache_through_workers(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    spec = cached(make_table(SIZES, backend="parquet"), tmp_path / "decoded")
    list(TableDataset(spec, batch_size=100))
    before, after = stopped_and_resumed(lambda: TableDataset(spec, batch_size=100).loader(num_workers=2), stop=7)
    ids = [id for batch in before + after for id in batch["id"].tolist()]
    assert sorted(ids) == list(range(ROWS))


def test_an_entry_cut_short_on_its_disk_is_read_again_from_the_table(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    folder = tmp_path / "decoded"
    dataset = TableDataset(cached(make_table(SIZES), folder), batch_size=100)
    list(dataset)
    damaged = kept_entries(folder)[0]
    damaged.write_bytes(damaged.read_bytes()[:-100])
    assert [id for batch in dataset for id in batch["id"].tolist()] == list(range(ROWS))
    # Read again whole, the item was kept again.
    assert len(kept_entries(folder)) == len(dataset.work())


def test_settings_that_read_other_rows_share_a_folder_without_mixing(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    folder = tmp_path / "decoded"
    spec = cached(make_table(SIZES), folder)
    assert [id for batch in TableDataset(spec, batch_size=100) for id in batch["id"].tolist()] == list(range(ROWS))
    narrow = replace(spec, filter=KEEP_TEXT, columns=("id",))
    batches = list(TableDataset(narrow, batch_size=100))
    assert [id for batch in batches for id in batch["id"].tolist()] == kept_ids(SIZES)
    assert all(set(batch) == {"id"} for batch in batches)


def test_an_item_over_the_budget_is_read_from_the_table_every_pass(
    make_table: Callable[..., TableSpec], tmp_path: Path
) -> None:
    folder = tmp_path / "decoded"
    # Room for the 500- and 700-row splits (about 24 bytes a row), not the others.
    dataset = TableDataset(cached(make_table(SIZES), folder, budget=20_000), batch_size=100)
    for _ in range(2):
        assert [id for batch in dataset for id in batch["id"].tolist()] == list(range(ROWS))
        assert 0 < sum(path.stat().st_size for path in kept_entries(folder)) <= 20_000
        assert not unfinished(folder)


def test_the_settings_are_checked_when_the_spec_is_made(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="decoded_cache_dir and decoded_cache_bytes go together"):
        TableSpec("parquet:/data", decoded_cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="decoded_cache_bytes must be a positive int, not 0"):
        TableSpec("parquet:/data", decoded_cache_dir=str(tmp_path), decoded_cache_bytes=0)
    with pytest.raises(ValueError, match="needs the filter as text"):
        TableSpec("parquet:/data", filter=pc.field("x") > 0, decoded_cache_dir=str(tmp_path), decoded_cache_bytes=1)
