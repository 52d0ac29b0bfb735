"""Decoding media (``decode``: images with Pillow, videos with PyAV) and ingesting folders of
them into tables (``ingest``). Neither loads until asked for, so a table without media never
imports PyAV or Pillow.

Release 0.1 had a module of this name holding ``Image``, ``Video`` and the decoders; its names
still resolve here for one release, with a ``DeprecationWarning``: the projections now live in
``spiral_lightning.core.media``, the decoders in ``spiral_lightning.media.decode``.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

#: Where the names of release 0.1's ``spiral_lightning.media`` module live now.
_MOVED_TO = ("spiral_lightning.core.media", "spiral_lightning.media.decode")


def __getattr__(name: str) -> Any:
    for target in _MOVED_TO:
        module = importlib.import_module(target)
        if hasattr(module, name):
            warnings.warn(
                f"spiral_lightning.media.{name} moved to {target}; the old path goes in the next release",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(module, name)
    raise AttributeError(f"module 'spiral_lightning.media' has no attribute {name!r}")
