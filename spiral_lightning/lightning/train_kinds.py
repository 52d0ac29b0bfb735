"""The train datasets of a SpiralDataModule and their epochs: the kinds that count their own
batches (windows of consecutive rows, token-budget batches), whose ranks are kept in step by
reading the same number of batches (``datasets.job.fewest_batches``), and the others, kept in step
by a quota of rows (``datasets.job.even_epoch``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from spiral_lightning.core.budget import TokenBudget
from spiral_lightning.core.plan import Policy
from spiral_lightning.core.spec import TableSpec
from spiral_lightning.datasets.job import even_epoch, fewest_batches
from spiral_lightning.datasets.mixture import Mixture
from spiral_lightning.datasets.table import TableDataset
from spiral_lightning.datasets.token_batches import TokenBatchDataset
from spiral_lightning.datasets.windows import WindowDataset, Windows


def counted_train(
    spec: TableSpec,
    *,
    windows: Windows | None,
    tokens: TokenBudget | None,
    settings: Mapping[str, Any],
    order: Mapping[str, Any],
    window_policy: Policy,
    transform: Callable[[Any], Any] | None,
) -> WindowDataset | TokenBatchDataset:
    """The train dataset over the pinned ``spec`` of ``windows`` or of the token budget ``tokens``
    (one of them given), with the DataModule's ``settings`` (every stage's) and the train
    table's ``order`` (a shuffle's policy and seed, or nothing); windows keep ``window_policy``."""
    if windows is not None:
        own = {key: settings[key] for key in ("batch_size", "last", "rank", "world_size", "read_ahead")}
        return WindowDataset(spec, windows=windows, policy=window_policy, **own)
    if tokens is None:
        raise ValueError("a counted train dataset needs windows or a token budget; neither was given")
    own = {key: settings[key] for key in ("policy", "rank", "world_size", "read_ahead", "read_threads")}
    return TokenBatchDataset(spec, budget=tokens, transform=transform, **{**own, **order})


def prepare_epoch(
    train: TableDataset | Mixture | WindowDataset | TokenBatchDataset,
    epoch: int,
    workers: int,
    *,
    even: bool,
    batch_size: int,
) -> int:
    """Set ``train`` up for ``epoch`` read by ``workers`` DataLoader workers a rank: its work lists
    and, with ``even`` batches, every consumer's quota (a ``TableDataset``) or every rank's batch
    count (the others); rank 0 logs what that leaves out. The rank's batches in that epoch. Every
    rank calls it at the same point of each epoch, so counts are shared between them."""
    train.set_epoch(epoch)
    if not isinstance(train, TableDataset):
        batches, note = fewest_batches(train, workers, even)
        if note is not None:
            rank_zero_info(f"SpiralDataModule: {note}")
        return batches
    train.count_shared(workers)
    if even and train.world_size > 1:
        found = even_epoch(train, workers, batch_size)
        (rank_zero_warn if found.warn else rank_zero_info)(f"SpiralDataModule: {found.note}")
    return train.batches(workers)
