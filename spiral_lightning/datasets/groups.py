"""Several batches of a DataLoader worker in one message.

torchdata's loader spends a few hundred microseconds of Python on each item a worker sends, on
each side (a state snapshot and its delta, the index round trip, the relay), whatever the item
holds: for batches of a few thousand rows or fewer that is most of their cost. A ``Grouped``
dataset makes each worker send ``size`` batches (fewer when they reach ``GROUP_BYTES``) as one
``Group``, in one shared-memory block, with the state after each of them; the ``Loader`` hands
them on one by one, and a state taken between two of them names the state after the last one
handed on (``Loader.state_dict``). A worker's groups grow from one batch at the start of its epoch
(``ramp``), so its first batch waits for one batch, not a whole group.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.data import IterableDataset, get_worker_info

from spiral_lightning.core.state import Cursor, State
from spiral_lightning.datasets.stuck import WatchedIterator
from spiral_lightning.reading.convert import FrameBytes, group_pieces
from spiral_lightning.reading.frames import Frame
from spiral_lightning.reading.tensors import Nulls
from spiral_lightning.reading.transfer import handed_on_group, handed_on_pieces, tensor_bytes

#: Rows a group holds at least when its batches are smaller (fewer batches a group when larger).
#: Each group costs each side the better part of a millisecond of CPU, whatever it holds (on 2
#: cores, 1024-row batches of three columns from 2 workers): 16,384 rows a group took 0.44 s of CPU
#: per million rows in all against 0.365 s at 65,536, and delivered 0.94x the in-process rate
#: against 1.15x; 4,096 rows a group cost the worker a third more again.
GROUP_ROWS = 65_536
#: Batches a group holds at most: with 256-row batches, 256 of them delivered 0.89x the in-process
#: rate against 0.75x for 64.
MOST_GROUPED = 256
#: Bytes of tensors after which a group ends whatever its rows, so that groups of images or long
#: sequences stay a few batches: a group lies in one block, and each worker has two in flight.
GROUP_BYTES = 16 << 20


def group_size(dataset: Any) -> int:
    """The batches a group of ``dataset`` holds: enough for ``GROUP_ROWS`` rows, 1 to
    ``MOST_GROUPED`` (1: no groups; also for a kind that says ``GROUPS = False``). A kind whose
    batches are no count of rows says how many of them a group holds (``GROUP_BATCHES``, else 1:
    read batches of a dataset without a batch size), ``GROUP_BYTES`` ending a group sooner."""
    if not getattr(dataset, "GROUPS", False):
        return 1
    rows = getattr(dataset, "batch_size", None)
    if not rows:
        return int(getattr(dataset, "GROUP_BATCHES", 1))
    return max(1, min(MOST_GROUPED, GROUP_ROWS // int(rows)))


def ramp(done: int, size: int) -> int:
    """The batches a worker's next group holds at most when it has sent ``done`` batches this
    epoch: three times as many, from 1 up to ``size`` (1, 3, 12, 48, ...: the worker has sent 1, 4,
    16, 64 before each). A function of ``done`` alone, so a resumed worker that knows it
    (``GROUP_HANDED``) ends its groups where an uninterrupted one would. Growing fourfold, the
    groups reach 256 batches in four more messages than one group would take, against eight
    doubling."""
    return min(size, max(1, 3 * done))


class _Ends:
    """Where one pass of a worker cuts its batches into groups: at ``ramp``'s count, at
    ``GROUP_BYTES``, or, first after a resume inside a group, at the batches it had ``left``."""

    def __init__(self, size: int, done: int, left: int | None) -> None:
        self.size = size
        self.done = done
        self.most = ramp(done, size) if left is None else left

    def reached(self, batches: int, held: int) -> bool:
        """Whether a group of ``batches`` batches of ``held`` bytes ends here; if so, the next
        one's count is set."""
        if batches < self.most and held < GROUP_BYTES:
            return False
        self.done += batches
        self.most = ramp(self.done, self.size)
        return True


def as_they_are(group: Any) -> Any:
    """A loader's ``collate_fn`` for groups: their batches are tensors already."""
    return group


class Marks:
    """The ``State`` after each batch of a group of plain batches, kept as the state after its
    last batch (``last``) and, after each batch, the two fields that change from batch to batch
    within a pass: the cursor and the rows delivered (``TableDataset.mark``). Indexed, it gives
    each batch's ``State``. A worker takes and pickles these two values a batch instead of a whole
    ``State`` (about 12 us of CPU a batch less), and the main process makes a batch's ``State``
    only when a state is saved after it."""

    def __init__(self, last: State, marks: list[tuple[Cursor | None, int]]) -> None:
        self.last = last
        self.marks = marks

    def __len__(self) -> int:
        return len(self.marks)

    def __getitem__(self, index: int) -> State:
        if index in (-1, len(self.marks) - 1):
            return self.last
        cursor, delivered = self.marks[index]
        return dataclasses.replace(self.last, cursor=cursor, delivered=delivered)


#: The states after each batch of a group (see ``Group``).
States = list[State | dict[str, Any]] | Marks


class Group(NamedTuple):
    """Batches a worker sends as one item, and its dataset's state after each of them, as
    ``State`` values where the dataset can (``state_now``, or ``Marks`` for plain batches): the
    loader makes one plain (``State.to_dict``, which seals it) only when a state is saved between
    two of them, instead of the worker making every one. With ``rows``, ``batches`` is one batch
    of all their rows, and batch ``i`` is its next ``rows[i]`` rows."""

    batches: list[Any]
    states: States
    rows: list[int] | None = None


class Grouped(IterableDataset[Any]):
    """``dataset`` (a ``TableDataset`` or a kind built on it, see ``state_now``) read by a
    DataLoader worker in groups of ``size`` batches; in the main process, its batches as they
    are. A group of plain tensor batches (``TableDataset.sliced``) is converted and copied at once,
    and each batch is a slice of it (``convert.group_pieces``). Its state is the dataset's, and
    every other attribute is the dataset's too, so what reads a loader's dataset finds the table's
    settings."""

    def __init__(self, dataset: Any, size: int) -> None:
        self.dataset = dataset
        self.size = size
        #: Batches left in the group each worker was sending when its state was saved: its first
        #: group after the resume holds only those, so later groups end where they would have.
        self.left: dict[int, int] = {}
        #: Batches each worker had handed on in its epoch when its state was saved (``ramp``).
        self.handed: dict[int, int] = {}
        #: The state after the group just sent, as ``state_dict`` returns it: the DataLoader asks
        #: for it as each group leaves, and the dataset has not moved since.
        self._sent: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        if info is None:
            yield from self.dataset
            return
        ends = _Ends(self.size, self.handed.pop(info.id, 0), self.left.pop(info.id, None))
        for group in self._sliced(ends) if self.dataset.sliced() else self._batched(ends):
            self._sent = plain(group.states[-1])
            yield group
            self._sent = None

    def _batched(self, ends: _Ends) -> Iterator[Group]:
        """The dataset's batches in groups, each batch copied into the group's block."""
        # The group goes in one block: the dataset leaves its batches where they are.
        self.dataset.hands_on = False
        batches: list[Any] = []
        states: list[State | dict[str, Any]] = []
        held = 0
        for batch in self.dataset:
            batches.append(batch)
            states.append(self.dataset.state_now())
            held += tensor_bytes(batch)
            if ends.reached(len(batches), held):
                yield Group(handed_on_group(batches), states)
                batches, states, held = [], [], 0
        if batches:
            yield Group(handed_on_group(batches), states)

    def _sliced(self, ends: _Ends) -> Iterator[Group]:
        """The dataset's frames in groups, each group converted at once when its batches are
        slices of its conversion, else frame by frame; their states as ``Marks`` where the
        dataset's state is a ``State``."""
        dataset = self.dataset
        nulls = Nulls(dataset.spec.null_fill, dataset.spec.null_mask)
        convert = dataset.converter()
        frame_bytes = FrameBytes()
        marked = isinstance(dataset.state_now(), State)
        frames: list[tuple[Frame, int]] = []
        marks: list[tuple[Cursor | None, int]] = []
        states: list[State | dict[str, Any]] = []
        held = 0

        def group() -> Group:
            # Where state_now is a State it is state(), which says so to the type checker.
            taken: States = Marks(dataset.state(), marks) if marked else states
            pieces = group_pieces([frame for frame, _ in frames], nulls, dataset.spec.padded)
            if pieces is None:
                return Group(handed_on_group([convert(frame, first) for frame, first in frames]), taken)
            return Group([handed_on_pieces(pieces)], taken, [frame.num_rows for frame, _ in frames])

        for frame, first in dataset.frames():
            frames.append((frame, first))
            if marked:
                marks.append(dataset.mark())
            else:
                states.append(dataset.state_now())
            held += frame_bytes(frame)
            if ends.reached(len(frames), held):
                yield group()
                frames, marks, states, held = [], [], [], 0
        if frames:
            yield group()

    def state_dict(self) -> dict[str, Any]:
        if self._sent is not None:
            return self._sent
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
#: The key of a loader state saved inside an epoch that lists, worker by worker, the batches it
#: had handed on in that epoch (``Grouped.handed``).
GROUP_HANDED = "spiral_lightning_group_handed"


class _Place(NamedTuple):
    """A batch handed on inside a group: the worker that sent it, the group's states, the batch's
    index among them (``at``) and the batches the group has left after it."""

    worker: int
    states: States
    at: int
    left: int


class GroupedIterator(WatchedIterator):
    """The iterator of a ``Loader`` over a ``Grouped`` dataset: the batches of the workers'
    groups one by one, and a state that, between two batches of a group, is as if that worker had
    sent the batches so far alone: its dataset's state after the last one handed on, that worker
    the next to hand on (torchdata's snapshot holds the whole group), and the batches its group had
    left (``GROUP_LEFT``), so that its first group after a resume ends where this one would have.
    Inside an epoch the state also counts each worker's batches handed on (``GROUP_HANDED``), so
    that its later groups do too (``ramp``)."""

    _pending: deque[tuple[Any, _Place | None]] | None = None
    _within: _Place | None = None
    #: The worker whose group is being handed on, and each worker's batches handed on this epoch.
    _sender = 0
    _handed: list[int]
    #: The ``GROUP_LEFT`` of the state this iterator resumed, until the first group arrives: a
    #: state saved before it says the same.
    _resumed_left: dict[str, int] | None = None

    def __next__(self) -> Any:
        if not self._pending:
            item = super().__next__()
            if not isinstance(item, Group):
                self._within = None
                return item
            worker, last = self._last_yielded_worker_id, len(item.states) - 1
            self._sender, self._resumed_left = worker, None
            batches = item.batches if item.rows is None else _slices(item.batches[0], item.rows)
            self._pending = deque(
                (batch, None if index == last else _Place(worker, item.states, index, last - index))
                for index, batch in enumerate(batches)
            )
        batch, self._within = self._pending.popleft()
        self._handed[self._sender] += 1
        return batch

    def _reset(self, loader: Any, first_iter: bool = False, prime_prefetch: bool = True) -> None:
        self._pending, self._within = None, None
        # A resumed epoch counts on from the loaded state; every later epoch from none.
        loaded = loader.dataset.handed if first_iter else {}
        self._handed = [loaded.get(worker, 0) for worker in range(loader.num_workers)]
        resumed = loader.dataset.left if first_iter else {}
        self._resumed_left = next(({"worker": w, "left": n} for w, n in resumed.items()), None)
        super()._reset(loader, first_iter, prime_prefetch)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = super().state_dict()
        if self._within is not None:
            worker, states, at, left = self._within
            state = copy.deepcopy(state)
            snapshot = state["_snapshot"]
            snapshot["_worker_snapshots"][f"worker_{worker}"]["dataset_state"] = plain(states[at])
            snapshot["_last_yielded_worker_id"] = (worker - 1) % self._num_workers
            state[GROUP_LEFT] = {"worker": worker, "left": left}
        elif self._resumed_left is not None:
            state[GROUP_LEFT] = dict(self._resumed_left)
        # After the epoch's last batch the next state starts a new epoch, whose groups grow again.
        if not self._finished:
            state[GROUP_HANDED] = list(self._handed)
        return state


def plain(state: State | dict[str, Any]) -> dict[str, Any]:
    """A state of a group as ``state_dict`` writes it."""
    return state.to_dict() if isinstance(state, State) else state


def _slices(whole: dict[str, Any], rows: list[int]) -> list[dict[str, Any]]:
    """The batches of ``rows`` rows each that ``whole`` holds end to end."""
    if not whole:
        return [{} for _ in rows]
    ends = list(itertools.accumulate(rows))
    # torch.split cuts a column into all its views at once: a third of the time of a slice each.
    columns = [
        torch.split(value, rows)
        if isinstance(value, torch.Tensor)
        else [value[end - n : end] for n, end in zip(rows, ends, strict=True)]
        for value in whole.values()
    ]
    return [dict(zip(whole, parts, strict=True)) for parts in zip(*columns, strict=True)]
