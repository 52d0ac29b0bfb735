"""Checks of the numbers users and states give: one place for "an int, not a bool" and its kin,
each raising a ``ValueError`` that names the setting and what it takes."""

from __future__ import annotations

from typing import Any


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int and not a bool (``True`` is an int to Python, never a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_count(value: Any) -> bool:
    """Whether ``value`` is a non-negative int (and not a bool)."""
    return is_int(value) and value >= 0


def check_count(name: str, value: Any, note: str = "") -> int:
    """``value`` when it is a non-negative int; else ``ValueError`` naming ``name``, with ``note``
    (such as ``"or None"`` or ``"0 reads in line"``) said after what it takes."""
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative int{_said(note)}, not {value!r}")
    count: int = value
    return count


def check_positive(name: str, value: Any, note: str = "") -> int:
    """``value`` when it is a positive int; else ``ValueError`` naming ``name`` (see ``check_count``)."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int{_said(note)}, not {value!r}")
    positive: int = value
    return positive


def _said(note: str) -> str:
    """``note`` as it follows what a setting takes: ``" or None"``, or ``" (0 reads in line)"``."""
    if not note:
        return ""
    return f" {note}" if note.startswith("or ") else f" ({note})"
