"""TableSpec: a small picklable value naming a table version and the options of its scan."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple

from spiral_lightning.core import storage
from spiral_lightning.core.backends import backend
from spiral_lightning.core.checks import check_positive
from spiral_lightning.core.media import ON_ERROR, Image, OnError, Video
from spiral_lightning.core.secrets import has_password, masking
from spiral_lightning.core.sequences import Padded
from spiral_lightning.core.storage import StorageOptions, masked

#: Row groups a Parquet pass fetches ahead from an object store by default (see ``TableSpec``).
DEFAULT_PREFETCH = 4


class FileVersion(NamedTuple):
    """One file of a pinned file-backed version: its path, size, modification time, the rows of
    each of its row groups, and the entity tag an object store gave it ("" when it gives none)."""

    path: str
    size: int
    mtime_ns: int
    row_groups: tuple[int, ...]
    etag: str = ""


@dataclass(frozen=True)
class TableSpec:
    """A table and how to scan it, cheap to pickle and to write in YAML.

        spec = TableSpec("spiral:data/photos", columns=["label", "image"], filter="label < 2")
        pinned = spec.resolve()  # the same exact version in every process that reads it
        TableDataset(pinned, batch_size=64)  # or SpiralDataModule(train=pinned), read_table(pinned)

    ``uri`` names the table: ``spiral:<local root>`` (ids read from the file ``write_table``
    leaves in the root), ``spiral:<root>?resource_id=..&version_id=..``,
    ``spiral://<project>/<path>[@v<version>]`` for a remote Spiral table,
    ``parquet:<file | folder | glob>`` on any filesystem pyarrow opens, or ``sds:<root>`` for a
    published signal-dataset snapshot. A Parquet path may be an object-store uri
    (``parquet:s3://bucket/prefix``, ``gs://``, ``abfs://``), reached with ``storage_options``
    (``aws_endpoint``, ``aws_access_key_id``, ``aws_secret_access_key``, ...) and, for every key
    not given, the store's standard environment; secrets are masked in the spec's ``repr`` and
    never enter a version, state or fingerprint. ``columns`` selects
    columns (all when ``None``). ``filter`` keeps the rows it holds for: text in the filter
    language (``"label < 5 AND name LIKE 'cat%'"``, the same meaning on every backend) or the
    backend's native expression (``spiral.Expression``, ``pyarrow.compute.Expression``).

    ``resolve`` pins the spec to the exact version that every process then reads: the ids in a
    Spiral uri, or the ``files`` of a Parquet version (set by ``resolve``, never by hand).

    ``media`` decodes encoded columns (binary, or Spiral blobs) into tensors: ``Image`` and
    ``Video`` projections. A row that cannot be decoded raises, naming the table, column and row;
    with ``on_error="skip"`` it is dropped instead and counted.

    A Parquet pass keeps ``prefetch`` row groups of an object store in flight at once, each
    fetched as a few coalesced range reads on a small pool of threads. With ``cache_dir`` (and
    its budget ``cache_bytes``) the bytes fetched are kept in that local folder, least recently
    used dropped first, so later passes over the same version read local disk.

    With ``decoded_cache_dir`` (and its budget ``decoded_cache_bytes``) each work item a pass
    reads whole is kept in that local folder decoded, as uncompressed Arrow, and later passes
    read it from there instead of decoding the table again (any backend; the filter must be
    text). It costs the uncompressed size of the rows on disk and saves the decoding CPU of every
    pass after the first.

    Numeric, boolean and fixed-size-list columns always become tensors, so their nulls need a
    decision: ``null_fill`` gives the value a column's nulls become, and each column of
    ``null_mask`` also gets a ``[rows]`` bool tensor ``<column>_valid``, True where the row has a
    value (0 / False in its null rows unless filled). A null in any other such column raises,
    naming the column and row; the datasets refuse unknown columns when they are built.

    ``padded`` turns ragged columns (a list of numbers per row, of any length) into one padded
    tensor per batch and each row's length (see ``Padded``), where the rows become tensors.
    """

    uri: str
    columns: tuple[str, ...] | None = None
    filter: Any = None
    files: tuple[FileVersion, ...] | None = None
    media: tuple[Image | Video, ...] = ()
    on_error: OnError = "raise"
    storage_options: Mapping[str, Any] | None = None
    cache_dir: str | None = None
    cache_bytes: int | None = None
    decoded_cache_dir: str | None = None
    decoded_cache_bytes: int | None = None
    prefetch: int = DEFAULT_PREFETCH
    null_fill: Mapping[str, int | float | bool] | None = None
    null_mask: tuple[str, ...] = ()
    padded: tuple[Padded, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.uri, str) or ":" not in self.uri:
            shown = masked(self.uri) if isinstance(self.uri, str) else self.uri
            raise ValueError(f"a table uri looks like 'spiral:<root>', 'parquet:<path>' or 'sds:<root>', not {shown!r}")
        if has_password(self.uri):
            raise ValueError(
                f"{masked(self.uri)!r} carries credentials; a uri is copied into specs, logs and checkpoints, so give "
                "them as storage_options or in the environment (spiral-sdk's own configuration for spiral://)"
            )
        if self.scheme == "parquet":
            storage.parse(self.uri[len("parquet:") :])
        if self.storage_options is not None:
            object.__setattr__(self, "storage_options", StorageOptions(self.storage_options) or None)
        if self.scheme != "parquet" and (self.storage_options or self.cache_dir is not None):
            raise ValueError(
                f"storage_options and cache_dir apply to Parquet tables, not {masked(self.uri)!r}: Spiral reaches its "
                "stores through spiral-sdk's own configuration, and SDS snapshots are local folders"
            )
        _check_cache("cache_dir", self.cache_dir, "cache_bytes", self.cache_bytes)
        _check_cache("decoded_cache_dir", self.decoded_cache_dir, "decoded_cache_bytes", self.decoded_cache_bytes)
        if self.decoded_cache_dir is not None and not isinstance(self.filter, str | None):
            raise ValueError(
                f"decoded_cache_dir needs the filter as text (the filter language), not {type(self.filter).__name__}: "
                "a cache entry is named by the filter, and a native expression has no stable name"
            )
        check_positive("prefetch", self.prefetch, "row groups in flight")
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
            from spiral_lightning.core.filters import parse

            parse(self.filter)
        if self.null_fill is not None:
            fill: Any = self.null_fill
            if not isinstance(fill, Mapping) or not all(
                isinstance(name, str) and isinstance(value, int | float) for name, value in fill.items()
            ):
                raise TypeError(f"null_fill must map column names to numbers or bools, not {fill!r}")
            object.__setattr__(self, "null_fill", dict(fill) or None)
        mask: Any = self.null_mask
        if isinstance(mask, str) or not isinstance(mask, Sequence) or not all(isinstance(name, str) for name in mask):
            raise TypeError(f"null_mask must be a list of column names, not {mask!r}")
        object.__setattr__(self, "null_mask", tuple(mask))
        padded: Any = self.padded
        if isinstance(padded, Padded) or not all(isinstance(item, Padded) for item in padded):
            raise TypeError(f"padded must be a list of Padded projections, not {padded!r}")
        columns = [item.column for item in padded]
        if len(set(columns)) < len(columns):
            raise ValueError(f"padded names a column more than once: {columns}; give each column one Padded")
        object.__setattr__(self, "padded", tuple(padded))

    def __repr__(self) -> str:
        """The fields as a dataclass shows them, but the uri ``masked``: a secret in the query of a
        ``spiral:`` or ``sds:`` uri is refused only when the spec is resolved, and a spec is logged
        and printed before that."""
        shown = (f"{field.name}={getattr(self, field.name)!r}" for field in fields(self) if field.name != "uri")
        return f"{type(self).__name__}(uri={masked(self.uri)!r}, {', '.join(shown)})"

    @property
    def scheme(self) -> str:
        """The backend that reads the table: the part of the uri before the first colon."""
        return self.uri.split(":", 1)[0]

    def resolve(self) -> TableSpec:
        """This spec pinned to one exact version, so every process reads the same rows."""
        with masking(self.uri):  # whatever a backend says of the uri, its secrets stay out
            resolved: TableSpec = backend(self.uri).resolve(self)
        return resolved

    @property
    def version(self) -> str:
        """The exact version a resolved spec names; ``ValueError`` for an unresolved one."""
        with masking(self.uri):
            return backend(self.uri).version(self)


def _check_cache(folder_name: str, folder: str | None, budget_name: str, budget: int | None) -> None:
    """``ValueError`` unless a cache's folder and byte budget are given together, the budget positive."""
    if (folder is None) != (budget is None):
        raise ValueError(f"{folder_name} and {budget_name} go together: a cache folder and its budget in bytes")
    if budget is not None:
        check_positive(budget_name, budget)


def as_spec(table: TableSpec | str, storage_options: Mapping[str, Any] | None = None) -> TableSpec:
    """A spec for ``table``, which may be a spec or a bare uri, reached with ``storage_options``
    when given (a spec that has options of its own must have the same)."""
    spec = table if isinstance(table, TableSpec) else TableSpec(table)
    if storage_options is None:
        return spec
    options = StorageOptions(storage_options)
    if spec.storage_options is not None and spec.storage_options != options:
        raise ValueError(
            f"the table {masked(spec.uri)!r} has its own storage_options {spec.storage_options!r}, not {options!r}"
        )
    return replace(spec, storage_options=options)


def with_selection(spec: TableSpec, columns: Sequence[str] | None, filter: Any) -> TableSpec:
    """``spec`` reading ``columns`` and ``filter`` (``None``: its own), which must not contradict
    the columns and filter it already has."""
    if columns is not None:
        if spec.columns is not None and spec.columns != tuple(columns):
            raise ValueError(
                f"the table {masked(spec.uri)!r} selects its own columns {list(spec.columns)}, not {list(columns)}"
            )
        spec = replace(spec, columns=tuple(columns))
    if filter is not None:
        # Identity, not equality: spiral expressions overload == to build a new expression.
        if spec.filter is not None and spec.filter is not filter:
            raise ValueError(f"the table {masked(spec.uri)!r} has its own filter {spec.filter}, not {filter}")
        spec = replace(spec, filter=filter)
    return spec


def narrowed(spec: TableSpec, columns: Sequence[str] | None, where: str) -> TableSpec:
    """``spec`` reading exactly ``columns`` (``None``: its own), which must be among the columns
    it selects; ``ValueError`` naming ``where`` and the missing column otherwise."""
    if columns is None:
        return spec
    if spec.columns is not None:
        for name in columns:
            if name not in spec.columns:
                raise ValueError(
                    f"{where} ({masked(spec.uri)}) lacks the column {name!r}: its spec selects {list(spec.columns)}"
                )
    return replace(spec, columns=tuple(columns))
