"""Worker watchdog: a DataLoader worker ends when the process that made it dies.

A worker started by a forkserver is the server's child, not the trainer's, so torch's own check
(is my parent still the one that started me?) never fires when the trainer is killed; the worker
would wait for work forever and keep the forkserver alive. The watchdog polls the trainer's pid
instead.
"""

from __future__ import annotations

import os
import threading
import time

#: Seconds between two looks at the trainer.
_PERIOD = 1.0

_watching: int | None = None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and, where /proc tells, is not a zombie (a dead process
    its parent has not reaped yet still answers signals)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _watch(pid: int) -> None:
    while _alive(pid):
        time.sleep(_PERIOD)
    os._exit(1)


def watch(pid: int) -> None:
    """End this process within about a second of process ``pid`` ending (once per process)."""
    global _watching
    if _watching == pid or pid == os.getpid():
        return
    _watching = pid
    threading.Thread(target=_watch, args=(pid,), name="spiral-lightning-watchdog", daemon=True).start()
