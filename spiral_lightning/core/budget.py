"""TokenBudget: what a batch sized by tokens holds, as one value a dataset and a state record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from spiral_lightning.core.checks import check_positive, is_int

#: How a batch of documents is laid out: ``"padded"``, ``[B, L]`` rows padded to the batch's longest
#: document, or ``"flat"``, the documents one after another in ``[T]`` with their bounds beside them.
Form = Literal["padded", "flat"]
FORMS: tuple[Form, ...] = ("padded", "flat")

#: What a document of more tokens than the budget becomes: an error naming it (``"refuse"``), its
#: first ``max_tokens`` tokens (``"truncate"``), or pieces of at most ``max_tokens`` tokens, each
#: batched as a document of its own (``"split"``).
Long = Literal["refuse", "truncate", "split"]
LONG_RULES: tuple[Long, ...] = ("refuse", "truncate", "split")


@dataclass(frozen=True)
class TokenBudget:
    """Batches of whole documents of the token column ``column`` (a list of integers per row),
    each as many documents as fit ``max_tokens`` tokens.

        budget = TokenBudget("tokens", max_tokens=8192, form="flat")
        dataset = TokenBatchDataset("spiral:data/corpus", budget=budget)
        batch = next(iter(dataset))  # {"tokens": [T], "cu_seqlens": [B + 1], "max_seqlen": L, "positions": [T]}

    A padded batch of ``B`` documents whose longest has ``L`` tokens holds ``B * L <= max_tokens``;
    a flat one holds ``T <= max_tokens`` tokens. An empty document counts as one token. ``long``
    says what a document longer than the budget becomes (see ``LONG_RULES``).

    Each consumer plans its documents ``window`` at a time, in its work list's order. With
    ``group=True`` a window's documents are batched shortest first (ties in an order drawn from
    the seed), so a batch holds documents of similar length and pads little, and the window's
    batches are then delivered in an order drawn from the seed; with ``group=False`` batches take
    documents in stored order. ``pad`` fills a padded batch past each document's end.
    """

    column: str
    max_tokens: int
    form: Form = "padded"
    long: Long = "refuse"
    window: int = 1024
    group: bool = True
    pad: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.column, str) or not self.column:
            raise ValueError(f"the token column must be a column name, not {self.column!r}")
        check_positive("max_tokens", self.max_tokens)
        check_positive("the budget's window", self.window, "documents planned together")
        if self.form not in FORMS:
            raise ValueError(f"form must be one of {FORMS}, not {self.form!r}")
        if self.long not in LONG_RULES:
            raise ValueError(f"long must be one of {LONG_RULES}, not {self.long!r}")
        if not isinstance(self.group, bool):
            raise ValueError(f"group must be True or False, not {self.group!r}")
        if not is_int(self.pad):
            raise ValueError(f"pad must be an int token id, not {self.pad!r}")

    def settings(self) -> list[Any]:
        """Every field in order, as a state records them: each changes which documents a batch holds."""
        return [self.column, self.max_tokens, self.form, self.long, self.window, self.group, self.pad]
