"""Stopping a real StatefulDataLoader after some batches and resuming a new one from its state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchdata.stateful_dataloader import StatefulDataLoader


def stopped_and_resumed(loader: Callable[[], StatefulDataLoader], stop: int) -> tuple[list[Any], list[Any]]:
    """The first ``stop`` batches of a loader from ``loader()``, and every batch a second one
    delivers after loading the first's state: together they must equal an uninterrupted epoch."""
    first = loader()
    before = []
    for batch in first:
        before.append(batch)
        if len(before) == stop:
            break
    state = first.state_dict()
    del first
    second = loader()
    second.load_state_dict(state)
    return before, list(second)
