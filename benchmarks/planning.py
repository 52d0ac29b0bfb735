"""What planning costs at scale: one consumer's work list, the counts a rank needs per epoch, an
elastic re-plan and the states it leaves, for ``stripe``, ``balanced`` and ``Shuffled()``.

Run ``.venv/bin/python benchmarks/planning.py`` (a few minutes on 2 cores; ``--splits 10000
100000 --ranks 8 64`` for a quick look). The plans are synthetic (a ``Plan`` of splits of 50,000
to 150,000 stored rows, so ``Shuffled()``'s 8,192-row blocks number about 12.7 a split) and no
table is read: only planning is timed. A table adds its source's costs: opening it (the plan's
columns are built once per process, timed as *plan columns*, and held by every process that
reads, each DataLoader worker included: *plan held*) and, under a filter, counting the rows each
unit keeps once per job, a ``1/world_size`` share per rank (``count_shared``).

- *one consumer's list*: ``policy(plan, shard, epoch=1)`` for the last worker of the last rank,
  what every DataLoader worker computes at start and, for ``Shuffled``, every epoch;
- *counts, first epoch*: every consumer's rows at once from the units' stored rows
  (``stored_rows``, then ``consumer_rows``), what ``TableDataset.even_rows`` and ``batches`` compute once per job;
  *later epoch*: ``consumer_rows`` alone (units are kept), with its peak memory (``tracemalloc``);
- *re-plan*: ``replan`` of every consumer's mid-epoch state saved by the ranks x 16 workers onto
  half the ranks, then one new consumer's share; *state*: the bytes of one consumer's saved state
  after the re-plan (its pickle) and of every consumer's state with the lineage once, as
  ``torch.save`` writes them: the data a DataModule checkpoint holds for all consumers, less
  ``StatefulDataLoader``'s own few fields per worker.

The growth exponent is the least-squares slope of log time over log splits (at the most ranks)
and over log ranks (at the most splits): 1 is linear, 0 flat. Targets at 10^6 splits and 4,096
ranks x 16 workers (issue 19): one list < 0.1 s, counts < 2 s, a re-plan of 65,536 states onto
2,048 x 16 < 5 s, a consumer's state <= 1 KB, the checkpoint's data state < 64 MB.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import pickle
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from spiral_lightning import Shard, Shuffled, Split, balanced, stripe
from spiral_lightning.core.plan import Plan, Policy, WorkItem, fingerprint
from spiral_lightning.core.state import Cursor, State
from spiral_lightning.planning.elastic import replan
from spiral_lightning.planning.lists import consumer_rows, plan_all, stored_rows
from spiral_lightning.planning.policies import policy_name

POLICIES: dict[str, Policy] = {"stripe": stripe, "balanced": balanced, "Shuffled()": Shuffled(seed=1)}
WORKERS = 16


class PlanOnly:
    """A stand-in source that is only a plan: ``replan`` of unfiltered states reads nothing else."""

    def __init__(self, plan: Plan) -> None:
        self.splits = plan


def synthetic_plan(splits: int) -> Plan:
    """``splits`` splits of 50,000 to 150,000 stored rows, numbered in stored order."""
    sizes = np.random.default_rng(0).integers(50_000, 150_001, splits).tolist()
    return Plan(Split(index, 0, size, size) for index, size in enumerate(sizes))


def seconds(work: Callable[[], object], repeats: int) -> float:
    """The median time of one call of ``work`` over ``repeats`` runs; a call under 20 ms is
    repeated until 20 ms have passed, so that quick calls are not timer noise."""
    times = []
    for _ in range(repeats):
        calls, start = 0, time.perf_counter()
        while True:
            work()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= 0.02:
                break
        times.append(elapsed / calls)
    return statistics.median(times)


def peak_bytes(work: Callable[[], object]) -> int:
    tracemalloc.start()
    work()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def held_bytes(make: Callable[[], object]) -> int:
    """The bytes still allocated once ``make()`` has returned, its result kept."""
    tracemalloc.start()
    kept = make()
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del kept
    return held


def saved_states(policy: Policy, plan: Plan, world_size: int, epoch: int) -> list[State]:
    """Every consumer's state half-way through its list, as a stop mid-epoch leaves them."""
    lists = plan_all(policy, plan, world_size, WORKERS, epoch)
    counts = np.bincount(lists.owner, minlength=world_size * WORKERS)
    firsts = np.cumsum(counts) - counts
    consumers = world_size * WORKERS
    sampled = set(np.linspace(0, consumers - 1, min(consumers, 64)).round().astype(int).tolist())
    states = []
    for consumer, (count, first) in enumerate(zip(counts.tolist(), firsts.tolist(), strict=True)):
        item = count // 2
        index = first + item
        cursor = Cursor(item, int(lists.start[index] + lists.end[index]) // 2) if item < count else Cursor(count, 0)
        # replan checks the fingerprints of a spread sample of 64 consumers (a state without one is
        # not checked), so only those are computed: all of them would build every work item.
        work = fingerprint(lists.take(np.arange(first, first + count)).items()) if consumer in sampled else None
        states.append(
            State(
                version="v",
                shard=Shard(consumer // WORKERS, world_size, consumer % WORKERS, WORKERS),
                batch_size=256,
                epoch=epoch,
                policy=policy_name(policy),
                work=work,
                cursor=cursor,
            )
        )
    return states


def saved_bytes(value: Any) -> int:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.tell()


def exponent(xs: Sequence[float], ys: Sequence[float]) -> str:
    if len(xs) < 2 or min(ys) <= 0:
        return "n/a"
    return f"{np.polyfit(np.log(xs), np.log(ys), 1)[0]:.2f}"


def measure(plan: Plan, ranks: int, policy: Policy, repeats: int) -> dict[str, float]:
    shard = Shard(ranks - 1, ranks, WORKERS - 1, WORKERS)

    def first_epoch() -> np.ndarray:
        return consumer_rows(policy, plan, stored_rows(policy, plan, ranks, WORKERS), ranks, WORKERS, 1)

    stored = stored_rows(policy, plan, ranks, WORKERS)
    return {
        "list": seconds(lambda: policy(plan, shard, 1), repeats),
        "first": seconds(first_epoch, repeats),
        "later": seconds(lambda: consumer_rows(policy, plan, stored, ranks, WORKERS, 2), repeats),
        "memory": peak_bytes(lambda: consumer_rows(policy, plan, stored, ranks, WORKERS, 2)) / 2**20,
    }


def measure_replan(plan: Plan, ranks: int, policy: Policy) -> dict[str, float]:
    states = saved_states(policy, plan, ranks, epoch=1)
    source: Any = PlanOnly(plan)
    start = time.perf_counter()
    lineage, remainder = replan(source, policy, states, None, filtered=False)
    share = balanced(remainder.plan, Shard(ranks // 2 - 1, max(1, ranks // 2), WORKERS - 1, WORKERS))
    elapsed = time.perf_counter() - start
    assert share, "the last new consumer's share is empty"
    after = [dataclasses.replace(state, remainder=lineage.digest) for state in states]
    # A state's share of a checkpoint: its pickle (torch.save adds a zip container per file, not per state).
    one = max(len(pickle.dumps(state.to_dict())) for state in after[:: max(1, len(after) // 64)])
    checkpoint = {"ranks": [state.to_dict() for state in after], "lineage": lineage.to_dict()}
    return {"replan": elapsed, "state": one, "checkpoint": saved_bytes(checkpoint) / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--splits", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    splits, ranks = sorted(args.splits), sorted(args.ranks)
    results: dict[tuple[str, int, int], dict[str, float]] = {}
    plan = synthetic_plan(splits[-1])
    raw = list(plan)
    columns = seconds(lambda: Plan(raw), 1)
    held = held_bytes(lambda: synthetic_plan(splits[-1]))
    items = [WorkItem(split.id, split.start, split.end) for split in raw]
    digest = seconds(lambda: fingerprint(items), 1)

    for count in splits:
        plan = synthetic_plan(count)
        for world in ranks:
            for name, policy in POLICIES.items():
                results[(name, count, world)] = measure(plan, world, policy, args.repeats)
                if world == ranks[-1]:
                    results[(name, count, world)] |= measure_replan(plan, world, policy)

    top, big = ranks[-1], splits[-1]
    print(f"## Planning at {big:,} splits and {top:,} ranks x {WORKERS} workers\n")
    print("| measure | seconds or size | target | of the target | met |")
    print("| --- | --- | --- | ---: | --- |")
    checks: list[tuple[str, float, float, str]] = []
    for name in POLICIES:
        row = results[(name, big, top)]
        checks += [
            (f"one consumer's list: {name}", row["list"], 0.1, "s"),
            (f"counts, first epoch: {name}", row["first"], 2.0, "s"),
            (f"counts, later epoch: {name}", row["later"], 2.0, "s"),
            (f"re-plan onto {top // 2:,} x {WORKERS}: {name}", row["replan"], 5.0, "s"),
            (f"one consumer's state after the re-plan: {name}", row["state"], 1024, "B"),
            (f"every consumer's state and the lineage: {name}", row["checkpoint"], 64, "MB"),
        ]
    for label, value, target, unit in checks:
        shown = f"{value:.4f} {unit}" if unit == "s" else f"{value:,.1f} {unit}"
        met = "yes" if value <= target else "NO"
        print(f"| {label} | {shown} | < {target:g} {unit} | {value / target:.6f}x | {met} |")
    print(f"| plan columns, once per process | {columns:.3f} s | | |")
    print(f"| plan held by each process | {held / 2**20:.1f} MB | | |")
    print(f"| `fingerprint` of a {big:,}-item list | {digest:.3f} s | | |")

    print(f"\n## Seconds by plan size, at {top:,} ranks x {WORKERS} workers (growth exponent in splits)\n")
    heads = [f"{count:,} splits" for count in splits]
    print("| measure | " + " | ".join(heads) + " | exponent |")
    print("| --- |" + " --- |" * (len(heads) + 1))
    for name in POLICIES:
        for key, label in (
            ("list", "one list"),
            ("first", "counts, first"),
            ("later", "counts, later"),
            ("replan", "re-plan"),
        ):
            values = [results[(name, count, top)][key] for count in splits]
            print(f"| {label}: {name} | " + " | ".join(f"{v:.4f}" for v in values) + f" | {exponent(splits, values)} |")

    print(f"\n## Seconds by world size, at {big:,} splits (growth exponent in ranks)\n")
    heads = [f"{world:,} x {WORKERS}" for world in ranks]
    print("| measure | " + " | ".join(heads) + " | exponent |")
    print("| --- |" + " --- |" * (len(heads) + 1))
    for name in POLICIES:
        for key, label in (("list", "one list"), ("first", "counts, first"), ("later", "counts, later")):
            values = [results[(name, big, world)][key] for world in ranks]
            print(f"| {label}: {name} | " + " | ".join(f"{v:.4f}" for v in values) + f" | {exponent(ranks, values)} |")
        memory = [results[(name, big, world)]["memory"] for world in ranks]
        print(
            f"| counts' peak MiB: {name} | "
            + " | ".join(f"{v:.1f}" for v in memory)
            + f" | {exponent(ranks, memory)} |"
        )


if __name__ == "__main__":
    main()
