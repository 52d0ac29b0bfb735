"""TableSpec: a small picklable value naming a table version and the options of its scan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from spiral_lightning.media import ON_ERROR, Image, OnError, Video


class FileVersion(NamedTuple):
    """One file of a pinned file-backed version: its path, size, modification time and the rows
    of each of its row groups."""

    path: str
    size: int
    mtime_ns: int
    row_groups: tuple[int, ...]


@dataclass(frozen=True)
class TableSpec:
    """A table and how to scan it, cheap to pickle and to write in YAML.

    ``uri`` names the table: ``spiral:<local root>`` (ids read from the file ``write_table``
    leaves in the root), ``spiral:<root>?resource_id=..&version_id=..``,
    ``spiral://<project>/<path>[@v<version>]`` for a remote Spiral table,
    ``parquet:<file | folder | glob>`` on any filesystem pyarrow opens, or ``sds:<root>`` for a
    published signal-dataset snapshot. ``columns`` selects
    columns (all when ``None``). ``filter`` keeps the rows it holds for: text in the filter
    language (``"label < 5 AND name LIKE 'cat%'"``, the same meaning on every backend) or the
    backend's native expression (``spiral.Expression``, ``pyarrow.compute.Expression``).

    ``resolve`` pins the spec to the exact version that every process then reads: the ids in a
    Spiral uri, or the ``files`` of a Parquet version (set by ``resolve``, never by hand).

    ``media`` decodes encoded columns (binary, or Spiral blobs) into tensors: ``Image`` and
    ``Video`` projections. A row that cannot be decoded raises, naming the table, column and row;
    with ``on_error="skip"`` it is dropped instead and counted.
    """

    uri: str
    columns: tuple[str, ...] | None = None
    filter: Any = None
    files: tuple[FileVersion, ...] | None = None
    media: tuple[Image | Video, ...] = ()
    on_error: OnError = "raise"

    def __post_init__(self) -> None:
        if not isinstance(self.uri, str) or ":" not in self.uri:
            raise ValueError(
                f"a table uri looks like 'spiral:<root>', 'parquet:<path>' or 'sds:<root>', not {self.uri!r}"
            )
        if self.columns is not None:
            columns: Any = self.columns
            if isinstance(columns, str) or not isinstance(columns, Sequence):
                raise TypeError(f"columns must be a list of column names, not {columns!r}")
            if not columns or not all(isinstance(name, str) for name in columns):
                raise ValueError(f"columns must be a non-empty list of column names, not {columns!r}")
            object.__setattr__(self, "columns", tuple(columns))
        media: Any = self.media
        if isinstance(media, Image | Video) or not all(isinstance(item, Image | Video) for item in media):
            raise TypeError(f"media must be a list of Image and Video projections, not {media!r}")
        object.__setattr__(self, "media", tuple(media))
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, not {self.on_error!r}")
        if isinstance(self.filter, str):
            from spiral_lightning.filters import parse

            parse(self.filter)

    @property
    def scheme(self) -> str:
        """The backend that reads the table: the part of the uri before the first colon."""
        return self.uri.split(":", 1)[0]

    def resolve(self) -> TableSpec:
        """This spec pinned to one exact version, so every process reads the same rows."""
        from spiral_lightning.sources import resolve

        return resolve(self)

    @property
    def version(self) -> str:
        """The exact version a resolved spec names; ``ValueError`` for an unresolved one."""
        from spiral_lightning.sources import version_of

        return version_of(self)


def as_spec(table: TableSpec | str) -> TableSpec:
    """A spec for ``table``, which may be a spec or a bare uri."""
    return table if isinstance(table, TableSpec) else TableSpec(table)
