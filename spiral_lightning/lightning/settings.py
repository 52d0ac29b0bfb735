"""The settings of a SpiralDataModule checked when it is built, in the main process, each error
naming the setting and what to give instead."""

from __future__ import annotations

from typing import Any

from spiral_lightning.core.budget import TokenBudget
from spiral_lightning.core.checks import check_positive
from spiral_lightning.datasets.consumer import check_read_ahead, check_read_threads
from spiral_lightning.lightning.checkpoint import MISSING_POSITION
from spiral_lightning.reading.frames import LAST_MODES
from spiral_lightning.reading.packing import Packing
from spiral_lightning.reading.windows import Windows


def check_settings(
    *,
    batch_size: int,
    last: str,
    read_ahead: int,
    read_threads: int | None,
    multiprocessing_context: str | None,
    access: str,
    missing_position: str,
    packing: Packing | None,
    shuffle: bool,
    policy: Any,
) -> None:
    """``ValueError`` for a setting a ``SpiralDataModule`` cannot read with, alone or beside another."""
    check_positive("batch_size", batch_size)
    if last not in LAST_MODES:
        raise ValueError(f"last must be one of {LAST_MODES}, not {last!r}")
    check_read_ahead(read_ahead)
    check_read_threads(read_threads)
    if multiprocessing_context not in (None, "forkserver", "spawn"):
        raise ValueError(
            f"multiprocessing_context {multiprocessing_context!r} is not supported: table readers cannot "
            "continue in a process forked after its parent opened a table; use 'forkserver' (the default) "
            "or 'spawn'"
        )
    if access not in ("iterable", "map") or missing_position not in MISSING_POSITION:
        raise ValueError(
            f"access must be 'iterable' or 'map' (given {access!r}) and missing_position one of "
            f"{MISSING_POSITION} (given {missing_position!r})"
        )
    if packing is not None and (not isinstance(packing, Packing) or access == "map"):
        raise ValueError(
            f"packing must be a Packing(column, length, separator) read with access='iterable', not {packing!r} "
            f"with access={access!r}"
        )
    if shuffle and policy is not None:
        raise ValueError(
            f"shuffle=True chooses the train table's policy (a Shuffled sized for the table), so it cannot be "
            f"given with policy={policy!r}; pass one of them"
        )


def check_train_kind(
    *, mixture: bool, windows: Windows | None, packing: Packing | None, access: str, last: str, others: dict[str, Any]
) -> None:
    """``ValueError`` when a train mixture or ``windows`` meet a setting they cannot read with:
    packing, map access, each other, and (windows) the settings in ``others`` that are set."""
    if mixture and (packing is not None or access == "map" or last != "keep_partial" or windows is not None):
        raise ValueError(
            "a train mixture reads each table in batches whose pass ends with a partial one, and is neither "
            f"packed, windowed nor read by index: leave packing, windows, access and last at their defaults "
            f"(given {packing!r}, {windows!r}, {access!r}, {last!r})"
        )
    if windows is None:
        return
    if not isinstance(windows, Windows):
        raise TypeError(f"windows must be a Windows(size, stride, group_by) value, not {windows!r}")
    given = [name for name, value in others.items() if value not in (None, False)]
    given += ["packing"] * (packing is not None) + ["access"] * (access == "map")
    if given:
        names = " and ".join([", ".join(given[:-1]), given[-1]] if len(given) > 1 else given)
        raise ValueError(
            "windows train on a WindowDataset, which reads rows in stored order and is neither packed, read by "
            f"index, transformed nor shuffled; leave {names} at the default (or train on rows)"
        )


def check_tokens(
    tokens: TokenBudget | None, *, mixture: bool, windows: Windows | None, packing: Packing | None, access: str
) -> None:
    """``ValueError`` when a token budget meets a train kind it cannot be: a mixture, windows,
    packed blocks or map access (each sizes batches its own way)."""
    if tokens is None:
        return
    if not isinstance(tokens, TokenBudget):
        raise TypeError(f"tokens must be a TokenBudget(column, max_tokens, ...) value, not {tokens!r}")
    given = ["a train mixture"] * mixture + ["windows"] * (windows is not None) + ["packing"] * (packing is not None)
    given += ["access='map'"] * (access == "map")
    if given:
        raise ValueError(
            f"tokens trains on batches sized by a token budget, which {' and '.join(given)} would size otherwise; "
            "give one of them"
        )
