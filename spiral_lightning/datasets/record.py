"""A record of the stored rows each training step read: one JSON-lines file per rank, written by
the train loader and read back by ``rows``.

A rank's file holds a header line each time a train loader starts (the table version, the rank,
and ``from_step``, the step of its first batch) and one line per step: the step, its epoch and its
rows as ``[split, start, end]`` ranges of stored rows (packed when there are many, see
``encoded``), and ``"skipped": true`` for a step whose batch ``skip_steps`` left out. A step of a
consumer that shuffles in windows (a range a row) names its rows by its consumer's cursors before
and after it instead (``"list"``, ``"from"``, ``"to"``), and the consumer's work list, window rows
and window key are written once, in a ``"list"`` line before its first step: the reader draws the
windows' orders again (``planning.delivered.rows_between``), so the trainer's step pays for a few
numbers, not a thousand ranges. Under a filter a cursor counts the rows the filter kept, so the
writer finds each consumer's kept rows once (``Source.kept``, reading the filter's columns of each
split once) and writes the step's stored rows as ranges. A ``WindowDataset`` step's rows are its
windows' rows, from where the consumer's windows lie (``WindowDataset.places``, found once a work
list). Steps are numbered as ``skip_steps`` numbers them. A header
discards what the file says of its ``from_step`` and later steps: a run resumed from an earlier
checkpoint reads those steps again, and what it reads then is what the record keeps.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from spiral_lightning.core.plan import Shard, WorkItem, fingerprint
from spiral_lightning.core.state import Cursor, State
from spiral_lightning.core.storage import StorageOptions
from spiral_lightning.datasets.consumer import Consumer
from spiral_lightning.datasets.mapstyle import TableMapDataset
from spiral_lightning.datasets.mixture import Mixture
from spiral_lightning.datasets.packing import PackedDataset
from spiral_lightning.datasets.table import TableDataset
from spiral_lightning.datasets.token_batches import TokenBatchDataset
from spiral_lightning.datasets.windows import WindowDataset
from spiral_lightning.planning.delivered import Positions, Ranges, Stream, kept_positions, rows_between, stored_ranges
from spiral_lightning.planning.policies import Shuffled, window_key
from spiral_lightning.reading.windows import WindowPlaces
from spiral_lightning.sources.record_files import RecordFiles, check_reachable, read_ranks

#: The version of the lines a record holds.
RECORD_FORMAT = 1

#: A part of the loader's state that a batch moves on: a consumer (its index in worker order)
#: and, in a mixture, one of its tables (``None`` otherwise).
Part = tuple[int, int | None]

#: Ranges a step's line lists as they are; more (a shuffled batch, a range a row) are packed.
LISTED_RANGES = 8


def encoded(ranges: Ranges) -> dict[str, Any]:
    """A step's ranges (``[n, 3]``: split, start, end) as a line holds them: ``{"rows": [[split,
    start, end], ...]}``, or for many ranges ``{"packed": text}``, the ranges' split and start
    differences and lengths as int64, compressed and in base64 (a shuffled batch's thousand single
    rows take a sixth of the bytes)."""
    if len(ranges) <= LISTED_RANGES:
        return {"rows": ranges.tolist()}
    columns = np.stack(
        [np.diff(ranges[:, 0], prepend=0), np.diff(ranges[:, 1], prepend=0), ranges[:, 2] - ranges[:, 1]]
    )
    return {"packed": base64.b64encode(zlib.compress(columns.tobytes(), 1)).decode("ascii")}


class Listed(NamedTuple):
    """A ``"list"`` line read back: the consumer's work list as a ``Stream``, its window rows
    and its window key."""

    stream: Stream
    window: int
    key: Sequence[int]

    @classmethod
    def of(cls, line: Mapping[str, Any]) -> Listed:
        """The list a ``"list"`` line holds."""
        return cls(Stream.of([WorkItem(*item) for item in line["items"]]), int(line["window"]), line["key"])


def decoded(line: Mapping[str, Any], lists: Mapping[int, Listed] | None = None) -> list[tuple[int, int, int]]:
    """The ranges of a step's line (see ``encoded``), as ``(split, start, end)``; a line that
    names its rows by cursors resolves them with its ``"list"`` line, from ``lists`` by number."""
    if "list" in line:
        listed = (lists or {}).get(int(line["list"]))
        if listed is None:
            raise ValueError(f"step {line.get('step')} names work list {line['list']}, which no line before it holds")
        before = None if line["from"] is None else Cursor(*line["from"])
        found = rows_between(listed.stream, before, Cursor(*line["to"]), listed.window, listed.key)
        return [(int(split), int(first), int(end)) for split, first, end in found.tolist()]
    if "packed" not in line:
        return [(int(split), int(start), int(end)) for split, start, end in line["rows"]]
    columns = np.frombuffer(zlib.decompress(base64.b64decode(line["packed"])), dtype=np.int64).reshape(3, -1)
    splits, starts = np.cumsum(columns[0]), np.cumsum(columns[1])
    return list(zip(splits.tolist(), starts.tolist(), (starts + columns[2]).tolist(), strict=True))


def check_recordable(dataset: Any, folder: str | Path, options: StorageOptions | None = None) -> None:
    """``ValueError`` unless ``dataset``'s steps can be recorded in ``folder``: a ``TableDataset`` of
    rows, a ``PackedDataset``, a ``Mixture`` of them, a ``TokenBatchDataset``, a ``WindowDataset``
    or a ``TableMapDataset``, in a folder or object store that can be reached."""
    tables = dataset.tables if type(dataset) is Mixture else [dataset]
    kinds = (TableDataset, PackedDataset, TokenBatchDataset, TableMapDataset, WindowDataset)
    if any(type(table) not in kinds for table in tables):
        raise ValueError(
            "record= notes the stored rows of each step for a TableDataset, PackedDataset, Mixture, token budget, "
            f"windows or map access, not for {type(dataset).__name__}; leave record unset"
        )
    check_reachable(str(folder), options)


class StepRecord:
    """The record of one rank's train loader (see the module): ``note`` each step's batch from
    the states of the loader's consumers after it, ``flush`` at each checkpoint.

        record = StepRecord("runs/record", dataset, rank=0, from_step=0)
        record.begin([])  # a pass from the epoch's start
        record.note(0, consumer_states(loader.state_dict()))
        record.flush()
    """

    def __init__(
        self, folder: str | Path, dataset: Any, rank: int, from_step: int, options: StorageOptions | None = None
    ) -> None:
        check_recordable(dataset, folder, options)
        self.dataset: TableDataset | Mixture | TokenBatchDataset | WindowDataset = dataset
        self.files = RecordFiles(str(folder), rank, options)
        version = dataset.table.version if isinstance(dataset, WindowDataset) else dataset.version
        header = {"format": RECORD_FORMAT, "version": version, "rank": rank, "from_step": from_step}
        if isinstance(dataset, Mixture):
            header["versions"] = [table.spec.version for table in dataset.tables]
        self._lines = [json.dumps(header)]
        # What each consumer's (and, in a mixture, each of its tables') last state was known by:
        # its digest, or the State itself.
        self._seen: dict[Part, object] = {}
        self._states: dict[Part, State | None] = {}
        # Each consumer's work list of each table by its fingerprint, planned once: the items, their
        # stream and, under a filter, the stream positions of the rows it kept.
        self._work: dict[tuple[int | None, Shard], tuple[str | None, list[WorkItem], Stream, Positions | None]] = {}
        # The number of each "list" line written, by table, consumer, work list and window key.
        self._lists: dict[tuple[int | None, Shard, str | None, tuple[int, ...]], int] = {}
        # A WindowDataset consumer's last lead, and its windows' places by work list.
        self._leads: dict[Part, int] = {}
        self._places: dict[Shard, tuple[str | None, WindowPlaces]] = {}

    def begin(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Start a pass whose consumers continue from ``states`` (a restored position's, in worker
        order; none for a pass from an epoch's start)."""
        self._seen, self._states, self._leads = {}, {}, {}
        for index, state in enumerate(states):
            for table, part in _parts(state):
                self._seen[index, table] = part.get("digest") if isinstance(part, Mapping) else part
                self._states[index, table] = part if isinstance(part, State) else _cursor_state(part)[0]
                self._leads[index, table] = part.get("lead", 0) if isinstance(part, Mapping) else 0

    def note(self, step: int, states: Sequence[Mapping[str, Any] | State], skipped: bool = False) -> None:
        """Note the batch of ``step``: the rows between the previous and the new state of the one
        consumer whose state moved on, of ``states`` (every consumer's, in worker order: as dicts,
        or in process as the dataset's ``State``). A state before its consumer's first batch (no
        cursor) is taken as the start of its list."""
        moved: list[tuple[Part, State, object, bool, Any]] = []
        for index, state in enumerate(states):
            for table, part in _parts(state):
                # A dict is known by its digest; a State by itself (its equality leaves out nothing read here).
                mark = part if isinstance(part, State) else part.get("digest")
                if mark == self._seen.get((index, table)):
                    continue
                # The loader's own states, sealed by its consumers: no digest to check again.
                found, partly = (part, False) if isinstance(part, State) else _cursor_state(part)
                if found.cursor is not None:
                    moved.append(((index, table), found, mark, partly, part))
                    continue
                self._seen[index, table], self._states[index, table] = mark, None
        if len(moved) != 1:
            raise RuntimeError(f"step {step}: {len(moved)} consumers' states moved on with one batch")
        key, after, mark, partly, part = moved[0]
        before = self._states.get(key)
        if before is not None and before.epoch != after.epoch:
            before = None
        self._seen[key], self._states[key] = mark, after
        lead, self._leads[key] = self._leads.get(key, 0), part.get("lead", 0) if isinstance(part, Mapping) else 0
        if isinstance(self.dataset, TokenBatchDataset):
            rows = encoded(self._budget_rows(self.dataset, after, part["window"]))
        elif isinstance(self.dataset, WindowDataset):
            rows = encoded(self._window_rows(self.dataset, (before, lead), (after, self._leads[key])))
        else:
            rows = self._rows(key[1], before, after, partly)
        self._note(step, after.epoch, rows, skipped, key[1])

    def _budget_rows(self, dataset: TokenBatchDataset, after: State, place: Sequence[int]) -> Ranges:
        """The stored rows of the documents a token-budget step's batch took tokens of: the batch
        before ``place`` (the state's window and the batches of it taken), whose documents the
        window's plan names."""
        window, taken = int(place[0]), int(place[1])
        items, documents = dataset.documents_of(after.shard, window if taken else window - 1, taken - 1)
        _, stream, kept = self._listed(dataset, None, after, lambda: items)
        return stored_ranges(stream, documents if kept is None else kept[documents])

    def _window_rows(
        self, dataset: WindowDataset, before: tuple[State | None, int], after: tuple[State, int]
    ) -> Ranges:
        """The stored rows of the windows a step's batch held: those between the consumer's
        positions (each a state and its lead) ``before`` and ``after``, found among the places of
        its windows (``WindowDataset.places``, found once a work list)."""
        state = after[0]
        _, stream, kept = self._listed(dataset.table, None, state, lambda: dataset.work(state.shard)[0])
        found = self._places.get(state.shard)
        if found is None or found[0] != state.work:
            found = self._places[state.shard] = (state.work, dataset.places(state.shard))
        places = found[1]

        def windows_before(position: tuple[State | None, int]) -> int:
            cursor = None if position[0] is None else position[0].cursor
            return 0 if cursor is None else places.before(stream.place(cursor, kept), position[1])

        starts = places.starts[windows_before(before) : windows_before(after)]
        positions = np.unique((starts[:, None] + np.arange(dataset.windows.size)).ravel())
        return stored_ranges(stream, positions if kept is None else kept[positions])

    def _listed(
        self, dataset: Consumer, table: int | None, after: State, planned: Callable[[], list[WorkItem]]
    ) -> tuple[list[WorkItem], Stream, Positions | None]:
        """The work list of ``after``'s consumer (of mixture table ``table``), which ``planned``
        plans, its stream and, under a filter, the stream positions of the rows it kept (reading
        the filter's columns of its splits once a source): found once a list."""
        found = self._work.get((table, after.shard))
        if found is None or found[0] != after.work:
            items = planned()
            if fingerprint(items) != after.work:
                raise RuntimeError(f"the record found another work list for consumer {tuple(after.shard)} than it read")
            stream = Stream.of(items)
            kept = None
            if dataset.spec.filter is not None:
                source = dataset.source()
                kept = kept_positions(stream, [source.kept(item.split) for item in items])
            found = self._work[table, after.shard] = (after.work, items, stream, kept)
        return found[1], found[2], found[3]

    def note_rows(self, step: int, epoch: int, ranges: Ranges, skipped: bool = False, table: int | None = None) -> None:
        """Note the batch of ``step`` in ``epoch`` by its stored rows ``ranges`` (of mixture table
        ``table``): what a loader that knows its batches' rows (``access="map"``) notes directly."""
        self._note(step, epoch, encoded(ranges), skipped, table)

    def _note(self, step: int, epoch: int, rows: dict[str, Any], skipped: bool, table: int | None) -> None:
        line: dict[str, Any] = {"step": step, "epoch": epoch}
        if table is not None:
            line["table"] = table
        line |= rows
        if skipped:
            line["skipped"] = True
        self._lines.append(json.dumps(line, separators=(",", ":")))

    def _rows(self, table: int | None, before: State | None, after: State, partly: bool) -> dict[str, Any]:
        """What a step's line says of the stored rows one consumer delivered between two of its
        states (of mixture table ``table``): their ranges, or for a consumer that shuffles in
        windows its cursors (see the module); ``partly``: the row ``after`` points at was partly
        delivered too (a packed document, see ``_cursor_state``)."""
        dataset = (
            self.dataset.tables[table] if isinstance(self.dataset, Mixture) and table is not None else self.dataset
        )
        if not isinstance(dataset, TableDataset):
            raise RuntimeError(f"the record of a Mixture found a state outside its tables: {table!r}")
        shard: Shard = after.shard
        # A table of a mixture plans each pass as its own epoch: the state's.
        plan = partial(dataset.work, shard) if table is None else partial(_work_of, dataset, shard, after.epoch)
        items, stream, kept = self._listed(dataset, table, after, plan)
        policy = dataset.policy
        window = 0
        key: tuple[int, ...] = ()
        if isinstance(policy, Shuffled) and policy.buffer_rows:
            window, key = policy.buffer_rows, window_key(policy.seed, after.epoch, shard)
        if after.cursor is None:
            raise RuntimeError(f"consumer {tuple(shard)} delivered a batch but its state has no cursor")
        cursor = after.cursor._replace(skip=after.cursor.skip + 1) if partly else after.cursor
        start = None if before is None else before.cursor
        if not window or kept is not None:
            # A reader has no filter to find kept rows with: a filtered step's line holds its ranges.
            return encoded(rows_between(stream, start, cursor, window, key, kept))
        listed = (table, shard, after.work, key)
        if listed not in self._lists:
            self._lists[listed] = number = len(self._lists)
            list_line = {"list": number, "items": [list(item) for item in items], "window": window, "key": list(key)}
            self._lines.append(json.dumps(list_line, separators=(",", ":")))
        return {"list": self._lists[listed], "from": None if start is None else list(start), "to": list(cursor)}

    def flush(self) -> None:
        """Write the lines noted since the last flush after the rank's record."""
        if self._lines:
            self.files.write("".join(f"{line}\n" for line in self._lines))
            self._lines = []


def _parts(state: Mapping[str, Any] | State) -> list[tuple[int | None, Mapping[str, Any] | State]]:
    """The states of one consumer that its batches move on: its own, or a ``Mixture``'s table
    states (each with its table's index), one for each table whose pass has begun."""
    if isinstance(state, State) or "weights" not in state:
        return [(None, state)]
    return [(table, entry["state"]) for table, entry in enumerate(state["tables"]) if entry["state"] is not None]


def _work_of(table: TableDataset, shard: Shard, epoch: int) -> list[WorkItem]:
    """``shard``'s work list of a mixture's ``table`` in table epoch ``epoch`` (one of its passes)."""
    now = table.epoch
    table.set_epoch(epoch)
    try:
        return table.work(shard)
    finally:
        table.set_epoch(now)


def _cursor_state(state: Mapping[str, Any]) -> tuple[State, bool]:
    """The ``State`` whose cursor a consumer's state dict holds, and whether the row it points
    at was partly delivered: a ``PackedDataset``'s cursor names the document its next block
    starts in, and a token offset says the blocks before took some of it, so a packed step's
    rows are every document its blocks touched."""
    if "budget" in state or "windows" in state:
        return State.from_dict(state["table"], check_digest=False), False
    if "packing" not in state:
        return State.from_dict(state, check_digest=False), False
    return State.from_dict(state["table"], check_digest=False), bool(state["offset"])


def rows(
    record: str | Path, steps: Iterable[int] | None = None, storage_options: StorageOptions | None = None
) -> dict[int, dict[int, list[tuple[int, ...]]]]:
    """Which stored rows each of ``steps`` (every recorded step when ``None``) trained on, by
    rank: ``{step: {rank: [(split, start, end), ...]}}``, from the record folder ``record``; a
    ``Mixture``'s step names its table first, ``(table, split, start, end)`` (the header's
    ``versions`` holds each table's version). A step whose batch was skipped is left out, as is
    one no rank recorded. ``record`` is a folder or an object-store uri (reached with
    ``storage_options`` and the environment)."""
    wanted = None if steps is None else set(steps)
    found: dict[int, dict[int, list[tuple[int, ...]]]] = {}
    for owner, content in read_ranks(str(record), storage_options).items():
        kept: dict[int, list[tuple[int, ...]] | None] = {}
        lists: dict[int, Listed] = {}
        rank = -1
        for number, text in enumerate(content.splitlines(), 1):
            line = json.loads(text)
            if "from_step" in line:
                if line.get("format") != RECORD_FORMAT:
                    raise ValueError(
                        f"{record}, rank {owner}, line {number}: unknown record format {line.get('format')!r}"
                    )
                rank = int(line["rank"])
                kept = {step: ranges for step, ranges in kept.items() if step < line["from_step"]}
                lists = {}
                continue
            if "items" in line:
                lists[int(line["list"])] = Listed.of(line)
                continue
            if line.get("skipped") or (wanted is not None and int(line["step"]) not in wanted):
                kept[int(line["step"])] = None
                continue
            try:
                read: list[tuple[int, ...]] = list(decoded(line, lists))
            except ValueError as error:
                raise ValueError(f"{record}, rank {owner}, line {number}: {error}") from None
            if "table" in line:
                read = [(int(line["table"]), *ranges) for ranges in read]
            kept[int(line["step"])] = read
        for step, trained in kept.items():
            if trained is not None and (wanted is None or step in wanted):
                found.setdefault(step, {})[rank] = trained
    return dict(sorted(found.items()))
