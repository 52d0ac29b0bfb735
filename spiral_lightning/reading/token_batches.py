"""Token-budget batches read from a consumer's stream: its documents read a window at a time
(``read_frames`` with frames of ``TokenBudget.window`` rows), each window planned from its lengths
(``spiral_lightning.planning.token_batches``) and its batches made into tensors with numpy.

A position is the cursor of a window's first document, the window's index and the batches of the
window already delivered: a resumed consumer reads that window again, plans it again (the plan
depends on nothing else) and delivers the batches after those.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import torch

from spiral_lightning.core.budget import TokenBudget
from spiral_lightning.core.plan import WorkItem
from spiral_lightning.core.state import Cursor
from spiral_lightning.planning.token_batches import DocumentPieces, Ints, TooLongDocument, plan_window, window_rng
from spiral_lightning.reading.frames import read_frames
from spiral_lightning.sources import Reader, Source

#: The keys of a flat batch beside the token column: the bounds of its documents in ``[T]``
#: (int32, as variable-length attention kernels take them), its longest document, and each
#: token's place in its document.
CU_SEQLENS, MAX_SEQLEN, POSITIONS = "cu_seqlens", "max_seqlen", "positions"
#: The key of a padded batch's document lengths (int64 ``[B]``), from which a mask follows.
LENGTHS = "lengths"


class BudgetPosition(NamedTuple):
    """Where a consumer's token-budget batches continue: the cursor of the first document of
    window ``window`` and the ``taken`` batches of that window already delivered."""

    cursor: Cursor
    window: int = 0
    taken: int = 0


class PlanKey(NamedTuple):
    """What a consumer's window plans are drawn from beside the lengths: the seed, the epoch and
    the consumer itself (rank, world size, worker, workers)."""

    seed: int
    epoch: int
    shard: Sequence[int]


def lengths_of(documents: pa.Array, where: str) -> Ints:
    """The token count of each of ``documents`` (a list array); ``ValueError`` naming ``where``
    and the document for a null one."""
    if documents.null_count:
        first = int(np.argmax(~documents.is_valid().to_numpy(zero_copy_only=False)))
        raise ValueError(
            f"document {first} of {where} is null, which a token-budget batch cannot hold; keep such rows out "
            "with a filter such as '<column> IS NOT NULL'"
        )
    lengths: Ints = np.diff(documents.offsets.to_numpy()).astype(np.int64)
    return lengths


def count_lengths(source: Source, items: Sequence[WorkItem]) -> list[Ints]:
    """Each of ``items``' documents' token counts, reading only the token column (the source's one)."""
    found: list[list[Ints]] = [[] for _ in items]
    for batch, index, _ in source.read(items):
        item = items[index]
        found[index].append(lengths_of(batch.column(0), f"{source.version}, split {item.split}"))
    return [np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64) for parts in found]


def read_batches(
    reader: Reader,
    items: Sequence[WorkItem],
    position: BudgetPosition,
    budget: TokenBudget,
    key: PlanKey,
    where: str,
) -> Iterator[tuple[dict[str, Any], BudgetPosition]]:
    """The batches of ``items`` from ``position`` on, each with the position after it."""
    window, taken, cursor = position.window, position.taken, position.cursor
    for frame, after in read_frames(reader, items, cursor, budget.window, "keep_partial"):
        documents = frame.rows().column(0)
        lengths = lengths_of(documents, f"{where}, window {window}")
        rng = window_rng(key.seed, key.epoch, key.shard, window)
        try:
            found, batches = plan_window(lengths, budget, rng)
        except TooLongDocument as error:
            raise ValueError(f"{where}, window {window} (of {budget.window} documents): {error}") from None
        if taken >= len(batches):
            raise ValueError(
                f"{where}: the state says {taken} batches of window {window} were delivered, but the window plans "
                f"{len(batches)}; the state was edited or damaged, or saved under another seed or table"
            )
        held = documents.values.slice(documents.offsets[0].as_py(), int(lengths.sum()))
        if held.null_count:
            raise ValueError(
                f"{where}, window {window}: a document holds a null token, which a batch of token ids cannot hold; "
                "keep such rows out with a filter or write the column without nulls"
            )
        # int64, as torch's embeddings and losses take token ids (and as packed blocks are).
        values = held.to_numpy().astype(np.int64, copy=False)
        starts = documents.offsets.to_numpy()[:-1].astype(np.int64) - documents.offsets[0].as_py()
        for index in range(taken, len(batches)):
            done = index + 1 == len(batches)
            following = BudgetPosition(after, window + 1) if done else BudgetPosition(cursor, window, index + 1)
            yield tensors(values, starts, found, batches[index], budget), following
        cursor, window, taken = after, window + 1, 0


def tensors(
    values: np.ndarray[Any, Any], starts: Ints, found: DocumentPieces, batch: Ints, budget: TokenBudget
) -> dict[str, Any]:
    """One batch of the pieces ``batch`` of a window whose documents start at ``starts`` in
    ``values``: padded ``{column: [B, L], "lengths": [B]}`` or flat ``{column: [T], "cu_seqlens":
    [B + 1], "max_seqlen": L, "positions": [T]}``, the tokens int64."""
    length = found.length[batch]
    first = starts[found.document[batch]] + found.start[batch]
    before = np.cumsum(length) - length
    within = np.arange(int(length.sum()), dtype=np.int64) - np.repeat(before, length)
    tokens = values[np.repeat(first, length) + within]
    longest = int(length.max()) if len(length) else 0
    if budget.form == "flat":
        bounds = np.concatenate(([0], np.cumsum(length))).astype(np.int32)
        return {
            budget.column: torch.from_numpy(tokens),
            CU_SEQLENS: torch.from_numpy(bounds),
            MAX_SEQLEN: longest,
            POSITIONS: torch.from_numpy(within),
        }
    out = np.full((len(length), longest), budget.pad, dtype=values.dtype)
    out[np.arange(longest) < length[:, None]] = tokens
    return {budget.column: torch.from_numpy(out), LENGTHS: torch.from_numpy(length)}
