"""Elastic resume: the rows an epoch has not delivered yet, re-planned for other consumers.

A *remainder* is the undelivered rows of every consumer of a saved epoch, as stored-row ranges
in the saved consumers' order. The new consumers share it with ``balanced`` cuts, so a state
saved with W1 ranks of K1 workers continues under W2 ranks of K2 workers with no row lost and
none repeated; the epochs after it plan as usual.

A *lineage* makes the remainder again from the plan alone: the policy and epoch, and for each
re-plan of the epoch (a *link*) the saved topology and where each saved consumer's undelivered
rows began. It holds two ints per saved consumer, whatever the table's size, so a checkpoint
keeps it once and each consumer's state names it by digest (``State.remainder``): a state stays
small after any number of re-plans.

A consumer saved inside a shuffle window (``Shuffled(buffer_rows=...)``) had delivered some of
the window's rows in the window's shuffled order. Its link also holds the window's number and
the rows taken: the window's rows are the next ``buffer_rows`` rows the consumer delivers (its
stored rows, or under a filter the ones it keeps, found through the source's ``kept``), so the
rows taken are found again from the window's order (``shuffle.window_order``) and left out of the
remainder. What a consumer took of its window is a kind's own (``planning.holes.WindowHoles``):
``ShuffleHoles`` for a shuffle window's rows, and a token-budget window's delivered documents for
``TokenBatchDataset``; the lineage names which by ``RowLineage.windows``.

The *share* is the policy the new consumers cut the remainder with: ``balanced`` for rows, and
``stripe`` (whole pieces) for ``WindowDataset``, whose windows span consecutive rows of one piece
and would be lost at a cut inside it. A windowed consumer's first undelivered piece also carries
its *lead*: the rows after the piece's first row at which its next window starts.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from spiral_lightning.core.plan import Plan, Policy, Shard, WorkItem, as_plan, fingerprint
from spiral_lightning.core.state import State
from spiral_lightning.planning.holes import Counted, ShuffleHoles, WindowHoles, Windows, without_taken
from spiral_lightning.planning.lineage import Link, Remainder, RowLineage
from spiral_lightning.planning.lists import Pieces, dealt, plan_all
from spiral_lightning.planning.policies import balanced, policy_name, stripe

#: Saved consumers whose work lists are checked against their states' fingerprints in a re-plan:
#: a policy that changed gives every consumer another list, so a spread sample finds it.
_CHECKED = 64


def replan(
    source: Counted,
    policy: Policy,
    states: Sequence[State],
    earlier: RowLineage | None,
    *,
    filtered: bool,
    share: Policy = balanced,
    leads: Sequence[int] | None = None,
    finished: Collection[Shard] = (),
    holes: WindowHoles | None = None,
    windows: Sequence[tuple[int, int]] | None = None,
) -> tuple[RowLineage, Remainder]:
    """The lineage of the epoch ``states`` were saved in, now re-planned, and its remainder.

    ``states`` holds every consumer of one topology; when they continue an epoch re-planned
    before, they name its lineage, which ``earlier`` must be. ``filtered``: whether the source
    filters rows, so that a cursor's skipped output rows are found by counting and a window's
    rows among the kept ones. ``share`` is the
    policy the consumers of every re-plan cut their remainder with (``balanced``, or ``stripe``
    for whole pieces). ``leads`` gives each state's lead (windows), and ``finished`` the saved
    consumers that delivered their whole list, whatever their cursor says (a ``Mixture``
    consumer whose epoch ended on this table). ``holes`` finds what a consumer took of its window
    (``ShuffleHoles`` of the policy when ``None``), and ``windows`` gives each state's window and
    its progress there when the kind counts them outside the cursor (token budgets)."""
    in_windows = Windows(ShuffleHoles(policy) if holes is None else holes, source, filtered)
    world_size, workers = _check_topology(states)
    first = _check_alike(states, policy)
    links: tuple[Link, ...] = ()
    if earlier is not None and first.remainder is not None and earlier.share != policy_name(share):
        raise ValueError(
            f"the re-plan lineage {earlier.digest} shares its remainder with {earlier.share}, but this dataset shares "
            f"it with {policy_name(share)}; the lineage belongs to another kind of dataset"
        )
    if first.remainder is not None:
        if earlier is None:
            raise ValueError(
                f"the states continue an epoch re-planned before (lineage {first.remainder}); pass the lineage "
                "saved beside them (TableDataset.lineage(), kept once per checkpoint by the DataModule and Ray) "
                "as load_elastic(states, lineage=...)"
            )
        if (earlier.digest, earlier.version, earlier.epoch) != (first.remainder, first.version, first.epoch):
            raise ValueError(
                f"the states name lineage {first.remainder} of version {first.version}, epoch {first.epoch}; "
                f"the lineage given is {earlier.digest} of version {earlier.version}, epoch {earlier.epoch}"
            )
        _check_windows(earlier, in_windows.holes)
        links = earlier.links
    remainder, current = _walk(source, policy, first.epoch, links, share, in_windows)
    grouped, lead = _grouped(current, remainder, world_size, workers, first.epoch)
    link = _link(
        source,
        grouped,
        lead,
        states,
        (world_size, workers),
        filtered=filtered,
        leads=leads,
        finished=finished,
        windows=windows,
    )
    lineage = RowLineage(
        first.version, policy_name(policy), first.epoch, (*links, link), policy_name(share), in_windows.holes.name
    )
    return lineage, _undelivered(grouped, lead, link, in_windows, first.epoch)


def remainder_of(
    source: Counted,
    policy: Policy,
    lineage: RowLineage,
    share: Policy = balanced,
    holes: WindowHoles | None = None,
    *,
    filtered: bool,
) -> Remainder:
    """The remainder ``lineage`` describes: what the consumers of its last re-plan share with
    ``share`` (``holes`` as for ``replan``); ``ValueError`` when it was made for another policy,
    share or kind of window."""
    in_windows = Windows(ShuffleHoles(policy) if holes is None else holes, source, filtered)
    if (lineage.policy, lineage.share) != (policy_name(policy), policy_name(share)):
        raise ValueError(
            f"the re-plan lineage {lineage.digest} is of policy {lineage.policy} shared with {lineage.share}, not "
            f"{policy_name(policy)} shared with {policy_name(share)}; it belongs to another dataset"
        )
    _check_windows(lineage, in_windows.holes)
    return _walk(source, policy, lineage.epoch, lineage.links, share, in_windows)[0]


def _check_windows(lineage: RowLineage, holes: WindowHoles) -> None:
    """``ValueError`` when ``lineage`` was made by a kind whose windows are not ``holes``'."""
    if lineage.windows != holes.name:
        raise ValueError(
            f"the re-plan lineage {lineage.digest} was made for windows {lineage.windows or 'of shuffled rows'!r}, "
            f"but this dataset's are {holes.name or 'of shuffled rows'!r}: it belongs to another dataset, or one of "
            "another token budget or seed"
        )


def share_of(remainder: Remainder, share: Policy, shard: Shard) -> tuple[list[WorkItem], list[int]]:
    """``shard``'s work list of ``remainder`` cut by ``share``, and each item's lead (a ``stripe``
    share deals whole pieces, so an item is a piece and keeps its lead; a cut item has none)."""
    items = share(remainder.plan, shard, 0)
    if share is not stripe:
        return items, [0] * len(items)
    mine = remainder.leads[shard.rank :: shard.world_size][shard.worker :: shard.workers]
    return items, mine.tolist()


def _walk(
    source: Counted,
    policy: Policy,
    epoch: int,
    links: Sequence[Link],
    share: Policy,
    windows: Windows,
) -> tuple[Remainder, Policy]:
    """What the consumers after ``links`` cut their lists from: the plan under ``policy``, or
    the last link's remainder under ``share``."""
    remainder, current = Remainder(as_plan(source.splits), np.zeros(len(source.splits), dtype=np.int64)), policy
    for link in links:
        grouped, lead = _grouped(current, remainder, link.world_size, link.workers, epoch)
        remainder, current = _undelivered(grouped, lead, link, windows, epoch), share
    return remainder, current


def _grouped(
    current: Policy, remainder: Remainder, world_size: int, workers: int, epoch: int
) -> tuple[Pieces, np.ndarray]:
    """Every consumer's list of ``remainder`` under ``current``, grouped by owner, and each
    item's lead: a piece's own under ``stripe``, which deals whole pieces, else none."""
    lists = plan_all(current, remainder.plan, world_size, workers, epoch)
    if current is stripe:
        lead = remainder.leads[dealt(len(remainder.plan), world_size, workers)[0]]
    else:
        lead = np.zeros(lists.owner.size, dtype=np.int64)
    if bool(np.all(lists.owner[1:] >= lists.owner[:-1])):
        # Already grouped, as plan_all lists most policies' items: a copy of every column would
        # cost more than the check (at 10^6 splits, 12.7 M blocks: 400 MB of fresh memory).
        return lists, lead
    order = np.argsort(lists.owner, kind="stable")
    return lists.take(order), lead[order]


def _starts(lists: Pieces, consumers: int) -> tuple[np.ndarray, np.ndarray]:
    """Each consumer's item count and the index of its first item in ``lists`` grouped by owner."""
    counts = np.bincount(lists.owner, minlength=consumers)
    return counts, np.cumsum(counts) - counts


def _undelivered(lists: Pieces, lead: np.ndarray, link: Link, windows: Windows, epoch: int) -> Remainder:
    """The rows of ``lists`` (grouped by owner, each item with its ``lead``) that ``link``'s
    positions had not reached, in consumer order, as stored ranges with their leads, each
    consumer's first with the link's; the rows a consumer took from its window (``windows``, in
    ``epoch``) are left out too."""
    counts, first = _starts(lists, link.world_size * link.workers)
    # Each consumer's undelivered items are one run of its grouped list, from item ``items[c]``:
    # marked by a running sum of +1 at each run's first item and -1 after its last.
    begin = first + np.minimum(link.items, counts)
    marks = np.zeros(lists.owner.size + 1, dtype=np.int32)
    np.add.at(marks, begin, 1)
    np.add.at(marks, first + counts, -1)
    kept = np.cumsum(marks[:-1]) > 0
    start = lists.start.copy()
    leads = lead.copy()
    resumed = begin[link.items < counts]
    start[resumed] = link.rows[link.items < counts]
    leads[resumed] = link.leads[link.items < counts]
    kept[resumed] &= start[resumed] < lists.end[resumed]
    rest = Pieces(lists.split[kept], start[kept], lists.end[kept], lists.owner[kept])
    if link.inside_windows:
        # Leads are WindowDataset's, which reads its lists unshuffled: a link has leads or windows, never both.
        rest = without_taken(rest, link, windows, epoch)
        return Remainder(Plan.of(rest.split, rest.start, rest.end), np.zeros(rest.split.size, dtype=np.int64))
    return Remainder(Plan.of(rest.split, rest.start, rest.end), leads[kept])


def _link(
    source: Counted,
    lists: Pieces,
    lead_of: np.ndarray,
    states: Sequence[State],
    topology: tuple[int, int],
    *,
    filtered: bool,
    leads: Sequence[int] | None,
    finished: Collection[Shard],
    windows: Sequence[tuple[int, int]] | None,
) -> Link:
    """Where each saved consumer of ``topology`` (world size, workers) begins its undelivered
    rows in its list of ``lists``, with its lead from ``leads`` (by state), or its first item's
    (``lead_of``, by item) before it read, and its window and progress there from ``windows`` (by
    state), else its cursor's; a consumer of ``finished`` has none left."""
    world_size, workers = topology
    consumers = world_size * workers
    counts, first = _starts(lists, consumers)
    items = np.zeros(consumers, dtype=np.int64)
    rows = np.zeros(consumers, dtype=np.int64)
    found_windows = np.zeros(consumers, dtype=np.int64)
    taken = np.zeros(consumers, dtype=np.int64)
    lead = np.zeros(consumers, dtype=np.int64)
    checked = set(np.linspace(0, consumers - 1, min(consumers, _CHECKED)).round().astype(int).tolist())
    for number, state in enumerate(states):
        consumer = state.shard.rank * workers + state.shard.worker
        mine = slice(int(first[consumer]), int(first[consumer] + counts[consumer]))
        cursor = state.cursor
        if state.shard in finished:
            items[consumer] = counts[consumer]
            continue
        if cursor is None:
            rows[consumer] = lists.start[mine.start] if counts[consumer] else 0
            lead[consumer] = lead_of[mine.start] if counts[consumer] else 0
            continue
        if (
            consumer in checked
            and state.work is not None
            and fingerprint(lists.take(np.r_[mine]).items()) != state.work
        ):
            raise ValueError(
                f"consumer {tuple(state.shard)}'s work list differs from the one its state was saved with; "
                "the policy must depend only on the plan, the shard and the epoch, and the table version "
                "and library must be the ones that saved it"
            )
        items[consumer] = cursor.item
        lead[consumer] = 0 if leads is None else leads[number]
        window, progress = (cursor.window, cursor.taken) if windows is None else windows[number]
        if progress:
            found_windows[consumer], taken[consumer] = window, progress
        if cursor.item >= counts[consumer]:
            continue
        index = mine.start + cursor.item
        split, start, end = int(lists.split[index]), int(lists.start[index]), int(lists.end[index])
        if not start <= cursor.row <= end:
            raise ValueError(
                f"consumer {tuple(state.shard)}'s cursor {tuple(cursor)} points outside stored rows {start}..{end} "
                f"of split {split}; the state was edited or damaged"
            )
        rows[consumer] = (
            _first_undelivered(source, WorkItem(split, cursor.row, end), cursor.skip)
            if filtered
            else min(cursor.row + cursor.skip, end)
        )
    return Link(world_size, workers, items, rows, found_windows, taken, lead)


def _first_undelivered(source: Counted, item: WorkItem, skip: int) -> int:
    """The stored row of ``item`` just after its first ``skip`` rows that pass the filter: the
    least ``end`` whose range from ``item.start`` holds ``skip`` of them (a binary search on
    counts, which read only the filter's columns)."""
    if skip == 0:
        return item.start
    low, high = item.start + skip, item.end
    while low < high:
        middle = (low + high) // 2
        if source.count([WorkItem(item.split, item.start, middle)])[0] >= skip:
            high = middle
        else:
            low = middle + 1
    return low


def _check_topology(states: Sequence[State]) -> tuple[int, int]:
    """The world size and worker count of ``states``: every consumer of one topology, once."""
    if not states:
        raise ValueError("an elastic resume needs the states of every consumer of the saved epoch, and got none")
    world_size, workers = states[0].shard.world_size, states[0].shard.workers
    given = [state.shard for state in states]
    if (
        len(given) != world_size * workers
        or len(set(given)) != len(given)
        or any((shard.world_size, shard.workers) != (world_size, workers) for shard in given)
    ):
        expected = {Shard(rank, world_size, worker, workers) for rank in range(world_size) for worker in range(workers)}
        missing = sorted(expected - set(given))
        raise ValueError(
            f"an elastic resume needs each of the {len(expected)} consumers of the saved {world_size} ranks x "
            f"{workers} workers once; got {len(given)} states (missing {missing[:8]}"
            f"{'...' if len(missing) > 8 else ''})"
        )
    return world_size, workers


def _check_alike(states: Sequence[State], policy: Policy) -> State:
    """The first of ``states``, once all are of one epoch of one version, policy and lineage."""
    first = states[0]
    for state in states:
        differ = [
            name for name in ("version", "epoch", "policy", "remainder") if getattr(state, name) != getattr(first, name)
        ]
        if differ:
            raise ValueError(f"the saved states of {first.shard} and {state.shard} differ in {differ}")
    if first.policy != policy_name(policy):
        raise ValueError(f"the states were saved with policy {first.policy}, not {policy_name(policy)}")
    return first
