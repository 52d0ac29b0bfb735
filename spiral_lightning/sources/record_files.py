"""Where a step record's lines are kept (see ``datasets.record``): per rank, in a local folder
one file appended at each write, ``rank-<r>.jsonl``; in an object store, which cannot append, one
object per write, ``rank-<r>.<n>.jsonl``, ``n`` counting up from the rank's last one."""

from __future__ import annotations

import re
from pathlib import Path

from pyarrow import fs as pafs

from spiral_lightning.core.storage import StorageOptions, masked
from spiral_lightning.sources.stores import credentials_of, locate

#: The name of a rank's object written at one flush in an object store.
_PART = re.compile(r"rank-(\d+)\.(\d+)\.jsonl")
#: The name of a rank's file in a local folder.
_FILE = re.compile(r"rank-(\d+)\.jsonl")


class RecordFiles:
    """Rank ``rank``'s record in ``folder`` (a path or an object-store uri, reached with
    ``options`` and the environment).

        files = RecordFiles("s3://bucket/record", rank=0)
        files.write('{"step": 0, ...}\\n')
    """

    def __init__(self, folder: str, rank: int, options: StorageOptions | None = None) -> None:
        self.location = locate(folder, options)
        self.rank = rank
        self._next: int | None = None
        if not self.location.remote:
            Path(self.location.path).mkdir(parents=True, exist_ok=True)

    def write(self, text: str) -> None:
        """Add ``text`` (whole lines) after what the rank's record holds."""
        where = self.location
        if not where.remote:
            with (Path(where.path) / _name(self.rank, None)).open("a") as file:
                file.write(text)
            return
        if self._next is None:
            parts = [part for rank, part in _names(where.filesystem, where.path, _PART) if rank == self.rank]
            self._next = max(parts, default=-1) + 1
        with where.filesystem.open_output_stream(f"{where.path.rstrip('/')}/{_name(self.rank, self._next)}") as out:
            out.write(text.encode())
        self._next += 1


def check_reachable(folder: str, options: StorageOptions | None = None) -> None:
    """``ValueError`` naming ``folder`` when its store cannot be listed (a wrong bucket, endpoint
    or credentials), so that a record fails when the run starts, not at its first checkpoint."""
    where = locate(folder, options)
    if not where.remote:
        return
    try:
        where.filesystem.get_file_info(pafs.FileSelector(where.path, allow_not_found=True))
    except OSError as error:
        raise ValueError(
            f"the record folder {masked(folder)!r} cannot be reached: {error}. Check the bucket and the store's "
            f"credentials ({credentials_of(folder)})"
        ) from None


def read_ranks(folder: str, options: StorageOptions | None = None) -> dict[int, str]:
    """Each rank's record text in ``folder``, in the order it was written."""
    where = locate(folder, options)
    pattern = _PART if where.remote else _FILE
    found: dict[int, list[tuple[int, str]]] = {}
    for rank, part in _names(where.filesystem, where.path, pattern):
        found.setdefault(rank, []).append((part, _name(rank, part if where.remote else None)))
    folder_path = where.path.rstrip("/")
    return {
        rank: "".join(_read(where.filesystem, f"{folder_path}/{name}") for _, name in sorted(names))
        for rank, names in sorted(found.items())
    }


def _name(rank: int, part: int | None) -> str:
    """The name of rank ``rank``'s local file (``part`` ``None``) or of its object ``part``."""
    return f"rank-{rank}.jsonl" if part is None else f"rank-{rank}.{part:06d}.jsonl"


def _names(filesystem: pafs.FileSystem, folder: str, pattern: re.Pattern[str]) -> list[tuple[int, int]]:
    """The (rank, part) of each record file in ``folder`` (part 0 for a local file)."""
    infos = filesystem.get_file_info(pafs.FileSelector(folder, allow_not_found=True))
    matches = [pattern.fullmatch(Path(info.path).name) for info in infos]
    return [(int(match.group(1)), int(match.group(2)) if pattern is _PART else 0) for match in matches if match]


def _read(filesystem: pafs.FileSystem, path: str) -> str:
    with filesystem.open_input_stream(path) as source:
        text: str = source.read().decode()
    return text
