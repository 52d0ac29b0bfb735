"""Mixture weights that change with the step: a schedule, and the weights it puts in force.

A *step* is a rank's batch number in a mixture epoch (0 for its first batch): a ``Mixture``
consumer that is DataLoader worker ``w`` of ``K`` delivers the rank's steps ``w, w + K, ...``
as a ``StatefulDataLoader`` takes its workers' batches in turn, so every consumer knows the step
of its next batch without asking the others. Weights are normalized to sum to 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from spiral_lightning.core.checks import check_count

#: Weights as a ``Mixture`` keeps them: one positive share per table, summing to 1.
Weights = tuple[float, ...]


def normalized(weights: Any, tables: int, where: str = "") -> Weights:
    """``weights`` (one positive finite number per table) scaled to sum to 1; ``ValueError``
    naming the table, and ``where`` they were given, when they are not such numbers."""
    said = f" ({where})" if where else ""
    if isinstance(weights, str) or not isinstance(weights, Sequence) or len(weights) != tables:
        raise ValueError(f"a mixture of {tables} tables takes {tables} weights, not {weights!r}{said}")
    for index, weight in enumerate(weights):
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf:
            raise ValueError(
                f"the weight of table {index} of the mixture must be a positive number, not {weight!r}{said}"
            )
    total = float(sum(weights))
    return tuple(float(weight) / total for weight in weights)


@dataclass(frozen=True)
class WeightSchedule:
    """The weights of a mixture by step: ``points`` of ``(step, weights)``, each in force from its
    step until the next point, the mixture's own weights before the first; or ``function``, a
    picklable function of the step that returns the weights (it runs in DataLoader workers).

        schedule = WeightSchedule.of([(0, [0.9, 0.1]), (1000, [0.5, 0.5])], tables=2)
        schedule.at(1500, first=(0.5, 0.5))  # (0.5, 0.5)
    """

    points: tuple[tuple[int, Weights], ...] = ()
    function: Callable[[int], Sequence[float]] | None = None
    tables: int = 0

    @classmethod
    def of(cls, schedule: Any, tables: int) -> WeightSchedule:
        """The schedule ``schedule`` gives (points in increasing step order, or a function);
        ``ValueError`` naming the point that is wrong."""
        if callable(schedule):
            return cls(function=schedule, tables=tables)
        if isinstance(schedule, str) or not isinstance(schedule, Sequence) or not schedule:
            raise ValueError(
                f"schedule must be a list of (step, weights) points or a function of the step, not {schedule!r}"
            )
        points: list[tuple[int, Weights]] = []
        for index, point in enumerate(schedule):
            if isinstance(point, str) or not isinstance(point, Sequence) or len(point) != 2:
                raise ValueError(f"schedule[{index}] must be a (step, weights) pair, not {point!r}")
            step = check_count(f"the step of schedule[{index}]", point[0])
            if points and step <= points[-1][0]:
                raise ValueError(
                    f"schedule[{index}] is at step {step}, not after the point before it ({points[-1][0]})"
                )
            points.append((step, normalized(point[1], tables, f"schedule[{index}]")))
        return cls(points=tuple(points), tables=tables)

    def at(self, step: int, first: Weights) -> Weights:
        """The weights in force at ``step``: ``first`` (the mixture's own) before any point."""
        if self.function is not None:
            return normalized(self.function(step), self.tables, f"the schedule's weights at step {step}")
        now = first
        for start, weights in self.points:
            if start > step:
                break
            now = weights
        return now


def by_table(weights: Sequence[Any]) -> tuple[list[float], list[tuple[int, list[float]]] | None]:
    """The first weights and the schedule points of a mixture whose tables each give a weight: a
    number, or ``(step, weight)`` points from step 0 on (a config's way to change one table's
    share). ``None`` for the points when every weight is a number; ``ValueError`` naming the
    table whose points are wrong."""
    points: list[list[tuple[int, Any]]] = []
    for index, weight in enumerate(weights):
        if isinstance(weight, str) or not isinstance(weight, Sequence):
            points.append([(0, weight)])
            continue
        if not weight or any(isinstance(p, str) or not isinstance(p, Sequence) or len(p) != 2 for p in weight):
            raise ValueError(f"the weight of table {index} of the mixture must be a number or (step, weight) points")
        if weight[0][0] != 0:
            raise ValueError(
                f"the weight points of table {index} of the mixture must start at step 0, not {weight[0][0]!r}"
            )
        points.append([(step, share) for step, share in weight])
    first = [table[0][1] for table in points]
    steps = sorted({step for table in points for step, _ in table[1:]})
    if not steps:
        return first, None

    def at(table: list[tuple[int, Any]], step: int) -> Any:
        return [share for start, share in table if start <= step][-1]

    return first, [(step, [at(table, step) for table in points]) for step in steps]
