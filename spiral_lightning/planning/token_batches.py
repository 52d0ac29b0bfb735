"""Token-budget batches planned from document lengths alone: pure functions, no reading.

A consumer's documents are planned a window at a time (``TokenBudget.window`` documents of its
stream). Each document becomes one piece, or with ``long="split"`` as many pieces of at most
``max_tokens`` tokens as it needs; a batch is a list of a window's pieces. The plan of a window
depends only on its lengths, the budget and its key (the seed, the epoch, the consumer and the
window's index), so the batches counted ahead are the batches read, and a resumed consumer plans
its window again and skips the batches it delivered.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from spiral_lightning.core.budget import TokenBudget

Ints = np.ndarray[Any, np.dtype[np.int64]]


class TooLongDocument(ValueError):
    """A document longer than the budget under ``long="refuse"``: ``document`` is its place in
    its window (a reader names it in the table)."""

    def __init__(self, document: int, length: int, budget: TokenBudget) -> None:
        self.document, self.length, self.budget = document, length, budget
        super().__init__(
            f"document {document} holds {length} tokens, more than max_tokens={budget.max_tokens}; give the "
            "TokenBudget long='truncate' (keep its first max_tokens tokens) or long='split' (batch its pieces as "
            "documents of their own), or a larger max_tokens"
        )


class DocumentPieces(NamedTuple):
    """A window's pieces: piece ``i`` is tokens ``start[i] : start[i] + length[i]`` of the
    window's document ``document[i]``."""

    document: Ints
    start: Ints
    length: Ints


def pieces(lengths: Ints, budget: TokenBudget) -> DocumentPieces:
    """The pieces of documents of ``lengths`` tokens under ``budget.long`` (see ``TokenBudget``)."""
    limit = budget.max_tokens
    count = len(lengths)
    over = lengths > limit
    if over.any() and budget.long == "refuse":
        first = int(np.argmax(over))
        raise TooLongDocument(first, int(lengths[first]), budget)
    if not over.any() or budget.long == "truncate":
        kept = np.minimum(lengths, limit).astype(np.int64)
        return DocumentPieces(np.arange(count, dtype=np.int64), np.zeros(count, dtype=np.int64), kept)
    per_document = np.maximum(1, -(-lengths // limit)).astype(np.int64)
    document = np.repeat(np.arange(count, dtype=np.int64), per_document)
    index = np.arange(len(document), dtype=np.int64) - np.repeat(np.cumsum(per_document) - per_document, per_document)
    start = index * limit
    return DocumentPieces(document, start, np.minimum(lengths[document] - start, limit).astype(np.int64))


def window_rng(seed: int, epoch: int, consumer: Sequence[int], window: int) -> np.random.Generator:
    """The random numbers of one window's plan: a function of the seed, the epoch, the consumer
    (its rank, world size, worker and workers) and the window's index alone."""
    return np.random.default_rng([seed, epoch, *consumer, window])


#: A window's plan: its pieces, and its batches in the order they are delivered, each the
#: indexes of its pieces.
WindowPlan = tuple[DocumentPieces, list[Ints]]


def plan_window(lengths: Ints, budget: TokenBudget, rng: np.random.Generator) -> WindowPlan:
    """The pieces of a window of documents of ``lengths`` tokens and its batches, in the order
    they are delivered: each batch the indexes of its pieces, all within the budget (see
    ``TokenBudget``); ``TooLongDocument`` under ``long="refuse"``."""
    found = pieces(lengths, budget)
    costs = np.maximum(found.length, 1)
    if budget.group:
        order = np.lexsort((rng.random(len(costs)), costs))
        batches = _fill(order, costs, budget)
        return found, [batches[i] for i in rng.permutation(len(batches))]
    return found, _fill(np.arange(len(costs), dtype=np.int64), costs, budget)


def _fill(order: Ints, costs: Ints, budget: TokenBudget) -> list[Ints]:
    """``order``'s pieces cut greedily into batches within the budget: a batch closes before the
    piece that would take it past ``max_tokens`` (padded: its count times its longest piece)."""
    limit, padded = budget.max_tokens, budget.form == "padded"
    bounds = [0]
    held = longest = 0
    for place, cost in enumerate(costs[order].tolist()):
        count = place - bounds[-1]
        longest_then = max(longest, cost)
        if count and ((count + 1) * longest_then if padded else held + cost) > limit:
            bounds.append(place)
            count, held, longest_then = 0, 0, cost
        held += cost
        longest = longest_then
    bounds.append(len(order))
    return [order[low:high] for low, high in itertools.pairwise(bounds) if high > low]


def windows_of(lengths: Ints, budget: TokenBudget) -> Iterator[tuple[int, Ints]]:
    """A consumer's documents of ``lengths`` tokens cut into its windows: each window's index
    and its documents' lengths."""
    for index, low in enumerate(range(0, len(lengths), budget.window)):
        yield index, lengths[low : low + budget.window]


def count_batches(lengths: Ints, budget: TokenBudget, seed: int, epoch: int, consumer: Sequence[int]) -> int:
    """The batches of a consumer whose stream holds documents of ``lengths`` tokens, planned as
    its reads plan them."""
    return sum(
        len(plan_window(window, budget, window_rng(seed, epoch, consumer, index))[1])
        for index, window in windows_of(lengths, budget)
    )


def delivered_documents(lengths: Ints, budget: TokenBudget, rng: np.random.Generator, taken: int) -> Ints:
    """The documents (places in the window, sorted) of a window of documents of ``lengths`` tokens
    whose tokens its first ``taken`` batches delivered, planned with ``rng`` as its reads plan it:
    what an elastic re-plan leaves out of the window. A document split by ``long="split"`` whose
    other pieces are in batches not delivered is not among them: a re-plan shares whole documents,
    so it comes again whole (as a packed consumer's partly delivered document does).
    ``ValueError`` when the window plans no more than ``taken`` batches."""
    found, batches = plan_window(lengths, budget, rng)
    if taken >= len(batches):
        raise ValueError(
            f"{taken} of its batches were delivered, but the window of {len(lengths)} documents plans {len(batches)}; "
            "the state was edited or damaged, or saved under another seed or table"
        )
    done = np.concatenate(batches[:taken]) if taken else np.zeros(0, dtype=np.int64)
    documents, delivered = np.unique(found.document[done], return_counts=True)
    whole: Ints = documents[delivered == np.bincount(found.document, minlength=len(lengths))[documents]]
    return whole.astype(np.int64)
