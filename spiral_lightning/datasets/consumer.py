"""The consumer core that every dataset kind builds on.

A ``Consumer`` is one pinned table version read by the consumers of a job. It owns what every
kind needs alike: the consumer this process is (rank and world size, and the DataLoader worker
when in one), the source opened once in each process that reads, the reader (read ahead on a
thread or not), the epoch and the quota shared with running workers, the work list (the
policy's, or this consumer's share of a re-planned remainder), the lineage of that re-plan, and
the checks a resumed state passes before a pass continues it. A kind adds its own iteration,
state and counts on top, and reaches the core only through the methods below.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Collection, Mapping, Sequence
from functools import partial
from typing import Any, ClassVar

import torch.distributed
from torch.utils.data import get_worker_info

from spiral_lightning.core.checks import check_count, check_positive
from spiral_lightning.core.integrity import damaged
from spiral_lightning.core.plan import Plan, Policy, Shard, WorkItem, fingerprint
from spiral_lightning.core.spec import TableSpec, as_spec, with_selection
from spiral_lightning.core.state import Cursor, State, check_cursor
from spiral_lightning.datasets.job import distributed
from spiral_lightning.planning.elastic import remainder_of
from spiral_lightning.planning.elastic import replan as replan_epoch
from spiral_lightning.planning.holes import WindowHoles
from spiral_lightning.planning.lineage import RowLineage, check_lineage
from spiral_lightning.planning.lists import every_shard
from spiral_lightning.planning.policies import Shuffled, as_policy, balanced, policy_name, shuffle_for
from spiral_lightning.reading.ahead import ReadAhead, default_read_threads
from spiral_lightning.reading.watchdog import watch
from spiral_lightning.sources import Reader, Source, open_source

#: Read batches read ahead of a consumer by default.
DEFAULT_READ_AHEAD = 2

#: The counters a consumer keeps (see ``Consumer.tally``): rows skipped for media that do not
#: decode, and tokens a packed stream's tail dropped.
SKIPPED, DROPPED = 0, 1

#: DataLoader workers of a rank whose counters are kept apart: worker ``k`` counts in slot
#: ``1 + k % TALLY_WORKERS`` of the shared counters, the main process in slot 0.
TALLY_WORKERS = 255


def check_read_ahead(read_ahead: int) -> None:
    """``ValueError`` unless ``read_ahead`` is a read-ahead depth: a non-negative int."""
    check_count("read_ahead", read_ahead, "0 reads in line")


def check_read_threads(read_threads: int | None) -> None:
    """``ValueError`` unless ``read_threads`` is a count of reading threads or ``None``."""
    if read_threads is not None:
        check_positive("read_threads", read_threads, "or None")


class Consumer:
    """One pinned table version read by a job's consumers, each its own work list.

    ``spec`` (a spec or a uri, reached with ``storage_options``, reading ``columns`` and the rows
    ``filter`` keeps, as a ``TableSpec`` of them would) is pinned here; ``policy`` (a
    function or its name) deals work lists; rank and world size come from the arguments, else
    from ``torch.distributed`` when it is initialized, else 0 and 1; ``read_ahead`` read batches
    are read ahead of each of ``read_threads`` work items read at once, each on a thread (``None``:
    from the cores). The source opens here, so a bad column or filter fails in the
    process that builds the dataset, and again once in each process that reads.

        core = Consumer("parquet:data/events", policy="balanced", rank=0, world_size=2)
        items = core.work()  # this consumer's work list in core.epoch
        batches = core.reader().read(items)
    """

    #: Whether ``shuffle=True`` also shuffles rows within windows (see ``shuffle_for``): not for
    #: a kind whose items keep their rows in stored order, such as packed documents.
    SHUFFLES_WINDOWS: ClassVar[bool] = True
    #: Whether a DataLoader worker puts each batch in shared memory as it yields it (``transfer.handed_on``);
    #: a ``groups.Grouped`` reader turns it off to put a group of batches in one block.
    hands_on: bool = True
    #: Whether the package's loaders have workers send this kind's batches in groups
    #: (``groups.group_size``, of its ``batch_size`` rows or its ``GROUP_BATCHES`` batches).
    GROUPS: ClassVar[bool] = True

    def __init__(
        self,
        spec: TableSpec | str,
        *,
        policy: Policy | str | None = None,
        shuffle: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        read_ahead: int = DEFAULT_READ_AHEAD,
        read_threads: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        columns: Sequence[str] | None = None,
        filter: Any = None,
    ) -> None:
        check_read_ahead(read_ahead)
        check_read_threads(read_threads)
        if (rank is None) != (world_size is None):
            raise ValueError("pass rank and world_size together, or neither")
        if rank is None and distributed():
            rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.rank = 0 if rank is None else rank
        self.world_size = 1 if world_size is None else world_size
        Shard(self.rank, self.world_size).check()
        self.spec = with_selection(as_spec(spec, storage_options), columns, filter).resolve()
        #: The exact version ``spec`` names, computed once: every batch's state records it.
        self.version = self.spec.version
        check_count("seed", seed)
        if shuffle and policy is not None:
            raise ValueError(
                f"shuffle=True chooses the policy (a Shuffled sized for the table), so it cannot be given with "
                f"policy={policy!r}; pass one of them"
            )
        self.read_ahead = read_ahead
        self.read_threads = read_threads
        # The epoch and the quota (-1 for none). A worker's pickled copy shares this tensor's
        # memory (torch pickles tensors for worker processes by handle), so settings made here
        # after the workers started still reach them.
        self._settings = torch.tensor([0, -1], dtype=torch.int64)
        self._share_settings = True
        # Each consumer's counters, in shared memory like the settings, so that the main process
        # reads what its DataLoader workers counted.
        self._tallies = torch.zeros((1 + TALLY_WORKERS, 2), dtype=torch.int64)
        # The re-planned epochs: each one's remainder and lineage (a Mixture's table can hold one
        # for each pass its saved consumers were in).
        self._replans: dict[int, tuple[Plan, RowLineage]] = {}
        self._source: Source | None = None
        self._source_pid: int | None = None
        self._ahead: ReadAhead | None = None
        self._owner_pid: int | None = None
        self._shares_checked = False
        self.policy: Policy
        if shuffle:
            self.policy = shuffle_for(
                self.source().splits.total, seed, media=bool(self.spec.media), windows=self.SHUFFLES_WINDOWS
            )
        else:
            self.policy = as_policy(balanced if policy is None else policy, seed)

    def set_epoch(self, epoch: int) -> None:
        """Read ``epoch``'s work lists from now on (epoch-dependent policies change order)."""
        check_count("epoch", epoch)
        if epoch != self.epoch:
            if get_worker_info() is None:
                # The counters are the epoch's; a worker (a Mixture's table changing pass) keeps
                # the others'.
                self._tallies.zero_()
            self._on_new_epoch()
        self._settings[0] = epoch

    def _on_new_epoch(self) -> None:
        """What a kind forgets when its epoch changes (its position); nothing here."""

    def tally(self, counter: int) -> int:
        """Counter ``counter`` (``SKIPPED`` or ``DROPPED``) in this epoch: in a DataLoader worker,
        its own; in the main process, the sum over it and every worker of this rank, so it reads
        the same whatever the worker count."""
        if get_worker_info() is not None:
            return self.own_tally(counter)
        return int(self._tallies[:, counter].sum())

    def own_tally(self, counter: int) -> int:
        """Counter ``counter`` of this process's consumer alone, which its state records."""
        return int(self._tallies.numpy()[_tally_slot(), counter])

    def set_tally(self, counter: int, value: int) -> None:
        """Set this process's consumer's counter ``counter`` to ``value``."""
        self._tallies[_tally_slot(), counter] = value

    def set_rows_per_consumer(self, rows: int | None) -> None:
        """Stop every consumer after ``rows`` rows from now on (no quota when ``None``)."""
        if rows is not None:
            check_count("rows_per_consumer", rows, "or None")
            self._check_quota(rows)
        self._settings[1] = -1 if rows is None else rows

    def _check_quota(self, rows: int) -> None:
        """A kind's own refusal of a quota of ``rows`` (a count already); none here."""

    def replan(self, remainder: Plan, epoch: int, lineage: RowLineage, *, keep: bool = False) -> None:
        """Read ``remainder`` (a re-planned epoch's undelivered rows) in ``epoch``, shared with
        ``balanced`` cuts, and name it by ``lineage`` in states. ``keep`` keeps the re-plans of
        other epochs (a ``Mixture``'s table re-planned in several passes); else they are dropped."""
        if not keep:
            self._replans.clear()
        self._replans[epoch] = (remainder, lineage)

    def drop_replan(self) -> None:
        """Plan the current epoch with the policy again (a state saved outside any re-plan)."""
        self._replans.pop(self.epoch, None)

    def check_lineage(self, kind: str, saved: State) -> None:
        """``ValueError`` unless ``saved`` names the re-plan this consumer reads in its epoch, or
        none when it reads none (see ``planning.lineage.check_lineage``)."""
        replan = self._replans.get(saved.epoch)
        check_lineage(kind, saved, None if replan is None else replan[1], saved.epoch)

    def lineage_digest(self) -> str | None:
        """The digest of the re-plan this epoch continues, which states record; ``None`` outside one."""
        replan = self._replans.get(self.epoch)
        return None if replan is None else replan[1].digest

    def check_resume(self, kind: str, saved: State, shard: Shard, work: str, items: Sequence[WorkItem]) -> Cursor:
        """The cursor a pass continues ``saved`` from, after checking that it points into this
        consumer's work list (``work`` is its fingerprint), naming ``kind`` in the error."""
        if saved.work != work:
            raise ValueError(
                f"the policy {policy_name(self.policy)} gives {kind} consumer {tuple(shard)} another work list in "
                f"epoch {self.epoch} (fingerprint {work}) than the state was saved with ({saved.work}); "
                "the policy must depend only on the plan, the shard and the epoch, and a state saved mid-epoch "
                "by an earlier spiral-lightning whose policy dealt otherwise (Shuffled before its block order "
                "became a Feistel bijection) resumes only with that version"
            )
        assert saved.cursor is not None
        check_cursor(saved.cursor, items)
        return saved.cursor

    def check_loaded(
        self, kind: str, saved: State, items: Sequence[WorkItem], *, windows: bool, rows: bool, paired: bool = True
    ) -> None:
        """What ``load_state_dict`` checks before any row is read, once ``saved``'s settings match
        this consumer's: ``ValueError`` naming the field unless its cursor points into ``items``
        (this consumer's work list in the saved epoch, see ``check_resume``), inside a shuffle
        window of the policy's (``windows``: the kind shuffles windows), its ``delivered`` within
        the list's stored rows (``rows``: it counts rows), and, with ``paired`` (a kind that sets
        its cursor and work list together), a cursor whenever it names a work list; then
        ``ValueError`` when its fields no longer match its digest (see ``core.integrity``)."""
        try:
            self._check_ranges(kind, saved, items, windows=windows, rows=rows, paired=paired)
        except ValueError as error:
            if not saved.intact:
                raise damaged(kind, saved.where(), str(error)) from None
            raise ValueError(f"the {kind} state of consumer ({saved.where()}): {error}") from None
        saved.check_intact(kind)

    def _check_ranges(
        self, kind: str, saved: State, items: Sequence[WorkItem], *, windows: bool, rows: bool, paired: bool
    ) -> None:
        cursor = saved.cursor
        if cursor is None and paired and saved.work is not None:
            raise ValueError(f"it names work list {saved.work} but its cursor is None; it was edited or damaged")
        if cursor is None:
            return
        self.check_resume(kind, saved, saved.shard, fingerprint(items), items)
        size = self.policy.buffer_rows if windows and isinstance(self.policy, Shuffled) else 0
        if cursor.taken >= max(size, 1) or (not size and cursor.window):
            raise ValueError(
                f"its cursor {tuple(cursor)} is in window {cursor.window} with {cursor.taken} rows taken, but the "
                f"policy's shuffle windows hold {size} rows; it was edited or damaged"
            )
        stored = sum(item.end - item.start for item in items)
        if rows and saved.delivered > stored:
            raise ValueError(
                f"it says it delivered {saved.delivered} rows, but its work list holds {stored}; it was edited or "
                "damaged"
            )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self._share_settings:
            # In place, once: the copies pickled for workers then share the settings.
            self._settings.share_memory_()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        else:
            state["_settings"] = self._settings.tolist()
        # Every worker counts in its own slot, so the counters are shared even when the settings are not.
        self._tallies.share_memory_()  # type: ignore[no-untyped-call]
        state["_source"] = None
        state["_source_pid"] = None
        state["_ahead"] = None
        # The process that pickles a dataset for its workers is the one they must not outlive.
        state["_owner_pid"] = os.getpid()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if not isinstance(self._settings, torch.Tensor):
            self._settings = torch.tensor(self._settings, dtype=torch.int64)

    def keep_settings_private(self) -> None:
        """Pickle the epoch and quota by value from now on, for an owner that sets them in each
        consumer (a ``Mixture`` moves each consumer's tables through their passes separately)."""
        self._share_settings = False

    @property
    def epoch(self) -> int:
        """The epoch whose work lists this dataset reads (see ``set_epoch``)."""
        # tolist: a fifth of the time of indexing a tensor, and this is read for every batch's state.
        return int(self._settings.tolist()[0])

    @property
    def rows_per_consumer(self) -> int | None:
        """Each consumer's quota of rows, ``None`` for none (see ``set_rows_per_consumer``)."""
        rows = int(self._settings.tolist()[1])
        return None if rows < 0 else rows

    def source(self) -> Source:
        """The table version opened in this process (opened on first use)."""
        pid = os.getpid()
        if self._source is None or self._source_pid != pid:
            self._source = open_source(self.spec)
            self._source_pid = pid
        return self._source

    def reader(self) -> Reader:
        """What this process reads rows through: with ``read_ahead``, threads that read that many
        read batches ahead of each of ``read_threads`` work items read at once (by default, as
        many as the cores this process gets beside the other DataLoader workers, at most
        ``MOST_READ_THREADS``, and 1 for a source that fetches ahead itself) through this
        process's source; else the source itself."""
        source = self.source()
        if not self.read_ahead:
            return source
        if self.read_threads is not None:
            threads = self.read_threads
        elif getattr(source, "fetches_ahead", False):
            threads = 1
        else:
            threads = default_read_threads()
        ahead = self._ahead
        if ahead is None or ahead.source is not source or (ahead.depth, ahead.threads) != (self.read_ahead, threads):
            ahead = self._ahead = ReadAhead(source, self.read_ahead, threads, partial(open_source, self.spec))
        return ahead

    def shard(self) -> Shard:
        """This process's consumer: this rank, and the DataLoader worker when in one."""
        info = get_worker_info()
        if info is None:
            return Shard(self.rank, self.world_size)
        return Shard(self.rank, self.world_size, info.id, info.num_workers)

    def work(self, shard: Shard | None = None) -> list[WorkItem]:
        """The work list of ``shard`` (this process's consumer) in this epoch: the policy's, or
        its share of a remainder that ``load_elastic`` re-planned."""
        shard = shard or self.shard()
        remainder = self.replanned()
        if remainder is not None:
            return balanced(remainder, shard)
        return self.policy(self.source().splits, shard, self.epoch)

    def replanned(self) -> Plan | None:
        """The remainder ``load_elastic`` re-planned, while its epoch lasts. A persistent worker's
        copy keeps it after the epoch moves on, which it learns only through the shared epoch."""
        replan = self._replans.get(self.epoch)
        return None if replan is None else replan[0]

    def load_lineage(self, lineage: Mapping[str, Any], *, keep: bool = False) -> None:
        """Read, in its epoch, the remainder ``lineage`` (a ``lineage()``) describes, as the
        consumers of its last re-plan do, so that their states, which name it, restore with
        ``load_state_dict`` under the same topology; ``keep`` as for ``replan``."""
        found = RowLineage.from_dict(lineage)
        if found.version != self.spec.version:
            raise ValueError(f"the re-plan lineage is of version {found.version}, not {self.spec.version}")
        filtered = self.spec.filter is not None
        remainder = remainder_of(self.source(), self.policy, found, holes=self.window_holes(), filtered=filtered)
        self.replan(remainder.plan, found.epoch, found, keep=keep)

    def replan_saved(
        self,
        saved: Sequence[State],
        lineage: Mapping[str, Any] | None,
        *,
        keep: bool = False,
        finished: Collection[Shard] = (),
        windows: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """Read in their epoch what every consumer of another topology (``saved``, table states;
        ``lineage``, saved beside states of an epoch re-planned before) had not delivered, from the
        start (``planning.elastic.replan`` takes ``finished``, ``windows``); ``keep`` as for ``replan``."""
        if saved and saved[0].version != self.spec.version:
            raise ValueError(f"the states were saved reading version {saved[0].version}, not {self.spec.version}")
        earlier = None if lineage is None else RowLineage.from_dict(lineage)
        source, filtered, holes = self.source(), self.spec.filter is not None, self.window_holes()
        found, remainder = replan_epoch(
            source, self.policy, saved, earlier, filtered=filtered, finished=finished, holes=holes, windows=windows
        )
        self.set_epoch(saved[0].epoch)
        self.replan(remainder.plan, saved[0].epoch, found, keep=keep)
        self._on_new_epoch()

    def window_holes(self) -> WindowHoles | None:
        """What a consumer of this kind saved inside one of its windows had delivered of it, for
        a re-plan (see ``planning.holes.WindowHoles``); ``None``: shuffle windows of rows."""
        return None

    def lineage(self) -> dict[str, Any] | None:
        """While this epoch continues a re-plan, what makes its remainder again (see
        ``spiral_lightning.planning.elastic``), as plain values: save it once beside every consumer's
        ``state_dict``, which names it by digest, and give it to ``load_elastic`` to re-plan
        again. ``None`` in an epoch planned as usual."""
        replan = self._replans.get(self.epoch)
        return None if replan is None else replan[1].to_dict()

    def check_shares(self, workers: int) -> None:
        """Warn, once, when one of this rank's consumers (with ``workers`` DataLoader workers a
        rank, 0 reading in the main process) is dealt no stored rows, or under half the mean of
        the job's consumers: the others then wait on it, or sit idle while it reads everything
        (``stripe`` on a table of one split gives one worker the whole table). Counts stored
        rows from the plan alone, so it reads nothing."""
        if self._shares_checked or self.replanned() is not None:
            return
        self._shares_checked = True
        plan = self.source().splits
        if not plan.total:
            return
        workers = max(1, workers)
        mean = plan.total / (self.world_size * workers)
        for shard in every_shard(self.world_size, workers, range(self.rank, self.rank + 1)):
            rows = sum(item.end - item.start for item in self.policy(plan, shard, self.epoch))
            if rows == 0 or rows < mean / 2:
                warnings.warn(
                    f"the policy {policy_name(self.policy)} deals consumer (rank {shard.rank}, worker {shard.worker}) "
                    f"{rows} of the {plan.total} stored rows of {self.spec.uri} in epoch {self.epoch}, under half "
                    f"the mean of {self.world_size * workers} consumers ({mean:.0f}), so the others wait on it or "
                    f"it on them; the default policy 'balanced' deals equal shares, and a table of fewer rows than "
                    "consumers leaves some idle whatever the policy",
                    stacklevel=3,
                )
                return

    def begin(self) -> tuple[Shard, list[WorkItem], str]:
        """A pass's consumer, its work list and the list's fingerprint; in a DataLoader worker the
        pass also starts watching the process that owns the worker."""
        if self._owner_pid is not None and get_worker_info() is not None:
            watch(self._owner_pid)
        shard = self.shard()
        # A pass in the main process replaces the workers' counts of the epoch, and theirs its.
        if get_worker_info() is None:
            self._tallies[1:] = 0
            self.check_shares(0)
        else:
            self._tallies[0] = 0
        items = self.work(shard)
        return shard, items, fingerprint(items)


def _tally_slot() -> int:
    """The slot of the shared counters this process's consumer counts in."""
    info = get_worker_info()
    return 0 if info is None else 1 + info.id % TALLY_WORKERS
