"""Packing documents into blocks: exactly once and in order over ranks, workers, block lengths and
split layouts, resume at any batch equal to the uninterrupted stream, counts that match what is
read, and states that refuse another stream. Token ids are unique per token, so every check is
by exact id."""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader

from spiral_lightning import PackedDataset, Packing, Shard, SpiralDataModule, TableDataset, TableSpec, balanced, stripe
from spiral_lightning.datasets.groups import group_size, ramp
from spiral_lightning.reading.frames import read_frames, start_of
from spiral_lightning.reading.packing import PIECE_TOKENS, PackPosition, read_blocks
from spiral_lightning.sources import open_source
from tests import count_ddp_job
from tests.count_ddp_job import PACKED_LENGTH
from tests.examples import examples
from tests.loaders import stopped_and_resumed
from tests.ranks import rank_jobs
from tests.tables import BACKENDS, write_uneven, write_uneven_parquet

EXAMPLES = examples(30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SEPARATOR = -1
POLICIES = {"stripe": stripe, "balanced": balanced}
ROOT = Path(__file__).resolve().parent.parent


def documents(lengths: Sequence[int]) -> list[list[int]]:
    """Documents of ``lengths`` tokens whose ids count up across the table, so each id is one token."""
    starts = np.concatenate(([0], np.cumsum(lengths)))
    return [list(range(int(starts[i]), int(starts[i + 1]))) for i in range(len(lengths))]


def corpus(lengths: Sequence[int]) -> pa.Table:
    """Rows ``id``, ``tokens`` (int32 documents of ``lengths``) and ``keep``, the row number modulo 3
    (``keep < 2`` drops every third row)."""
    return pa.table(
        {
            "id": pa.array(np.arange(len(lengths), dtype=np.int64)),
            "tokens": pa.array(documents(lengths), pa.list_(pa.int32())),
            "keep": pa.array(np.arange(len(lengths), dtype=np.int64) % 3),
        }
    )


@contextmanager
def table(lengths: Sequence[int], splits: Sequence[int], backend: str, filtered: bool = False) -> Iterator[TableSpec]:
    root = Path(tempfile.mkdtemp(prefix="packing-"))
    try:
        write = write_uneven_parquet if backend == "parquet" else write_uneven
        spec = write(root / "t", corpus(lengths), splits)
        yield replace(spec, filter="keep < 2" if filtered else None)
    finally:
        shutil.rmtree(root)


def cut(total: int, parts: int, draw: st.DrawFn) -> list[int]:
    """``total`` rows cut into ``parts`` split sizes (some may be empty)."""
    bounds = sorted(draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1)))
    return [b - a for a, b in zip([0, *bounds], [*bounds, total], strict=True)]


@st.composite
def layouts(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """Document lengths (empty, one-token and longer than a block among them) and split sizes."""
    lengths = draw(st.lists(st.sampled_from([0, 1, 2, 3, 5, 8, 13, 40]), min_size=1, max_size=40))
    return lengths, cut(len(lengths), draw(st.integers(1, 5)), draw)


def stream(docs: list[list[int]], separator: int | None) -> list[int]:
    """The reference stream: documents in order, each non-empty one followed by the separator."""
    return [token for doc in docs for token in ([*doc, separator] if doc and separator is not None else doc)]


def reference_positions(docs: list[list[int]], separator: int | None) -> list[int]:
    extra = 0 if separator is None else 1
    return [p for doc in docs if doc for p in range(len(doc) + extra)]


def consumer_docs(spec: TableSpec, items: Any, lengths: Sequence[int]) -> list[list[int]]:
    """The documents of ``items`` in the order the row reader delivers their ids."""
    ids = replace(spec, columns=("id",))
    rows = [
        i
        for frame, _ in read_frames(open_source(ids), items, start_of(items), None, "keep_partial")
        for i in frame.rows().column("id").to_pylist()
    ]
    every = documents(lengths)
    return [every[i] for i in rows]


@EXAMPLES
@given(
    layout=layouts(),
    backend=st.sampled_from(BACKENDS),
    world_size=st.integers(1, 3),
    workers=st.integers(1, 3),
    length=st.integers(1, 12),
    batch_size=st.integers(1, 3),
    separator=st.sampled_from([None, SEPARATOR]),
    filtered=st.booleans(),
    policy=st.sampled_from(sorted(POLICIES)),
    piece=st.sampled_from([1, 20, PIECE_TOKENS]),
)
def test_every_token_once_in_order_over_ranks_workers_lengths_and_layouts(
    layout: tuple[list[int], list[int]],
    backend: str,
    world_size: int,
    workers: int,
    length: int,
    batch_size: int,
    separator: int | None,
    filtered: bool,
    policy: str,
    piece: int,
) -> None:
    lengths, splits = layout
    packing = Packing("tokens", length, separator)
    with table(lengths, splits, backend, filtered) as spec:
        source = open_source(replace(spec, columns=("tokens",)))
        seen: list[int] = []
        for rank in range(world_size):
            for worker in range(workers):
                items = POLICIES[policy](source.splits, Shard(rank, world_size, worker, workers), 0)
                docs = consumer_docs(spec, items, lengths)
                expected = stream(docs, separator)
                positions = reference_positions(docs, separator)
                whole = len(expected) // length * length
                start = PackPosition(start_of(items))
                blocks = read_blocks(source, items, start, packing, batch_size, "keep_partial", piece=piece)
                tokens: list[int] = []
                delivered_positions: list[int] = []
                while True:
                    try:
                        batch, _ = next(blocks)
                    except StopIteration as end:
                        dropped = end.value
                        break
                    assert batch.tokens.shape[1] == length and 1 <= len(batch.tokens) <= batch_size
                    tokens += batch.tokens.ravel().tolist()
                    delivered_positions += batch.positions.ravel().tolist()
                assert tokens == expected[:whole]
                assert delivered_positions == positions[:whole]
                assert dropped == len(expected) - whole
                seen += expected
        kept = [doc for row, doc in enumerate(documents(lengths)) if not filtered or row % 3 != 2]
        real = sorted(token for token in seen if token != SEPARATOR)
        assert real == sorted(token for doc in kept for token in doc)


@EXAMPLES
@given(
    layout=layouts(),
    backend=st.sampled_from(BACKENDS),
    world_size=st.integers(1, 2),
    length=st.integers(1, 12),
    batch_size=st.integers(1, 3),
    separator=st.sampled_from([None, SEPARATOR]),
    stop=st.floats(0, 1),
)
def test_a_resume_at_any_batch_continues_the_identical_stream(
    layout: tuple[list[int], list[int]],
    backend: str,
    world_size: int,
    length: int,
    batch_size: int,
    separator: int | None,
    stop: float,
) -> None:
    lengths, splits = layout
    with table(lengths, splits, backend) as spec:
        for rank in range(world_size):
            options: dict[str, Any] = {
                "column": "tokens",
                "length": length,
                "batch_size": batch_size,
                "separator": separator,
                "rank": rank,
                "world_size": world_size,
            }
            whole = [(b["tokens"].tolist(), b["positions"].tolist()) for b in PackedDataset(spec, **options)]
            cut_at = int(stop * len(whole))
            first = PackedDataset(spec, **options)
            delivering = iter(first)
            before = [next(delivering) for _ in range(cut_at)]
            saved = first.state_dict()
            second = PackedDataset(spec, **options)
            second.load_state_dict(saved)
            after = [(b["tokens"].tolist(), b["positions"].tolist()) for b in second]
            assert [(b["tokens"].tolist(), b["positions"].tolist()) for b in before] + after == whole


def test_blocks_cross_documents_and_documents_cross_blocks(tmp_path: Path) -> None:
    """Empty, one-token and longer-than-a-block documents, exact ids and positions."""
    spec = write_uneven(tmp_path / "t", corpus([3, 0, 1, 9, 2]), [2, 3])
    dataset = PackedDataset(spec, column="tokens", length=4, batch_size=2, separator=SEPARATOR)
    batches = list(dataset)
    assert [b["tokens"].tolist() for b in batches] == [
        [[0, 1, 2, -1], [3, -1, 4, 5]],
        [[6, 7, 8, 9], [10, 11, 12, -1]],
    ]
    assert [b["positions"].tolist() for b in batches] == [
        [[0, 1, 2, 3], [0, 1, 0, 1]],
        [[2, 3, 4, 5], [6, 7, 8, 9]],
    ]
    assert all(b["tokens"].dtype == torch.int64 == b["positions"].dtype for b in batches)
    assert dataset.dropped == 3  # 13, 14 and the separator
    assert dataset.tokens(0) == [19] and len(dataset) == 4 and dataset.batches(0) == 2


def test_dropped_tokens_read_the_same_in_the_main_process_through_two_workers(tmp_path: Path) -> None:
    spec = write_uneven(tmp_path / "t", corpus([3, 0, 1, 9, 2, 5, 7]), [2, 3, 2])
    dataset = PackedDataset(spec, column="tokens", length=4, batch_size=2, separator=SEPARATOR)
    # Each worker drops its stream's tail shorter than a block.
    expected = sum(tokens % 4 for tokens in dataset.tokens(2))
    assert expected > 0
    list(dataset.loader(num_workers=2))
    assert dataset.dropped == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_counts_are_the_blocks_each_consumer_yields(tmp_path: Path, backend: str) -> None:
    lengths = [7, 0, 30, 1, 12, 5, 9, 2, 40, 3] * 3
    write = write_uneven_parquet if backend == "parquet" else write_uneven
    spec = write(tmp_path / "t", corpus(lengths), [6, 9, 0, 15])
    for rank in range(2):
        dataset = PackedDataset(spec, column="tokens", length=8, batch_size=3, rank=rank, world_size=2)
        source = dataset.source()
        for workers in (0, 1, 3):
            consumers = max(1, workers)
            per_consumer = []
            for worker in range(consumers):
                items = dataset.work(Shard(rank, 2, worker, consumers))
                docs = consumer_docs(spec, items, lengths)
                per_consumer.append(len(stream(docs, None)))
                blocks = read_blocks(source, items, PackPosition(start_of(items)), dataset.packing, 3, "keep_partial")
                assert sum(len(b.tokens) for b, _ in blocks) == per_consumer[-1] // 8
            assert dataset.tokens(workers) == per_consumer
            assert dataset.batches(workers) == sum(-(-(t // 8) // 3) for t in per_consumer)
    quota, left_out = dataset.even_rows(2)
    blocks = [
        t // 8
        for rank in range(2)
        for t in PackedDataset(spec, column="tokens", length=8, batch_size=3, rank=rank, world_size=2).tokens(2)
    ]
    assert (quota, left_out) == (min(blocks), sum(blocks) - min(blocks) * 4)


def test_a_quota_of_blocks_stops_every_consumer_at_the_same_batch(tmp_path: Path) -> None:
    spec = write_uneven(tmp_path / "t", corpus([5, 9, 3, 20, 1, 7, 11]), [3, 4])
    datasets = [
        PackedDataset(spec, column="tokens", length=4, batch_size=2, rank=rank, world_size=2) for rank in range(2)
    ]
    quota, _ = datasets[0].even_rows(0)
    for dataset in datasets:
        dataset.set_rows_per_consumer(quota)
        delivered = list(dataset)
        assert sum(len(b["tokens"]) for b in delivered) == quota
        assert len(delivered) == dataset.batches(0)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_ranks_share_the_token_counts_of_a_job(tmp_path: Path, policy: str) -> None:
    """Two gloo processes count a packed table's tokens for even batches: each reads the token
    column of half the job's work items, once in three epochs, and gets every rank's counts."""
    spec = write_uneven(tmp_path / "t", corpus([(row * 7) % 23 for row in range(60)]), [10, 0, 15, 20, 15])
    world_size, workers = 2, 2
    argv = ["--uri", spec.uri, "--packed", "tokens", "--policy", policy, "--out", str(tmp_path)]
    rank_jobs(count_ddp_job.main, argv, world_size, tmp_path)
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(world_size)]
    options: dict[str, Any] = {"column": "tokens", "length": PACKED_LENGTH, "batch_size": 3, "policy": policy}
    alone = [PackedDataset(spec, **options, rank=rank, world_size=world_size) for rank in range(world_size)]
    shards = [Shard(rank, world_size, worker, workers) for rank in range(world_size) for worker in range(workers)]
    items = list(dict.fromkeys(item for shard in shards for item in alone[0].work(shard)))
    assert [result["reads"] for result in results] == [[len(items[rank::world_size])] for rank in range(world_size)]
    for dataset, result in zip(alone, results, strict=True):
        for epoch, counted in enumerate(result["epochs"]):
            dataset.set_epoch(epoch)
            assert counted == {"even_rows": list(dataset.even_rows(workers)), "batches": dataset.batches(workers)}


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_stateful_dataloader_with_two_workers_resumes_mid_document(tmp_path: Path, backend: str) -> None:
    lengths = [50, 3, 0, 17, 120, 1, 64, 9] * 4
    write = write_uneven_parquet if backend == "parquet" else write_uneven
    spec = write(tmp_path / "t", corpus(lengths), [8, 8, 8, 8])

    def loader() -> StatefulDataLoader:
        dataset = PackedDataset(spec, column="tokens", length=16, batch_size=3, separator=SEPARATOR)
        return dataset.loader(num_workers=2, persistent_workers=False)

    whole = [b["tokens"].tolist() for b in loader()]
    assert len(whole) == len(loader())
    before, after = stopped_and_resumed(loader, 5)
    assert [b["tokens"].tolist() for b in before + after] == whole
    # Each worker packs its own work list's documents: the loader takes their groups of batches in turn.
    dataset = PackedDataset(spec, column="tokens", length=16, batch_size=3, separator=SEPARATOR)
    per_worker = []
    for worker in range(2):
        expected = stream(consumer_docs(spec, dataset.work(Shard(0, 1, worker, 2)), lengths), SEPARATOR)
        blocks = [expected[start : start + 16] for start in range(0, len(expected) // 16 * 16, 16)]
        per_worker.append([blocks[start : start + 3] for start in range(0, len(blocks), 3)])
    groups = [grouped(batches, group_size(dataset)) for batches in per_worker]
    assert whole == [
        batch for pair in itertools.zip_longest(*groups, fillvalue=[]) for group in pair for batch in group
    ]


def grouped(batches: list[Any], size: int) -> list[list[Any]]:
    """``batches`` in the groups a worker sends them in: growing from one (``ramp``) up to ``size``."""
    groups: list[list[Any]] = []
    done = 0
    while done < len(batches):
        groups.append(batches[done : done + ramp(done, size)])
        done += len(groups[-1])
    return groups


def test_a_state_of_another_stream_or_table_is_refused(tmp_path: Path) -> None:
    spec = write_uneven(tmp_path / "t", corpus([5, 9, 3, 20]), [4])
    dataset = PackedDataset(spec, column="tokens", length=4, batch_size=1, separator=SEPARATOR)
    delivering = iter(dataset)
    next(delivering)
    next(delivering)
    state = dataset.state_dict()
    assert state["offset"] == 2 and state["packing"] == ["tokens", 4, SEPARATOR]
    for other, named in (({"length": 8}, "length: saved 4, now 8"), ({"separator": None}, "separator: saved -1")):
        options: dict[str, Any] = {"column": "tokens", "length": 4, "batch_size": 1, "separator": SEPARATOR, **other}
        with pytest.raises(ValueError, match=named):
            PackedDataset(spec, **options).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size: saved 1, now 2"):
        PackedDataset(spec, column="tokens", length=4, batch_size=2, separator=SEPARATOR).load_state_dict(state)
    rows = TableDataset(replace(spec, columns=("tokens",)), batch_size=1)
    with pytest.raises(ValueError, match="not a PackedDataset state"):
        PackedDataset(spec, column="tokens", length=4, batch_size=1).load_state_dict(rows.state_dict())
    damaged = {**state, "offset": 99}
    with pytest.raises(ValueError, match="was edited or damaged after it was saved"):
        PackedDataset(spec, column="tokens", length=4, batch_size=1, separator=SEPARATOR).load_state_dict(damaged)
    # Without a digest (saved before states had one) the offset is refused when its document is read.
    del damaged["digest"]
    resumed = PackedDataset(spec, column="tokens", length=4, batch_size=1, separator=SEPARATOR)
    resumed.load_state_dict(damaged)
    with pytest.raises(ValueError, match="token offset 99 lies past the 10 tokens"):
        next(iter(resumed))


def test_bad_columns_and_null_documents_are_named(tmp_path: Path) -> None:
    spec = write_uneven(tmp_path / "t", corpus([2, 3]), [2])
    with pytest.raises(ValueError, match=r"column of token ids .* not 'id' of type int64"):
        PackedDataset(spec, column="id", length=4, batch_size=1)
    with pytest.raises(ValueError, match="'tokens' is not among the columns \\['id'\\]"):
        PackedDataset(replace(spec, columns=("id",)), column="tokens", length=4, batch_size=1)
    with pytest.raises(ValueError, match="block length must be a positive int"):
        PackedDataset(spec, column="tokens", length=0, batch_size=1)
    nulls = pa.table({"tokens": pa.array([[1, 2], None, [3]], pa.list_(pa.int64()))})
    null_spec = write_uneven(tmp_path / "n", nulls, [3])
    with pytest.raises(ValueError, match=r"document 1 of .* is null .* IS NOT NULL"):
        list(PackedDataset(null_spec, column="tokens", length=1, batch_size=1))
    filtered = replace(null_spec, filter="tokens IS NOT NULL")
    assert [b["tokens"].tolist() for b in PackedDataset(filtered, column="tokens", length=3, batch_size=1)] == [
        [[1, 2, 3]]
    ]


class Recorder(pl.LightningModule):
    """Records the token blocks of every training batch it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[list[list[int]]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append(batch["tokens"].tolist())
        return (self.weight * batch["positions"].float().mean()).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.slow
def test_lightning_trains_on_packed_blocks_and_resumes_mid_epoch(tmp_path: Path) -> None:
    spec = write_uneven(tmp_path / "t", corpus([30, 2, 0, 45, 7, 19, 60, 1] * 3), [8, 8, 8])

    def fit(model: Recorder, folder: str, **options: Any) -> pl.Trainer:
        data = SpiralDataModule(train=spec, batch_size=2, packing=Packing("tokens", 8, SEPARATOR))
        checkpoints = pl.callbacks.ModelCheckpoint(tmp_path / folder, every_n_train_steps=3, save_last=True)
        trainer = pl.Trainer(
            accelerator="cpu",
            max_epochs=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[checkpoints],
            default_root_dir=tmp_path,
            **options,
        )
        trainer.fit(model, datamodule=data)
        return trainer

    whole = Recorder()
    fit(whole, "whole")
    expected = PackedDataset(spec, column="tokens", length=8, batch_size=2, separator=SEPARATOR)
    assert whole.seen == [b["tokens"].tolist() for b in expected]
    first = Recorder()
    fit(first, "stopped", max_steps=6)
    second = Recorder()
    data = SpiralDataModule(train=spec, batch_size=2, packing=Packing("tokens", 8, SEPARATOR))
    trainer = pl.Trainer(
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(second, datamodule=data, ckpt_path=str(tmp_path / "stopped" / "last.ckpt"))
    assert (len(first.seen), len(second.seen), len(whole.seen)) == (6, len(whole.seen) - 6, len(whole.seen))
    assert first.seen + second.seen == whole.seen
