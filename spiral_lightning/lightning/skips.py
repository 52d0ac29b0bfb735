"""Training steps whose batches a rolled-back run leaves out.

A run whose loss spiked rolls back to a checkpoint and skips the data of the bad steps. Steps are
numbered as the run that is rolled back numbered them: a resumed loader reads exactly the batches
that run read after the checkpoint, so the batch that was step ``s`` there is found again and
left out. Each rank leaves out the same steps, so the ranks stay in step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spiral_lightning.core.checks import is_count


@dataclass(frozen=True)
class StepSkips:
    """Ranges ``[start, end)`` of training steps (one batch a step) whose batches are left out.

    data = SpiralDataModule("spiral:data/train", skip_steps=[(1000, 1100)])
    trainer.fit(model, datamodule=data, ckpt_path="runs/checkpoints/step=900.ckpt")
    """

    ranges: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, given: Sequence[Sequence[int]] | None) -> StepSkips | None:
        """The skips of ``given`` pairs (a config's ``[[1000, 1100]]`` too); ``ValueError`` naming
        the pair that is not ``[start, end)`` of step numbers; ``None`` for none."""
        if not given:
            return None
        ranges = []
        for index, pair in enumerate(given):
            if (
                not isinstance(pair, Sequence)
                or len(pair) != 2
                or not all(is_count(step) for step in pair)
                or pair[0] >= pair[1]
            ):
                raise ValueError(
                    f"skip_steps[{index}] must be a pair (start, end) of step numbers with start < end, the steps "
                    f"start to end - 1 left out, not {pair!r}"
                )
            ranges.append((int(pair[0]), int(pair[1])))
        return cls(tuple(sorted(ranges)))

    def left_out(self, first: int, done: int, batches: int) -> list[range]:
        """The batch indexes of an epoch of ``batches`` whose steps are left out, when its batch
        ``done`` is step ``first`` (in the rolled-back run's numbering) and those before it are
        delivered: ranges of indexes, in order, none overlapping."""
        found: list[range] = []
        for start, end in self.ranges:
            low, high = max(done, start - first + done), min(batches, end - first + done)
            if low >= high:
                continue
            if found and low <= found[-1].stop:
                found[-1] = range(found[-1].start, max(found[-1].stop, high))
            else:
                found.append(range(low, high))
        return found


def check_skips(skips: StepSkips | None, trainer: Any) -> None:
    """``ValueError`` when steps are skipped under a ``trainer`` whose steps are not one batch each."""
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    if skips is not None and accumulate != 1:
        raise ValueError(
            f"skip_steps numbers steps of one batch each, but the Trainer accumulates {accumulate} batches a step; "
            "skip the steps with accumulate_grad_batches=1, or give the batches' steps yourself"
        )
