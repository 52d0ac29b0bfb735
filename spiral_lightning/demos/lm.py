"""The language-model demo: a corpus of token documents stored as embedded local tables, a
DataModule that packs the train documents into blocks and pads the validation documents, and a
small model that learns the corpus's next-token rule (``spiral_lightning.demos.data``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from spiral_lightning.core.budget import TokenBudget
from spiral_lightning.core.sequences import LENGTH_SUFFIX, Padded
from spiral_lightning.core.spec import TableSpec
from spiral_lightning.demos.data import SEPARATOR, TOKENS, VOCABULARY, corpus, corpus_tables
from spiral_lightning.lightning.datamodule import SpiralDataModule
from spiral_lightning.lightning.padding import VALID
from spiral_lightning.reading.packing import POSITIONS, Packing
from spiral_lightning.reading.token_batches import LENGTHS

#: ``corpus`` and ``corpus_tables`` live in ``spiral_lightning.demos.data``; these paths still work.
__all__ = ["SEPARATOR", "TOKENS", "VOCABULARY", "BigramLM", "CorpusDataModule", "corpus", "corpus_tables"]


class BigramLM(pl.LightningModule):
    """A small language model: each token's embedding predicts the next token.

    Training batches are packed blocks (``tokens`` and ``positions``, ``[B, length]``): a
    document's first token (position 0) is not predicted from the document before it; or padded
    documents of a token budget (``tokens`` ``[B, L]`` and ``lengths``), each predicted within
    its own tokens. Validation
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
        tokens = batch[TOKENS]
        if LENGTHS in batch:
            predicted = torch.arange(1, tokens.shape[1], device=tokens.device)[None, :] < batch[LENGTHS][:, None]
        else:
            predicted = batch[POSITIONS][:, 1:] > 0
        logits = self.out(self.embed(tokens[:, :-1]))
        loss = F.cross_entropy(logits[predicted], tokens[:, 1:][predicted])
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        tokens, lengths, valid = batch[TOKENS], batch[TOKENS + LENGTH_SUFFIX], batch[VALID]
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
    documents packed into blocks of ``length`` tokens (separator 0), or with ``max_tokens`` in
    padded batches of whole documents of at most that many tokens (longer ones split), the
    validation documents padded to at most ``length`` tokens. Other arguments are
    ``SpiralDataModule``'s."""

    def __init__(
        self,
        root: str = "data/corpus",
        documents: int = 4_000,
        length: int = 256,
        max_tokens: int | None = None,
        **options: Any,
    ) -> None:
        budget = None if max_tokens is None else TokenBudget(TOKENS, max_tokens=max_tokens, long="split")
        super().__init__(
            train=TableSpec(f"spiral:{Path(root) / 'train'}"),
            val=TableSpec(
                f"spiral:{Path(root) / 'val'}",
                padded=(Padded(TOKENS, max_length=length, overflow="truncate"),),
            ),
            packing=Packing(TOKENS, length=length, separator=SEPARATOR) if budget is None else None,
            tokens=budget,
            **options,
        )
        self.root = root
        self.documents = documents

    def prepare_data(self) -> None:
        corpus_tables(self.root, self.documents)
