"""Even evaluation batches: every rank of a DDP validation, test or predict run yields the same
number of batches, each row of the table once, because the ranks with fewer batches end with
padding batches whose rows are marked invalid.

A padding batch is a batch of the table's first rows, read as every batch of the stage is read
(collate, media, transform), with its validity mask all False. Every evaluation batch carries
that mask under ``VALID``: a ``[rows]`` bool tensor, True on the rows of the table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import torch
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities import rank_zero_info

from spiral_lightning.datasets.table import TableDataset
from spiral_lightning.lightning.loader import SpiralLoader
from spiral_lightning.planning.policies import stripe

#: The key of every evaluation batch's validity mask: True on the table's rows, False on padding.
VALID = "valid"


class WithValid:
    """An evaluation stage's transform: the batch with ``VALID`` added (all True, one per row),
    then the stage's own ``transform`` when there is one, which must keep the key (a class, so
    that it pickles for DataLoader workers)."""

    def __init__(self, transform: Callable[[Any], Any] | None) -> None:
        self.transform = transform

    def __call__(self, batch: dict[str, Any]) -> Any:
        # Every value of a collated batch holds one entry per row (see tensors.to_torch), and a
        # spec selects at least one column.
        rows = len(next(iter(batch.values())))
        marked = {**batch, VALID: torch.ones(rows, dtype=torch.bool)}
        return marked if self.transform is None else self.transform(marked)


def check_unmasked(schema: pa.Schema, stage: str, uri: str) -> None:
    """``ValueError`` when the ``stage`` table's columns already hold the mask's name ``VALID``."""
    if VALID in schema.names:
        raise ValueError(
            f"the {stage} table {uri!r} has a column named {VALID!r}, the key of the validity mask every "
            "evaluation batch carries; select the columns without it (columns=[...]) or rename the column"
        )


def padding_batch(dataset: TableDataset, stage: str) -> dict[str, Any]:
    """The batch a ``stage`` rank pads with: the table's first ``batch_size`` rows read as
    ``dataset`` reads (its transform ends with ``WithValid``'s mask), the mask all False.

    Every rank reads the same rows the same way, so each gets the same batch, or the same error."""
    first = TableDataset(
        dataset.spec,
        batch_size=dataset.batch_size,
        policy=stripe,
        rank=0,
        world_size=1,
        collate=dataset.collate,
        read_ahead=0,
        transform=dataset.transform,
    )
    # Only a stage in which some rank reads rows pads, so the table has a first batch; reading
    # in line (read_ahead=0), the pass left behind holds no thread.
    batch = next(iter(first))
    if not isinstance(batch, dict) or not isinstance(batch.get(VALID), torch.Tensor):
        raise ValueError(
            f"the transform of the {stage} table {dataset.spec.uri!r} returned a batch without its {VALID!r} "
            "mask; ranks with fewer batches pad with rows marked False there, so return a dict that keeps the "
            f"{VALID!r} tensor, or pass even_batches=False to let batch counts differ between ranks"
        )
    return {**batch, VALID: torch.zeros_like(batch[VALID])}


def padding_note(stage: str, batches: Sequence[int]) -> str:
    """What padding does to a ``stage`` run whose ranks read ``batches`` batches each, in one
    line to log on rank 0."""
    padded = sum(max(batches) - count for count in batches)
    return (
        f"{stage} yields {max(batches)} batches on each of {len(batches)} ranks, {padded} of all of them "
        f"padding batches ({VALID!r} False on every row) for the ranks with fewer rows"
    )


def evaluation_loader(
    dataset: TableDataset, stage: str, strategy: Strategy | None, num_workers: int, options: dict[str, Any]
) -> SpiralLoader:
    """The loader of one rank's evaluation ``stage``. With a ``strategy`` (even batches over more
    than one rank), every rank yields the batches of the rank with the most, the others ending
    with padding batches. A collective then: Lightning asks every rank for the loader at the same
    point."""
    mine = dataset.batches(num_workers)
    if strategy is None:
        return SpiralLoader(dataset, batches=mine, **options)
    counts = strategy.all_gather(torch.tensor([mine], device=strategy.root_device)).flatten().tolist()
    if min(counts) == max(counts):
        return SpiralLoader(dataset, batches=mine, **options)
    rank_zero_info(f"SpiralDataModule: {padding_note(stage, counts)}")
    # Read by every rank alike, so a transform that drops the mask fails on all of them at
    # once, rather than leaving the ranks that do not pad waiting for the one that failed.
    return SpiralLoader(dataset, batches=max(counts), pad=padding_batch(dataset, stage), **options)
