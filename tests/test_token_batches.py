"""Token-budget batches: the plan of a window (every piece once, every batch within the budget),
the rows and tokens a TokenBatchDataset delivers, its resume through DataLoader workers, the
padding it saves, its errors, and DDP ranks taking equal steps through the DataModule."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint

from spiral_lightning import SpiralDataModule, TableSpec, TokenBatchDataset, TokenBudget, Windows, write_table
from spiral_lightning.demos.data import corpus_tables
from spiral_lightning.lightning.cli import main
from spiral_lightning.planning.token_batches import count_batches, plan_window, window_rng
from spiral_lightning.record import rows
from tests.ranks import torchrun
from tests.tables import BACKENDS
from tests.test_record import noted_steps

#: Document ``i``'s tokens are ``i * STRIDE, i * STRIDE + 1, ...``: each batch names its documents.
STRIDE = 100_000


def corpus(root: Path, lengths: Sequence[int], backend: str = "parquet", split_rows: int = 300) -> TableSpec:
    documents = [list(range(i * STRIDE, i * STRIDE + int(n))) for i, n in enumerate(lengths)]
    rows = pa.table({"tokens": pa.array(documents, pa.list_(pa.int64())), "id": range(len(lengths))})
    return write_table(f"{backend}:{root}", rows, split_rows=split_rows)


def pieces_of(batch: dict[str, Any], budget: TokenBudget) -> list[tuple[int, int, int]]:
    """Each piece of ``batch`` as (document, first token's place, tokens), checking that its
    tokens are the document's consecutive tokens and that the batch keeps the budget."""
    tokens = batch["tokens"]
    if budget.form == "flat":
        assert tokens.numel() <= budget.max_tokens
        bounds = batch["cu_seqlens"].tolist()
        rows = [tokens[low:high] for low, high in itertools.pairwise(bounds)]
        assert batch["max_seqlen"] == max(len(row) for row in rows)
        assert torch.equal(batch["positions"], torch.cat([torch.arange(len(row)) for row in rows]))
    else:
        assert tokens.shape[0] * tokens.shape[1] <= budget.max_tokens
        rows = [row[:n] for row, n in zip(tokens, batch["lengths"].tolist(), strict=True)]
        assert max(len(row) for row in rows) == tokens.shape[1]
        assert all((row[n:] == budget.pad).all() for row, n in zip(tokens, batch["lengths"].tolist(), strict=True))
    found = []
    for row in rows:
        first = int(row[0]) if len(row) else -1
        assert torch.equal(row, torch.arange(first, first + len(row)))
        found.append((first // STRIDE, first % STRIDE, len(row)))
    return found


@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=200),
    max_tokens=st.integers(1, 600),
    form=st.sampled_from(["padded", "flat"]),
    long=st.sampled_from(["truncate", "split"]),
    group=st.booleans(),
    seed=st.integers(0, 3),
)
def test_a_window_plans_every_piece_once_within_the_budget(
    lengths: list[int], max_tokens: int, form: Any, long: Any, group: bool, seed: int
) -> None:
    budget = TokenBudget("tokens", max_tokens=max_tokens, form=form, long=long, group=group)
    window = np.array(lengths, dtype=np.int64)
    found, batches = plan_window(window, budget, window_rng(seed, 0, (0, 1, 0, 1), 0))
    order = np.concatenate(batches)
    assert sorted(order.tolist()) == list(range(len(found.document)))
    for batch in batches:
        costs = np.maximum(found.length[batch], 1)
        used = len(batch) * int(costs.max()) if form == "padded" else int(costs.sum())
        assert used <= max_tokens
    # Each document's pieces are its tokens in order, all of them unless truncated.
    for document, n in enumerate(lengths):
        mine = found.document == document
        starts, sizes = found.start[mine], found.length[mine]
        assert starts.tolist() == [max_tokens * k for k in range(len(starts))]
        assert int(sizes.sum()) == (min(n, max_tokens) if long == "truncate" else n)
    # Without grouping, batches take documents in stored order.
    if not group:
        assert order.tolist() == list(range(len(order)))
    assert count_batches(window, budget, seed, 0, (0, 1, 0, 1)) == len(batches)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["padded", "flat"])
def test_every_document_arrives_once_whole_and_the_count_ahead_is_exact(
    tmp_path: Path, backend: str, form: Any
) -> None:
    lengths = np.random.default_rng(1).integers(0, 400, 1000)
    spec = corpus(tmp_path / "corpus", lengths, backend)
    budget = TokenBudget("tokens", max_tokens=1000, form=form, window=128)
    dataset = TokenBatchDataset(spec, budget=budget, shuffle=True, seed=5)
    batches = list(dataset)
    assert dataset.batches(0) == len(batches)
    found = [piece for batch in batches for piece in pieces_of(batch, budget)]
    # Empty documents arrive as empty rows; every other one whole, from its first token.
    nonempty = sorted(document for document, start, size in found if size)
    assert nonempty == [i for i, n in enumerate(lengths) if n]
    assert all(start == 0 and size == lengths[document] for document, start, size in found if size)
    assert len(found) == len(lengths)
    assert batches[0]["tokens"].dtype == torch.int64


def test_long_documents_are_refused_by_name_or_split_or_truncated(tmp_path: Path) -> None:
    lengths = [5, 20, 3, 50, 7]
    spec = corpus(tmp_path / "corpus", lengths)
    refuse = TokenBatchDataset(spec, budget=TokenBudget("tokens", max_tokens=16))
    with pytest.raises(ValueError, match=r"rank 0, worker 0\), window 0 .*document 1 holds 20 tokens.*long='split'"):
        list(refuse)
    for long, expected in [("split", [5, 16, 4, 3, 16, 16, 16, 2, 7]), ("truncate", [5, 16, 3, 16, 7])]:
        budget = TokenBudget("tokens", max_tokens=16, form="flat", long=long, group=False)
        found = [piece for batch in TokenBatchDataset(spec, budget=budget) for piece in pieces_of(batch, budget)]
        assert [size for _, _, size in found] == expected


@pytest.mark.slow
@pytest.mark.parametrize("stop", [1, 23])
def test_a_loader_with_two_workers_resumes_mid_epoch_exactly(tmp_path: Path, stop: int) -> None:
    lengths = np.random.default_rng(2).integers(1, 300, 1500)
    spec = corpus(tmp_path / "corpus", lengths)
    budget = TokenBudget("tokens", max_tokens=1024, form="flat", window=64)

    def loader() -> Any:
        return TokenBatchDataset(spec, budget=budget, shuffle=True, seed=3).loader(num_workers=2)

    def documents(batch: dict[str, Any]) -> list[int]:
        return [document for document, _, _ in pieces_of(batch, budget)]

    whole = loader()
    full = [documents(batch) for batch in whole]
    assert len(whole) == len(full)
    assert sorted(document for batch in full for document in batch) == list(range(len(lengths)))
    first = loader()
    taken = iter(first)
    before = [documents(next(taken)) for _ in range(stop)]
    state = first.state_dict()
    del taken, first
    resumed = loader()
    resumed.load_state_dict(state)
    assert before + [documents(batch) for batch in resumed] == full


def test_length_grouping_pads_under_a_tenth_where_fixed_rows_pad_most(tmp_path: Path) -> None:
    lengths = np.random.default_rng(3).integers(10, 2001, 4000)
    spec = corpus(tmp_path / "corpus", lengths, split_rows=1000)
    budget = TokenBudget("tokens", max_tokens=16_384)
    batches = list(TokenBatchDataset(spec, budget=budget))
    padded = sum(batch["tokens"].numel() for batch in batches)
    share = 1 - int(lengths.sum()) / padded
    # Fixed rows a batch, as many as the budget's batches hold on average, padded to their longest.
    rows = round(len(lengths) / len(batches))
    fixed = sum(rows * int(lengths[i : i + rows].max()) for i in range(0, len(lengths), rows))
    fixed_share = 1 - int(lengths.sum()) / fixed
    assert share < 0.10 < fixed_share


def test_bad_columns_states_and_settings_are_named(tmp_path: Path) -> None:
    spec = corpus(tmp_path / "corpus", [3, 4, 5])
    with pytest.raises(ValueError, match=r"column of token ids .* not 'id' of type int64"):
        TokenBatchDataset(spec, budget=TokenBudget("id", max_tokens=8))
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):
        TokenBudget("tokens", max_tokens=0)
    with pytest.raises(ValueError, match="form must be one of"):
        TokenBudget("tokens", max_tokens=8, form="ragged")  # type: ignore[arg-type]
    nulls = write_table(
        f"parquet:{tmp_path / 'nulls'}", pa.table({"tokens": pa.array([[1], None, [2]], pa.list_(pa.int64()))})
    )
    with pytest.raises(ValueError, match=r"document 1 of .* is null.*IS NOT NULL"):
        list(TokenBatchDataset(nulls, budget=TokenBudget("tokens", max_tokens=8)))
    dataset = TokenBatchDataset(spec, budget=TokenBudget("tokens", max_tokens=8))
    iterator = iter(dataset)
    next(iterator)
    state = dataset.state_dict()
    other = TokenBatchDataset(spec, budget=TokenBudget("tokens", max_tokens=9))
    with pytest.raises(ValueError, match=r"another token budget \(saved \['tokens', 8,"):
        other.load_state_dict(state)
    elsewhere = TokenBatchDataset(spec, budget=TokenBudget("tokens", max_tokens=8), rank=0, world_size=2)
    with pytest.raises(ValueError, match="saved ranks and workers"):
        elsewhere.load_state_dict(state)
    with pytest.raises(ValueError, match="tokens trains on batches sized by a token budget, which windows"):
        SpiralDataModule(spec, tokens=TokenBudget("tokens", max_tokens=8), windows=Windows(4))


class Recorder(pl.LightningModule):
    """Notes the documents of every training batch."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[int] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        tokens, lengths = batch["tokens"], batch["lengths"]
        self.seen += [int(row[0]) // STRIDE for row, n in zip(tokens, lengths, strict=True) if n]
        return self.weight.sum() * 0 + tokens.float().mean() * self.weight.sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_the_datamodule_resumes_a_token_budget_epoch_mid_way(tmp_path: Path, workers: int) -> None:
    """Resumed with the saved worker count, and with another, which re-plans the epoch."""
    lengths = np.random.default_rng(4).integers(1, 200, 600)
    spec = corpus(tmp_path / "corpus", lengths)
    budget = TokenBudget("tokens", max_tokens=800)

    def fit(model: Recorder, steps: int, ckpt_path: Path | None = None) -> None:
        data = SpiralDataModule(
            spec,
            tokens=budget,
            shuffle=True,
            num_workers=0 if ckpt_path is None else workers,
            record=str(tmp_path / "record"),
        )
        saves = ModelCheckpoint(tmp_path, every_n_train_steps=7, save_top_k=-1, filename="{step}")
        options: dict[str, Any] = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False}
        trainer = pl.Trainer(max_epochs=1, max_steps=steps, callbacks=[saves], default_root_dir=tmp_path, **options)
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)

    first, second = Recorder(), Recorder()
    fit(first, 7)
    fit(second, -1, tmp_path / "step=7.ckpt")
    assert len(first.seen) > 0 and len(second.seen) > 0
    assert sorted(first.seen + second.seen) == list(range(len(lengths)))
    # The record kept the first run's 7 steps and the resumed run's: every document once.
    recorded = rows(tmp_path / "record")
    named = [
        300 * split + row for ranges in recorded.values() for split, low, high in ranges[0] for row in range(low, high)
    ]
    assert sorted(named) == list(range(len(lengths)))


def cli_in(argv: Sequence[str]) -> None:
    os.chdir(argv[0])
    main(list(argv[1:]))


@pytest.mark.slow
def test_the_token_budget_config_takes_equal_steps_on_two_ddp_ranks(tmp_path: Path) -> None:
    config = str(Path(__file__).resolve().parent.parent / "configs" / "lm-tokens.yaml")
    small = ["--data.init_args.documents", "500", "--data.init_args.num_workers", "0", "--trainer.max_epochs", "1"]
    ddp = ["--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.enable_progress_bar", "false"]
    torchrun(cli_in, [str(tmp_path), "fit", "--config", config, *small, *ddp], 2, tmp_path)
    train, _ = corpus_tables(str(tmp_path / "data" / "corpus"), 500)
    budget = TokenBudget("tokens", max_tokens=2048, long="split")
    counts = [
        TokenBatchDataset(train.resolve(), budget=budget, rank=rank, world_size=2).batches(0) for rank in range(2)
    ]
    last = torch.load(tmp_path / "runs" / "lm-tokens" / "checkpoints" / "last.ckpt", weights_only=True)
    # Lightning's DDP steps every rank together: both took the fewest batches any rank planned.
    assert min(counts) > 0 and last["global_step"] == min(counts)


def test_the_record_names_the_documents_of_each_token_budget_step(tmp_path: Path) -> None:
    lengths = np.random.default_rng(5).integers(1, 300, 900)
    spec = corpus(tmp_path / "corpus", lengths)  # splits of 300 documents: document i is row i % 300 of split i // 300
    budget = TokenBudget("tokens", max_tokens=1024, form="flat", window=64)
    dataset = TokenBatchDataset(spec, budget=budget, shuffle=True, seed=3)
    seen = noted_steps(
        tmp_path / "record",
        dataset,
        dataset.loader(num_workers=2),
        lambda batch: sorted(document for document, _, _ in pieces_of(batch, budget)),
    )
    recorded = rows(tmp_path / "record")
    assert sorted(recorded) == list(range(len(seen)))
    named = [
        sorted(300 * split + row for split, start, end in recorded[step][0] for row in range(start, end))
        for step in recorded
    ]
    assert named == seen
    assert sorted(document for step in named for document in step) == list(range(len(lengths)))
