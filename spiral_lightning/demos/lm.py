"""The language-model demo: a corpus of token documents stored as embedded local tables, a
DataModule that packs the train documents into blocks and pads the validation documents, and a
small model that learns the corpus's next-token rule.

The corpus follows a fixed rule so a model can learn it: each token is followed by
``(3 * token + 1) % vocabulary`` most of the time, else by a random token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pyarrow as pa
import torch
import torch.nn.functional as F

from spiral_lightning.core.sequences import LENGTH_SUFFIX, Padded
from spiral_lightning.core.spec import TableSpec
from spiral_lightning.lightning.datamodule import SpiralDataModule
from spiral_lightning.lightning.padding import VALID
from spiral_lightning.reading.packing import POSITIONS, Packing
from spiral_lightning.sources.spiral import IDS_FILE
from spiral_lightning.sources.write import write_table

#: Token ids of the demo corpus are ``1..VOCABULARY - 1``; 0 separates documents.
VOCABULARY = 512
SEPARATOR = 0
#: The column that holds each document's token ids.
TOKENS = "tokens"


def corpus(documents: int, seed: int = 0) -> pa.Table:
    """``documents`` documents of 1 to 300 token ids following the corpus's rule."""
    generator = np.random.default_rng(seed)
    lengths = generator.integers(1, 301, documents)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    tokens = np.empty(int(lengths.sum()), dtype=np.int64)
    tokens[starts] = generator.integers(1, VOCABULARY, documents)
    # Position by position across every document still that long.
    for step in range(1, int(lengths.max())):
        at = starts[lengths > step] + step
        follows = tokens[at - 1] * 3 % (VOCABULARY - 1) + 1
        noisy = generator.random(at.size) < 0.1
        tokens[at] = np.where(noisy, generator.integers(1, VOCABULARY, at.size), follows)
    offsets = np.concatenate((starts, [tokens.size])).astype(np.int32)
    return pa.table({TOKENS: pa.ListArray.from_arrays(offsets, pa.array(tokens.astype(np.int32)))})


def corpus_tables(root: str | Path, documents: int = 4_000, split_rows: int = 500) -> tuple[TableSpec, TableSpec]:
    """The train and validation corpora under ``root`` (``train``, ``val``: a tenth as many
    documents, another seed), written there first when missing."""
    specs = []
    for name, count, seed in (("train", documents, 0), ("val", max(1, documents // 10), 1)):
        folder = Path(root) / name
        if not (folder / IDS_FILE).exists():
            write_table(f"spiral:{folder}", corpus(count, seed), split_rows=split_rows)
        specs.append(TableSpec(f"spiral:{folder}"))
    return specs[0], specs[1]


class BigramLM(pl.LightningModule):
    """A small language model: each token's embedding predicts the next token.

    Training batches are packed blocks (``tokens`` and ``positions``, ``[B, length]``): a
    document's first token (position 0) is not predicted from the document before it. Validation
    batches are padded documents (``tokens``, ``tokens_length``, and the ``valid`` mask of
    padding rows under DDP): only a document's own next tokens count.
    """

    def __init__(self, vocabulary: int = VOCABULARY, width: int = 64, lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = torch.nn.Embedding(vocabulary, width)
        self.out = torch.nn.Linear(width, vocabulary)
        self.lr = lr

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, positions = batch[TOKENS], batch[POSITIONS]
        predicted = positions[:, 1:] > 0
        logits = self.out(self.embed(tokens[:, :-1]))
        loss = F.cross_entropy(logits[predicted], tokens[:, 1:][predicted])
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        # Padding keeps the column's type (int32 here); cross entropy takes int64 targets.
        tokens, lengths, valid = batch[TOKENS].long(), batch[TOKENS + LENGTH_SUFFIX], batch[VALID]
        # A target counts when it lies inside its document, of a row of the table.
        inside = torch.arange(1, tokens.shape[1], device=tokens.device)[None, :] < lengths[:, None]
        predicted = inside & valid[:, None]
        targets = int(predicted.sum())
        logits = self.out(self.embed(tokens[:, :-1]))
        losses = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
        loss = (losses * predicted).sum() / max(targets, 1)
        # Weighted by targets, so a padding batch (no targets) adds nothing to the epoch's mean.
        self.log("val_loss", loss, prog_bar=True, batch_size=targets, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class CorpusDataModule(SpiralDataModule):
    """The demo corpus under ``root``, written there by ``prepare_data`` when missing: the train
    documents packed into blocks of ``length`` tokens (separator 0), the validation documents
    padded to at most ``length`` tokens. Other arguments are ``SpiralDataModule``'s."""

    def __init__(self, root: str = "data/corpus", documents: int = 4_000, length: int = 256, **options: Any) -> None:
        super().__init__(
            train=TableSpec(f"spiral:{Path(root) / 'train'}"),
            val=TableSpec(
                f"spiral:{Path(root) / 'val'}",
                padded=(Padded(TOKENS, max_length=length, overflow="truncate"),),
            ),
            packing=Packing(TOKENS, length=length, separator=SEPARATOR),
            **options,
        )
        self.root = root
        self.documents = documents

    def prepare_data(self) -> None:
        corpus_tables(self.root, self.documents)
