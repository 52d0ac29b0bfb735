"""The train datasets of a SpiralDataModule that count their own batches: windows of consecutive
rows and token-budget batches. Its ranks are kept in step by reading the same number of batches
(``datasets.job.fewest_batches``), not by a quota of rows."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from spiral_lightning.core.budget import TokenBudget
from spiral_lightning.core.plan import Policy
from spiral_lightning.core.spec import TableSpec
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
