"""The data-stall meter: how much of each training step is spent waiting for its batch.

A *step* runs from the moment a loop asks for a batch to the moment it asks for the next one;
its *wait* is the part spent asking. The *share* is wait over step: near 0 when the model is the
bottleneck, near 1 when the accelerator idles on data.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple, TypeVar

import numpy as np
import pyarrow as pa
import torch

from spiral_lightning.core.checks import check_positive

T = TypeVar("T")

#: The share of a step above which a step counts as stalled, and how many in a row warn.
STALL_SHARE = 0.2
STALL_STEPS = 50


class StepWait(NamedTuple):
    """One step's times: ``wait_ms`` waited for its batch of ``rows`` rows, ``step_ms`` in all."""

    wait_ms: float
    step_ms: float
    rows: int

    @property
    def share(self) -> float:
        """The part of the step spent waiting, 0 to 1."""
        return self.wait_ms / self.step_ms if self.step_ms > 0 else 0.0


class StallMeter:
    """Counts how long the steps of a training loop wait for their batches, and notices when they
    keep waiting: ``stalled`` turns true (once) when ``steps`` steps in a row each waited more
    than ``share`` of their time. ``metrics()`` gives the means since its last call, under the
    names a logger or ``ray.train.report`` takes.

        meter = StallMeter()
        for batch in meter.metered(loader):
            ...  # train; then ray.train.report({**meter.metrics(), "loss": ...})
    """

    def __init__(self, share: float = STALL_SHARE, steps: int = STALL_STEPS) -> None:
        if not 0 < share < 1:
            raise ValueError(f"share must be between 0 and 1, not {share!r}")
        self.share = share
        self.steps = check_positive("steps", steps)
        self.last: StepWait | None = None
        self._in_a_row = 0
        self._warned = False
        self._stalled = False
        self._since: list[StepWait] = []

    def record(self, wait_s: float, step_s: float, rows: int) -> StepWait:
        """Take one step: ``wait_s`` seconds waiting for a batch of ``rows`` rows, of ``step_s`` in all."""
        step = StepWait(wait_s * 1000, max(step_s, wait_s) * 1000, rows)
        self.last = step
        self._since.append(step)
        self._in_a_row = self._in_a_row + 1 if step.share > self.share else 0
        self._stalled = not self._warned and self._in_a_row >= self.steps
        self._warned = self._warned or self._stalled
        return step

    @property
    def stalled(self) -> bool:
        """Whether the step just recorded made ``steps`` stalled steps in a row, the first time."""
        return self._stalled

    def metrics(self) -> dict[str, float]:
        """``data/wait_ms`` (mean wait per step), ``data/wait_share`` (the steps' wait over their
        time) and ``data/rows_per_s`` (rows over time) of the steps since the last call; empty
        when none was recorded."""
        steps, self._since = self._since, []
        return measures(steps)

    def metered(self, batches: Iterable[T]) -> Iterator[T]:
        """``batches``, each timed: the wait is the time ``next`` takes, the step the time from
        one ``next`` to the next (the loop's work on the batch included). A stall warns once,
        naming the loader's settings."""
        settings = loader_settings(batches)
        iterator = iter(batches)
        asked = time.perf_counter()
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            got = time.perf_counter()
            yield batch
            now = time.perf_counter()
            self.record(got - asked, now - asked, rows_of(batch))
            if self.stalled:
                warnings.warn(self.advice(settings), stacklevel=2)
            asked = now

    def advice(self, settings: Mapping[str, Any], who: str = "") -> str:
        """The warning for a stall: what the steps waited and the ``settings`` the loader reads
        with (such as ``num_workers``), with what each would change."""
        last = self.last or StepWait(0.0, 0.0, 0)
        read = ", ".join(f"{name}={value!r}" for name, value in settings.items())
        return (
            f"{who}the last {self.steps} training steps each waited for their batch more than "
            f"{self.share:.0%} of their time (the last: {last.wait_ms:.1f} ms of {last.step_ms:.1f} ms, "
            f"{last.share:.0%}): the model idles on data. The loader reads with {read}. Faster: more "
            "num_workers where a Python transform or media decoding is the work, more read_threads "
            "where plain columns are, a deeper read_ahead from an object store, a larger batch_size "
            "where the per-batch cost dominates. The metrics data/wait_ms and data/wait_share show "
            "what a change does."
        )


def measures(steps: list[StepWait]) -> dict[str, float]:
    """The means of ``steps`` under the meter's metric names (see ``StallMeter.metrics``)."""
    if not steps:
        return {}
    waited = sum(step.wait_ms for step in steps)
    spent = sum(step.step_ms for step in steps)
    rows = sum(step.rows for step in steps)
    return {
        "data/wait_ms": waited / len(steps),
        "data/wait_share": waited / spent if spent > 0 else 0.0,
        "data/rows_per_s": rows / spent * 1000 if spent > 0 else 0.0,
    }


def rows_of(batch: Any) -> int:
    """The rows of a batch: an Arrow record batch's, the first dimension of its first tensor or
    array (a ``dict``'s values, a tuple's or list's items, searched in order), the length of a
    ``dict``'s first list or of a list of rows, else 0."""
    if isinstance(batch, torch.Tensor | np.ndarray):
        return int(batch.shape[0]) if batch.ndim else 1
    if isinstance(batch, pa.RecordBatch):
        return int(batch.num_rows)
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        if isinstance(item, torch.Tensor | np.ndarray):
            return rows_of(item)
    if isinstance(batch, Mapping):
        lengths = [len(item) for item in batch.values() if isinstance(item, (list, tuple))]
        return lengths[0] if lengths else 0
    return len(batch) if isinstance(batch, (list, tuple)) else 0


#: The settings of a loader and its dataset that decide how fast batches arrive.
FEEDING = ("num_workers", "read_threads", "read_ahead", "batch_size")


def loader_settings(loader: Any) -> dict[str, Any]:
    """The ``FEEDING`` settings of ``loader`` or its dataset, the first that is not None (a
    DataLoader's ``batch_size`` is None over a dataset that batches itself, such as
    ``TableDataset``); None where every holder of a setting has it None (``read_threads=None``:
    the default)."""
    holders = [holder for holder in (loader, getattr(loader, "dataset", None)) if holder is not None]
    found: dict[str, Any] = {}
    for name in FEEDING:
        values = [getattr(holder, name) for holder in holders if hasattr(holder, name)]
        if values:
            found[name] = next((value for value in values if value is not None), None)
    return found
