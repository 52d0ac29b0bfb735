"""Several batches of a DataLoader worker in one message.

torchdata's loader spends about half a millisecond of Python on each item a worker sends, on
each side (a state snapshot and its delta, protocol checks, the index round trip), whatever the
item holds: for batches of a few hundred rows that is most of their cost. A ``Grouped`` dataset
makes each worker send ``size`` batches as one ``Group``, in one shared-memory block, with the
state after each of them; the ``Loader`` hands them on one by one, and a state taken between two
of them names the state after the last one handed on (``Loader.state_dict``).
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Iterator
from typing import Any, NamedTuple

from torch.utils.data import IterableDataset, get_worker_info

from spiral_lightning.datasets.stuck import WatchedIterator
from spiral_lightning.reading.transfer import handed_on_group

#: Rows a group holds at least when its batches are smaller (fewer batches a group when larger).
GROUP_ROWS = 4096
#: Batches a group holds at most.
MOST_GROUPED = 16


def group_size(dataset: Any) -> int:
    """The batches a group of ``dataset`` holds: enough for ``GROUP_ROWS`` rows, 1 to
    ``MOST_GROUPED`` (1: no groups; also for a kind that says ``GROUPS = False`` or has no batch
    size)."""
    rows = getattr(dataset, "batch_size", None)
    if not rows or not getattr(dataset, "GROUPS", False):
        return 1
    return max(1, min(MOST_GROUPED, GROUP_ROWS // int(rows)))


def as_they_are(group: Any) -> Any:
    """A loader's ``collate_fn`` for groups: their batches are tensors already."""
    return group


class Group(NamedTuple):
    """Batches a worker sends as one item, and its dataset's state after each of them."""

    batches: list[Any]
    states: list[dict[str, Any]]


class Grouped(IterableDataset[Any]):
    """``dataset`` (a ``TableDataset`` or a kind built on it) read by a DataLoader worker in
    groups of ``size`` batches; in the main process, its batches as they are. Its state is the
    dataset's, and every other attribute is the dataset's too, so what reads a loader's dataset
    finds the table's settings."""

    def __init__(self, dataset: Any, size: int) -> None:
        self.dataset = dataset
        self.size = size
        #: Batches left in the group each worker was sending when its state was saved: its first
        #: group after the resume holds only those, so later groups end where they would have.
        self.left: dict[int, int] = {}

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        if info is None:
            yield from self.dataset
            return
        # The group goes in one block: the dataset leaves its batches where they are.
        self.dataset.hands_on = False
        size = self.left.pop(info.id, self.size)
        batches: list[Any] = []
        states: list[dict[str, Any]] = []
        for batch in self.dataset:
            batches.append(batch)
            states.append(self.dataset.state_dict())
            if len(batches) == size:
                yield Group(handed_on_group(batches), states)
                batches, states, size = [], [], self.size
        if batches:
            yield Group(handed_on_group(batches), states)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self.dataset.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet: being unpickled
            raise AttributeError(name)
        return getattr(self.dataset, name)


#: The key of a loader state saved between two batches of a worker's group that says which worker
#: was sending it and how many batches it had left (``Grouped.left``).
GROUP_LEFT = "spiral_lightning_group_left"


class GroupedIterator(WatchedIterator):
    """The iterator of a ``Loader`` over a ``Grouped`` dataset: the batches of the workers'
    groups one by one, and a state that, between two batches of a group, is as if that worker had
    sent the batches so far alone: its dataset's state after the last one handed on, that worker
    the next to hand on (torchdata's snapshot holds the whole group), and the batches its group had
    left (``GROUP_LEFT``), so that its first group after a resume ends where this one would have."""

    _pending: deque[tuple[Any, tuple[int, dict[str, Any], int] | None]] | None = None
    _within: tuple[int, dict[str, Any], int] | None = None

    def __next__(self) -> Any:
        if not self._pending:
            item = super().__next__()
            if not isinstance(item, Group):
                self._within = None
                return item
            worker, last = self._last_yielded_worker_id, len(item.batches) - 1
            self._pending = deque(
                (batch, None if index == last else (worker, item.states[index], last - index))
                for index, batch in enumerate(item.batches)
            )
        batch, self._within = self._pending.popleft()
        return batch

    def _reset(self, loader: Any, first_iter: bool = False, prime_prefetch: bool = True) -> None:
        self._pending, self._within = None, None
        super()._reset(loader, first_iter, prime_prefetch)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = super().state_dict()
        if self._within is None:
            return state
        worker, dataset_state, left = self._within
        state = copy.deepcopy(state)
        snapshot = state["_snapshot"]
        snapshot["_worker_snapshots"][f"worker_{worker}"]["dataset_state"] = dataset_state
        snapshot["_last_yielded_worker_id"] = (worker - 1) % self._num_workers
        state[GROUP_LEFT] = {"worker": worker, "left": left}
        return state
