"""Reading an object store through its outages: each request retried with backoff within a time
budget, then a clear failure.

A store that restarts, sheds load or drops off the network for a while answers with refused or
reset connections, timeouts, 5xx statuses, throttling, or a range response shorter than asked.
Every request that pinning a Parquet version or reading a pinned one makes (the listing, a
file's footer and check, each range read) is tried again after a pause that doubles from
``FIRST_PAUSE`` to ``MOST_PAUSE`` seconds, for up to the storage option ``retry_seconds``
(default ``RETRY_SECONDS``) after its first failure; then it fails with a ``StoreUnavailable``
naming the object, how long and how many times it was tried, and the store's last answer. The
store client's own retries (pyarrow's S3 client makes 3 attempts) happen inside each try.

Refused credentials, missing objects, a file changed since it was pinned and damaged bytes are no
outage: they fail at once. Writing retries nothing. A wrong endpoint cannot be told from a store
that is down, so pinning fails on one after ``retry_seconds`` (a warning at its first failure says
it is retrying, and for how long).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from spiral_lightning.core.storage import StorageOptions, scrub

T = TypeVar("T")

#: How long a request is retried after its first failure, by default: a 30 s outage and then some.
RETRY_SECONDS = 120.0

#: The first pause between tries, doubled after each to at most ``MOST_PAUSE`` (each drawn
#: between half and all of that, so that many readers do not return to the store in step).
FIRST_PAUSE = 0.1
MOST_PAUSE = 2.0

#: Words of a store's (or its client's) error that say it may pass: S3 (and compatible), GCS, Azure.
_PASSING = (
    "network_connection",
    "curlcode",
    "connect",
    "connection reset",
    "reset by peer",
    "broken pipe",
    "empty reply",
    "partial file",
    "timeout",
    "timed out",
    "deadline",
    "slow_down",
    "slowdown",
    "slow down",
    "throttl",
    "too many requests",
    "internal_failure",
    "internalerror",
    "internal error",
    "unavailable",
    "server busy",
    "temporarily",
    "try again",
    "http status 500",
    "http status 502",
    "http status 503",
    "http status 504",
    "status code 500",
    "status code 502",
    "status code 503",
    "status code 504",
)

#: Words that say no retry mends it, whatever else the text says.
_LASTING = (
    "access_denied",
    "accessdenied",
    "access denied",
    "forbidden",
    "signature",
    "invalidaccesskey",
    "invalid_access_key",
    "expiredtoken",
    "expired_token",
    "unauthorized",
    "unauthenticated",
    "permission",
    "http status 401",
    "http status 403",
    "http status 404",
    "nosuchkey",
    "nosuchbucket",
    "no such key",
)

_log = logging.getLogger(__name__)


class ShortRead(OSError):
    """The store sent fewer bytes than a range read asked for (see ``parquet_fetch.read_span``)."""


class StoreUnavailable(ConnectionError):
    """A request still failed when its ``retry_seconds`` ran out."""


def retry_seconds(options: StorageOptions | None) -> float:
    """The storage option ``retry_seconds`` (``RETRY_SECONDS`` when absent); 0 retries nothing."""
    value = options.get("retry_seconds") if options is not None else None
    if value is None:
        return RETRY_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"storage option 'retry_seconds' is a number of seconds, 0 or more, not {value!r}")
    return seconds


def passing(error: BaseException) -> bool:
    """Whether ``error`` is a store's failure that may pass: an outage, throttling, a short read."""
    if isinstance(error, ShortRead):
        return True
    if not isinstance(error, OSError) or isinstance(error, PermissionError | FileNotFoundError | StoreUnavailable):
        return False
    text = str(error).lower()
    return not any(mark in text for mark in _LASTING) and any(mark in text for mark in _PASSING)


class Retry:
    """The retries of one table's reads: ``retry(what, call)`` is ``call()``, tried again while it
    fails with an error that may pass, for up to ``seconds`` after its first failure. ``stop``,
    when set, ends the pauses early (a pass that no longer needs the bytes)."""

    def __init__(self, uri: str, options: StorageOptions | None) -> None:
        self.uri = uri
        self.options = options
        self.seconds = retry_seconds(options)

    def __call__(self, what: str, call: Callable[[], T], stop: threading.Event | None = None) -> T:
        first: float | None = None
        tries = 0
        while True:
            tries += 1
            try:
                value = call()
            except OSError as error:
                if not passing(error):
                    raise
                now = time.monotonic()
                first = now if first is None else first
                if now - first >= self.seconds or (stop is not None and stop.is_set()):
                    raise self._unavailable(what, error, now - first, tries) from error
                if tries == 1:
                    _log.warning(
                        "reading %s of %r failed (%s); retrying for up to %g s (storage option retry_seconds)",
                        what,
                        self.uri,
                        self._said(error),
                        self.seconds,
                    )
                pause = min(MOST_PAUSE, FIRST_PAUSE * 2 ** (tries - 1)) * random.uniform(0.5, 1.0)
                pause = min(pause, first + self.seconds - now)
                if stop is not None:
                    stop.wait(pause)
                else:
                    time.sleep(pause)
                continue
            if first is not None:
                _log.warning(
                    "read %s of %r after %d tries over %.1f s", what, self.uri, tries, time.monotonic() - first
                )
            return value

    def _said(self, error: BaseException) -> str:
        return scrub(str(error), self.options).strip()

    def _unavailable(self, what: str, error: BaseException, waited: float, tries: int) -> StoreUnavailable:
        return StoreUnavailable(
            f"the object store of {self.uri!r} did not serve {what}: it failed {tries} "
            f"{'try' if tries == 1 else 'tries'} over {waited:.1f} s (storage option retry_seconds={self.seconds:g}); "
            f"its last answer: {self._said(error)}; check that the store is up and reachable from here, "
            "or give a longer retry_seconds to ride out longer outages"
        )
