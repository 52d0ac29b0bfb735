"""The loader states a Ray Train run keeps: one file per rank in each reported checkpoint, and
the format of what ``save_loader_state`` writes into it."""

from __future__ import annotations

#: The version of the dictionary ``save_loader_state`` writes.
STATE_FORMAT = 1

#: torchdata's key, in a loader state, for "saved after the epoch's last batch".
FINISHED = "_iterator_finished"

#: The names of the loader states in a checkpoint folder: one per rank, ``*`` its number.
STATE_FILES = "spiral-loader-rank*.pt"


def state_file(rank: int) -> str:
    """The name of rank ``rank``'s loader state inside a checkpoint folder."""
    return STATE_FILES.replace("*", str(rank))
