"""The sds: backend on real SDS datasets published in the test with ``sds.write_shard`` and
``sds.publish``: every record once over ranks and workers, resume equal to an uninterrupted run,
SDS's own order and values (complex included), the map-style dataset against ``sds.open``,
metadata filters that read only metadata, a republished root refused in a spawned worker,
``write_table`` round trips, and a Lightning Trainer fitting on an ``sds:`` table."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import signal_dataset as sds
import torch
from torch.utils.data import DataLoader, DistributedSampler

from spiral_lightning import (
    Shard,
    SpiralDataModule,
    TableDataset,
    TableMapDataset,
    TableSpec,
    WorkItem,
    stripe,
    to_torch,
    write_table,
)
from spiral_lightning.reading.frames import read_frames, start_of
from spiral_lightning.sources import Take, open_source
from spiral_lightning.sources.sds import publish_table
from tests.tables import layout_table

#: Records per shard: uneven, so stripes of shards give consumers unequal shares.
SHARDS = [40, 25, 35, 10]
RECORDS = sum(SHARDS)
#: Records whose ``label`` is below 2 pass this filter.
KEEP_LABELS = "label < 2"


def record(number: int) -> sds.Record:
    """Record ``number``: complex64 ``iq`` [2, 8], float32 ``psd`` [16] and ``cube`` [2, 2, 3],
    ragged float32 ``burst`` [1..3], and metadata ``label``, ``snr``, ``site`` and ``tags``."""
    generator = np.random.default_rng(number)
    iq = (generator.normal(size=(2, 8)) + 1j * generator.normal(size=(2, 8))).astype(np.complex64)
    arrays = {
        "iq": (iq, ("channel", "time")),
        "psd": (generator.normal(size=16).astype(np.float32), ("bin",)),
        "cube": (generator.normal(size=(2, 2, 3)).astype(np.float32), ("rx", "tx", "tap")),
        "burst": (np.arange(number % 3 + 1, dtype=np.float32) + number, ("sample",)),
    }
    fields = {
        name: sds.Field(data, axes=tuple(sds.Axis(axis, size) for axis, size in zip(axes, data.shape, strict=True)))
        for name, (data, axes) in arrays.items()
    }
    metadata = {"label": number % 4, "snr": number / 4, "site": f"site-{number % 3}", "tags": [number, "x"]}
    return sds.Record(f"r{number:04d}", fields, metadata=metadata)


def publish(root: Path, snapshot: str = "s1") -> TableSpec:
    """The records of ``SHARDS`` published at ``root`` as snapshot ``snapshot``; its spec."""
    shards, first = [], 0
    for number, size in enumerate(SHARDS):
        records = [record(index) for index in range(first, first + size)]
        shards.append(sds.write_shard(records, str(root), work_id=f"{number:04d}", attempt=int(snapshot[1:])))
        first += size
    sds.publish(str(root), shards, dataset_id="captures", snapshot_id=snapshot)
    return TableSpec(f"sds:{root}").resolve()


def republish(root: Path) -> None:
    """Publish snapshot ``s2`` at ``root`` in place of ``s1``: root documents are create-only, so
    an operator removes the old one first."""
    (root / "root.json").unlink()
    publish(root, "s2")


@pytest.fixture
def spec(tmp_path: Path) -> TableSpec:
    return publish(tmp_path / "captures")


def kept() -> list[str]:
    return [f"r{number:04d}" for number in range(RECORDS) if number % 4 < 2]


def consumer_ids(spec: TableSpec, shard: Shard, batch_size: int) -> list[str]:
    source = open_source(spec)
    items = stripe(source.splits, shard)
    return [
        i
        for frame, _ in read_frames(source, items, start_of(items), batch_size, "keep_partial")
        for i in frame.rows()["id"].to_pylist()
    ]


def test_uri_pins_dataset_snapshot_and_root_digest(spec: TableSpec) -> None:
    assert "?dataset=captures&snapshot=s1&digest=" in spec.uri
    assert spec.version.startswith("sds-captures@s1-")
    assert spec.resolve() == spec
    assert open_source(spec).splits == [(index, 0, size, size) for index, size in enumerate(SHARDS)]


@pytest.mark.parametrize("condition", [None, KEEP_LABELS])
def test_every_record_arrives_once_over_ranks_and_workers(spec: TableSpec, condition: str | None) -> None:
    filtered = TableSpec(spec.uri, columns=("id",), filter=condition)
    expected = kept() if condition else [f"r{number:04d}" for number in range(RECORDS)]
    for world_size in (1, 2, 3):
        for workers in (1, 2):
            seen = [
                row
                for rank in range(world_size)
                for worker in range(workers)
                for row in consumer_ids(filtered, Shard(rank, world_size, worker, workers), batch_size=7)
            ]
            assert sorted(seen) == expected, (world_size, workers)


def test_single_consumer_follows_sds_order_and_values(spec: TableSpec) -> None:
    dataset = sds.open(str(spec.uri[4:].partition("?")[0]))
    reference = list(dataset)
    rows: list[dict[str, Any]] = []
    for batch in TableDataset(spec, batch_size=16):
        assert batch["iq"].dtype == torch.complex64 and batch["iq"].shape[1:] == (2, 8)
        assert batch["cube"].shape[1:] == (2, 2, 3) and batch["label"].dtype == torch.int64
        # Ragged arrays cannot stack: one tensor per record.
        assert isinstance(batch["burst"], list)
        rows += [{name: batch[name][k] for name in batch} for k in range(len(batch["id"]))]
    assert [row["id"] for row in rows] == [each.id for each in reference]
    for row, each in zip(rows, reference, strict=True):
        for name in ("iq", "psd", "cube", "burst"):
            assert np.array_equal(row[name].numpy(), each.fields[name].data), (each.id, name)
        assert int(row["label"]) == each.metadata["label"] and float(row["snr"]) == each.metadata["snr"]
        assert row["site"] == each.metadata["site"] and row["tags"] == f'[{int(each.id[1:])}, "x"]'


@pytest.mark.parametrize("condition", [None, KEEP_LABELS])
def test_resume_equals_an_uninterrupted_run(spec: TableSpec, condition: str | None) -> None:
    filtered = TableSpec(spec.uri, columns=("id", "iq"), filter=condition)

    def dataset() -> TableDataset:
        return TableDataset(filtered, batch_size=6, rank=1, world_size=2)

    whole = [batch["id"] for batch in dataset()]
    for cut in (1, 3, len(whole) - 1):
        first = dataset()
        delivering = iter(first)
        before = [next(delivering)["id"] for _ in range(cut)]
        second = dataset()
        second.load_state_dict(first.state_dict())
        assert before + [batch["id"] for batch in second] == whole


def test_map_dataset_equals_sds_record_by_record(spec: TableSpec) -> None:
    dataset = sds.open(spec.uri[4:].partition("?")[0])
    mapped = TableMapDataset(spec)
    assert len(mapped) == len(dataset) == RECORDS
    for index in range(RECORDS):
        row, each = mapped[index], dataset[index]
        assert row["id"] == each.id and int(row["label"]) == each.metadata["label"]
        for name, field in each.fields.items():
            assert row[name].dtype == torch.from_numpy(field.data.copy()).dtype
            assert np.array_equal(row[name].numpy(), field.data), (index, name)
    batch = mapped.__getitems__([5, 99, 5, 0])
    assert [row["id"] for row in batch] == [dataset[i].id for i in (5, 99, 5, 0)]


def test_rows_are_writable_copies(spec: TableSpec) -> None:
    mapped = TableMapDataset(spec)
    first = mapped[3]
    first["iq"].mul_(0)
    first["cube"] += 1
    again = mapped[3]
    assert again["iq"].abs().sum() > 0
    assert np.array_equal(again["cube"].numpy(), record(3).fields["cube"].data)
    for batch in TableDataset(spec, batch_size=10):
        batch["psd"].zero_()
    assert not np.array_equal(next(iter(TableDataset(spec, batch_size=10)))["psd"].numpy(), 0)


def test_distributed_sampler_over_two_ranks_covers_every_record_once(spec: TableSpec) -> None:
    mapped = TableMapDataset(TableSpec(spec.uri, columns=("id", "iq", "psd")))
    seen = []
    for rank in range(2):
        sampler = DistributedSampler(mapped, num_replicas=2, rank=rank, shuffle=True, seed=3, drop_last=True)
        for batch in DataLoader(mapped, batch_size=16, sampler=sampler):
            assert batch["iq"].shape[1:] == (2, 8) and batch["iq"].dtype == torch.complex64
            seen += batch["id"]
    assert sorted(seen) == [f"r{number:04d}" for number in range(RECORDS)]


def test_filter_reads_only_metadata(spec: TableSpec) -> None:
    root = Path(spec.uri[4:].partition("?")[0])
    filtered = TableSpec(spec.uri, filter=f"{KEEP_LABELS} AND site != 'site-9'", columns=("id",))
    # Without the data shards only metadata can be read: planning and counting still work.
    shutil.rmtree(root / "objects" / "data")
    assert len(TableMapDataset(filtered)) == len(kept())
    # A range inside a shard counts only its own stored rows: records 45..64 of shard 1.
    assert open_source(filtered).count([WorkItem(1, 5, 25), WorkItem(3, 0, 0)]) == [10, 0]
    with pytest.raises(ValueError, match=r"reads the fields \['psd'\].*metadata keys"):
        open_source(TableSpec(spec.uri, filter="psd > 0"))


def test_bad_columns_and_uris_name_the_fix(spec: TableSpec, tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"unknown columns \['samples'\].*the dataset has \['id', 'burst', 'cube', 'iq'"
    ):
        open_source(TableSpec(spec.uri, columns=("samples",)))
    with pytest.raises(ValueError, match="must give exactly dataset, snapshot, digest"):
        TableSpec(f"sds:{tmp_path}?snapshot=s1").resolve()
    with pytest.raises(FileNotFoundError, match="no SDS dataset at"):
        TableSpec(f"sds:{tmp_path / 'missing'}").resolve()


def test_records_unlike_the_first_are_named(tmp_path: Path) -> None:
    root = tmp_path / "mixed"
    records = [
        sds.Record("a", {"s": sds.Field(np.zeros(4, np.float32), axes=(sds.Axis("t", 4),))}, metadata={"gain": 1}),
        sds.Record("b", {"s": sds.Field(np.zeros(4, np.int16), axes=(sds.Axis("t", 4),))}, metadata={"gain": 1}),
        sds.Record("c", {"s": sds.Field(np.zeros(2, np.float32), axes=(sds.Axis("t", 2),))}, metadata={"gain": 0.5}),
    ]
    sds.publish(str(root), [sds.write_shard(records, str(root))], dataset_id="mixed", snapshot_id="1")
    source = open_source(TableSpec(f"sds:{root}").resolve())
    with pytest.raises(ValueError, match=r"field 's' of record 'b' is int16\[4\], but the first record's is float32"):
        source.take([Take(0, [0, 1])])
    with pytest.raises(ValueError, match=r"metadata key 'gain' of record 'c' is 0.5, but the column is int64"):
        source.take([Take(0, [0, 2])])


def test_republished_root_is_refused(spec: TableSpec) -> None:
    republish(Path(spec.uri[4:].partition("?")[0]))
    with pytest.raises(ValueError, match=r"was republished.*snapshot 's2'.*not dataset 'captures' snapshot 's1'"):
        open_source(spec)


@pytest.mark.slow
def test_republished_root_is_refused_in_a_spawned_worker(spec: TableSpec) -> None:
    dataset = TableDataset(TableSpec(spec.uri, columns=("id", "iq")), batch_size=8)
    loader = DataLoader(dataset, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    republish(Path(spec.uri[4:].partition("?")[0]))
    with pytest.raises(ValueError, match=r"SDS root .*captures' was republished.*'s2'.*'s1'"):
        list(loader)


def test_write_table_round_trips_the_layout(tmp_path: Path) -> None:
    data = layout_table([30, 20, 25], seed=1)
    written = write_table(f"sds:{tmp_path / 'auto'}", data, split_rows=30)
    source = open_source(written)
    assert [split.end for split in source.splits] == [30, 30, 15]
    # Lists become fields by default; scalars become metadata.
    assert source.schema.names == ["id", "v", "score", "x"]
    spec = publish_table(str(tmp_path / "layout"), data, fields=["x", "v"], split_rows=25)
    rows = TableMapDataset(spec)
    assert [int(rows[i]["id"]) for i in range(len(rows))] == list(range(75))
    for i in range(75):
        assert (
            float(rows[i]["x"]) == i / 2
            and rows[i]["x"].shape == (1,)
            and rows[i]["v"].tolist() == [4 * i + k for k in range(4)]
        )
    assert [int(rows[i]["score"]) for i in range(75)] == data.column("score").to_pylist()
    with pytest.raises(FileExistsError, match="never overwrites"):
        write_table(f"sds:{tmp_path / 'auto'}", data)


def test_to_torch_keeps_complex_values_of_sliced_batches(tmp_path: Path) -> None:
    root = tmp_path / "wide"
    arrays = [np.arange(6, dtype=np.complex64).reshape(3, 2) * (1 + 2j) + k for k in range(5)]
    records = [
        sds.Record(str(k), {"z": sds.Field(a, axes=(sds.Axis("a", 3), sds.Axis("b", 2)))}) for k, a in enumerate(arrays)
    ]
    sds.publish(str(root), [sds.write_shard(records, str(root))], dataset_id="wide", snapshot_id="1")
    source = open_source(TableSpec(f"sds:{root}").resolve())
    (batch, _, _), *_ = source.read([WorkItem(0, 0, 5)])
    tail = to_torch(batch.slice(2))["z"]
    assert tail.dtype == torch.complex64 and tail.shape == (3, 3, 2)
    assert np.array_equal(tail.numpy(), np.stack(arrays[2:]))


class Fit(pl.LightningModule):
    """Fits one weight to the power of the complex ``iq`` samples, keeping the ids it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[str] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.seen += batch["id"]
        power = batch["iq"].abs().pow(2).mean(dim=(1, 2))
        return (self.weight - power).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_datamodule_trains_on_an_sds_table(spec: TableSpec, tmp_path: Path) -> None:
    model = Fit()
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, datamodule=SpiralDataModule(TableSpec(spec.uri, columns=("id", "iq")), batch_size=16))
    assert sorted(model.seen) == [f"r{number:04d}" for number in range(RECORDS)]
    assert float(model.weight.detach()) > 0


@pytest.mark.slow
def test_ray_reads_an_sds_table_as_its_rows(spec: TableSpec, local_ray: None) -> None:
    from ray_adapter import read_table

    blocks = read_table(TableSpec(spec.uri, filter=KEEP_LABELS), override_num_blocks=4)
    batches = [
        to_torch(block)
        for table in blocks.iter_batches(batch_format="pyarrow", batch_size=None)
        for block in table.to_batches()
    ]
    assert sorted(i for batch in batches for i in batch["id"]) == kept()
    for batch in batches:
        assert batch["iq"].dtype == torch.complex64
        for i, iq in zip(batch["id"], batch["iq"], strict=True):
            assert np.array_equal(iq.numpy(), record(int(i[1:])).fields["iq"].data)
