"""Digests that seal the states the library writes, so an edited or damaged state is refused
when it is loaded rather than read as wrong rows.

Every state (a dataset's, a mixture's, a DataModule's checkpoint entry, a Ray loader file)
carries ``DIGEST``: a short sha256 of the canonical JSON of its other fields, nested states
included. A state without one was saved by an earlier spiral-lightning and is accepted; one
whose digest does not match its fields is refused. Pure functions of plain values: no I/O.

    state = sealed({"format": 1, "cursor": [0, 40, 5]})
    check_digest(state, "TableDataset")  # passes; raises ValueError once any field changes
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

#: The field of a state that holds the digest of its other fields.
DIGEST = "digest"

#: Hex characters a digest keeps: 64 bits, so a random edit passes with odds of 1 in 2**64.
DIGEST_CHARS = 16

#: Every field a state of any kind had before states were sealed. A state without a digest holds
#: only these: one with another field (such as a ``digest`` whose name was damaged) is refused.
FIELDS_BEFORE_DIGESTS = frozenset(
    {
        *("format", "version", "shard", "batch_size", "epoch", "policy", "work", "cursor"),
        *("rows_per_consumer", "delivered", "skipped", "remainder"),
        *("seed", "stop", "weights", "tables", "table", "packing", "offset", "windows", "lead"),
        *("world_size", "num_workers", "ranks", "lineage", "rank", "loader"),
    }
)


def digest_of(state: Mapping[str, Any]) -> str:
    """The digest of every field of ``state`` but ``DIGEST``: sha256 of their canonical JSON
    (keys sorted, lists and tuples alike, arrays as their dtype and values)."""
    rest = {key: value for key, value in state.items() if key != DIGEST}
    text = json.dumps(_plain(rest), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS]


def sealed(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with ``DIGEST`` set to the digest of its other fields."""
    return {**state, DIGEST: digest_of(state)}


def intact(state: Mapping[str, Any]) -> bool:
    """Whether ``state``'s digest matches its fields; for a state without one (saved by an
    earlier spiral-lightning, before states were sealed), whether it holds only the fields states
    had then (``FIELDS_BEFORE_DIGESTS``)."""
    if DIGEST not in state:
        return state.keys() <= FIELDS_BEFORE_DIGESTS
    return bool(state[DIGEST] == digest_of(state))


def damaged(kind: str, where: str = "", found: str = "") -> ValueError:
    """The error for a ``kind`` state (of ``where``: a rank, a worker, a file) whose fields do not
    match its digest; ``found`` names what else is wrong with it, such as a field out of range."""
    place = f" of {where}" if where else ""
    detail = f" ({found})" if found else ""
    return ValueError(
        f"the {kind} state{place} was edited or damaged after it was saved: its fields no longer match its "
        f"'{DIGEST}'{detail}; resume from an intact copy of the checkpoint or state, or start the epoch afresh "
        "without it"
    )


def check_digest(state: Mapping[str, Any], kind: str, where: str = "") -> None:
    """``ValueError`` (see ``damaged``) unless ``state``'s digest matches its fields or it has none."""
    if not intact(state):
        raise damaged(kind, where)


def dataset_states(loader: Any, where: str = "") -> list[Mapping[str, Any]]:
    """Every consumer's dataset state inside a torchdata ``StatefulDataLoader`` state ``loader``:
    the main process's when it read without workers, else each worker's in worker order.
    ``ValueError`` naming the worker when one is missing or ``None``: a loader over a resumable
    dataset always saves one, so such a state was edited or damaged, and loading it would start
    that consumer's epoch again."""
    place = f" of {where}" if where else ""
    if not isinstance(loader, Mapping):
        raise ValueError(f"the loader state{place} must be a mapping, not {type(loader).__name__}")
    snapshot = loader.get("_snapshot")
    if snapshot is None:
        if "dataset_state" not in loader:
            raise ValueError(
                f"the loader state{place} holds no dataset state; it was not saved by a StatefulDataLoader"
            )
        return [_dataset_state(loader.get("dataset_state"), f"the loader state{place}")]
    workers = snapshot.get("_worker_snapshots") if isinstance(snapshot, Mapping) else None
    if not isinstance(workers, Mapping):
        raise ValueError(f"the loader state{place} has no '_worker_snapshots'; it was edited or damaged")
    found = []
    for worker in range(len(workers)):
        entry = workers.get(f"worker_{worker}")
        if not isinstance(entry, Mapping):
            raise ValueError(f"the loader state{place} lacks worker {worker}'s snapshot; it was edited or damaged")
        found.append(_dataset_state(entry.get("dataset_state"), f"worker {worker} of the loader state{place}"))
    return found


def _dataset_state(state: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(state, Mapping):
        raise ValueError(
            f"{where} holds dataset_state {str(state)[:100]}, not a dataset's state: it was edited or damaged, and "
            "loading it would read that consumer's epoch from its start; resume from an intact copy of the "
            "checkpoint, or start the epoch afresh without it"
        )
    return state


def _plain(value: Any) -> Any:
    """``value`` as JSON values: mappings with string keys, lists, and arrays (a tensor, a numpy
    value) as their dtype and values; anything else by its ``repr``."""
    kind = type(value)
    if kind in _SCALARS or (kind is list and all(type(item) in _SCALARS for item in value)):
        return value  # the fields of every batch's state: the common case, taken first
    if isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {key if isinstance(key, str) else f"{type(key).__name__}:{key!r}": _plain(v) for key, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        return [_plain(v) for v in value]
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return {"dtype": str(getattr(value, "dtype", type(value).__name__)), "values": _plain(tolist())}
    return repr(value)


#: The types JSON writes as they are.
_SCALARS = frozenset({type(None), bool, int, float, str})
