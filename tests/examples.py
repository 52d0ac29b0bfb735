"""How many examples a property test draws: its full count under ``./run-checks --full``
(``HYPOTHESIS_PROFILE=full``), a third of it (at least ten) in the default run, so that the suite
stays under ten minutes while ``--full`` keeps the counts each test was written with."""

from __future__ import annotations

import os
from typing import Any

from hypothesis import settings

#: Whether this run draws every test's full count of examples.
FULL = os.environ.get("HYPOTHESIS_PROFILE") == "full"


def examples(count: int, **options: Any) -> settings:
    """Hypothesis settings drawing ``count`` examples in a full run and fewer in the default one;
    ``options`` are further settings (``deadline``, ``suppress_health_check``)."""
    drawn = count if FULL else max(min(count, 10), count // 3)
    return settings(max_examples=drawn, **options)
