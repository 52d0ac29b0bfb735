"""The Spiral backend: exact versions of Spiral tables through spiral-sdk.

Local tables live in a folder (``spiral:<root>``) whose ids sit in ``IDS_FILE`` beside the table;
remote tables are addressed as ``spiral://<project>/<path>[@v<version>]`` and resolved once.
"""

from __future__ import annotations

import base64
import functools
import json
from collections.abc import Iterator, Sequence
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import NamedTuple
from urllib.parse import parse_qs

import numpy as np
import pyarrow as pa
import spiral

from spiral_lightning.core import filters
from spiral_lightning.core.media import Image
from spiral_lightning.core.plan import Plan, Split, WorkItem
from spiral_lightning.core.spec import TableSpec
from spiral_lightning.sources.chunks import ArrowData, as_reader, chunks
from spiral_lightning.sources.damage import located
from spiral_lightning.sources.protocol import ReadBatch, Take, refuse_storage_options

#: The file in a local table's root that names its resource and version ids.
IDS_FILE = "spiral-lightning.json"

#: Arrow input batches must stay under spiral-sdk's bounds of 1,000,000 rows and 64 MiB.
_MAX_BATCH_ROWS = 1_000_000
_MAX_BATCH_BYTES = 32 << 20

#: What spiral-sdk says of stored bytes it cannot decode or that fail their digest (measured on
#: damaged local payloads and blobs: "Table storage failed: ...", "blob digest mismatch").
_DAMAGED = ("storage failed", "digest mismatch", "corrupt")

_REMOTE = "spiral://"
_LOCAL = "spiral:"


class SpiralLocation(NamedTuple):
    """Where a Spiral table lives: a local ``root`` or a remote ``project`` and ``path``, and its
    ids when known (``None`` until resolved)."""

    root: str | None
    project: str | None
    path: str | None
    resource_id: str | None
    version_id: str | None

    @property
    def resolved(self) -> bool:
        return self.resource_id is not None and self.version_id is not None


def parse(uri: str) -> SpiralLocation:
    """The location a ``spiral:`` uri names; ``ValueError`` naming the fault otherwise."""
    if uri.startswith(_REMOTE):
        rest, _, query = uri[len(_REMOTE) :].partition("?")
        project, _, path = rest.partition("/")
        if not project or not path:
            raise ValueError(f"a remote Spiral uri looks like 'spiral://<project>/<path>[@v<version>]', not {uri!r}")
        ids = _ids(uri, query)
        return SpiralLocation(None, project, path, *ids)
    if not uri.startswith(_LOCAL):
        raise ValueError(f"{uri!r} is not a Spiral uri")
    root, _, query = uri[len(_LOCAL) :].partition("?")
    if not root:
        raise ValueError(f"a local Spiral uri looks like 'spiral:<root folder>', not {uri!r}")
    if "://" in root:
        raise ValueError(
            f"{uri!r} names a local Spiral table in {root!r}, which is not a local folder: spiral-sdk keeps local "
            "tables only in local folders (its native layer opens file:// folders alone, and a copied table no "
            "longer opens), so they cannot live in an object store; reach a remote Spiral table as "
            "'spiral://<project>/<path>', or write Parquet to the store ('parquet:s3://bucket/prefix')"
        )
    return SpiralLocation(root, None, None, *_ids(uri, query))


def _ids(uri: str, query: str) -> tuple[str | None, str | None]:
    if not query:
        return None, None
    try:
        fields = parse_qs(query, strict_parsing=True)
    except ValueError as error:
        raise ValueError(f"cannot read the query of {uri!r}: {error}") from error
    unknown = sorted(set(fields) - {"resource_id", "version_id"})
    if unknown:
        raise ValueError(f"{uri!r} has unknown query fields {unknown}; only resource_id and version_id are read")
    if set(fields) != {"resource_id", "version_id"} or any(len(v) != 1 for v in fields.values()):
        raise ValueError(f"{uri!r} must give both resource_id and version_id, once each")
    return fields["resource_id"][0], fields["version_id"][0]


def _format(location: SpiralLocation, resource_id: str, version_id: str) -> str:
    query = f"?resource_id={resource_id}&version_id={version_id}"
    if location.root is not None:
        return f"{_LOCAL}{location.root}{query}"
    address = location.path or ""
    return f"{_REMOTE}{location.project}/{address.split('@', 1)[0]}{query}"


def resolve(spec: TableSpec) -> TableSpec:
    """``spec`` with the exact ids of the version its uri names."""
    location = parse(spec.uri)
    if location.root is not None and not Path(location.root).is_absolute():
        # A pinned spec travels to processes that may run elsewhere (Ray workers run in folders
        # of their own), so a root is pinned as an absolute path.
        location = location._replace(root=str(Path(location.root).absolute()))
        if location.resolved:
            return replace(spec, uri=_format(location, location.resource_id or "", location.version_id or ""))
    if location.resolved:
        return spec
    if location.root is not None:
        resource_id, version_id = _read_ids(Path(location.root))
    else:
        table = spiral.Client().table(location.project or "", location.path or "")
        resource_id, version_id = table.resource_id, table.version_id
    return replace(spec, uri=_format(location, resource_id, version_id))


def version(spec: TableSpec) -> str:
    location = parse(spec.uri)
    if not location.resolved:
        raise ValueError(f"{spec.uri!r} names no exact version yet; call TableSpec.resolve() first")
    return f"{location.resource_id}@{location.version_id}"


@functools.cache
def _local_client() -> spiral.Client:
    """This process's client of local tables: making one costs milliseconds, and every source,
    planning's and reading's, opens its table through it."""
    return spiral.Client.local()


def _read_ids(root: Path) -> tuple[str, str]:
    if not root.is_dir():
        raise FileNotFoundError(
            f"no Spiral table at {str(root)!r}: the folder does not exist; "
            f"create one with write_table('spiral:{root}', data)"
        )
    ids_path = root / IDS_FILE
    try:
        ids = json.loads(ids_path.read_text())
        return str(ids["resource_id"]), str(ids["version_id"])
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{str(root)!r} holds no {IDS_FILE}: name the version as "
            f"'spiral:{root}?resource_id=..&version_id=..', or write the table with write_table"
        ) from None
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{str(ids_path)!r} is not a valid ids file ({error!r}); it needs resource_id and version_id"
        ) from error


def _schema_metadata(location: SpiralLocation) -> dict[bytes, bytes]:
    """The schema metadata ``write_table`` kept beside a local table of this version, if any."""
    if location.root is None:
        return {}
    try:
        ids = json.loads((Path(location.root) / IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if ids.get("version_id") != location.version_id:
        return {}
    saved = ids.get("schema_metadata") or {}
    return {base64.b64decode(key): base64.b64decode(value) for key, value in saved.items()}


def _native_filter(condition: object, schema: pa.Schema) -> spiral.Expression | None:
    """The Spiral expression for a spec's filter: compiled from text, or given natively."""
    if condition is None or isinstance(condition, spiral.Expression):
        return condition
    if isinstance(condition, str):
        return filters.to_spiral(filters.parse(condition), schema, condition)
    raise TypeError(
        f"a Spiral table's filter is filter-language text or a spiral.Expression, not {type(condition).__name__}"
    )


#: The Arrow extension of Spiral's blob columns, whose payloads live in their own objects.
_BLOB = "spql.Blob"


#: The Arrow extension of Spiral's decoded-image columns (RGB pixels with their width and height).
_PIXELS = "spql.Image"
#: Image projections a Spiral scan can make itself, by (layout, dtype, normalize): its to_tensor
#: layout and normalization names.
_SCAN_TENSORS = {
    ("CHW", "float32", "unit"): ("chw", "unit"),
    ("CHW", "float32", "imagenet"): ("chw", "imagenet"),
    ("HWC", "uint8", None): ("hwc", "none"),
}


def _is_extension(field: pa.Field, name: str) -> bool:
    """Whether ``field`` is of extension ``name``, with ``spiral.types`` imported (a registered
    extension type) or not (the extension's name in the field's metadata)."""
    if isinstance(field.type, pa.BaseExtensionType):
        return bool(field.type.extension_name == name)
    return (field.metadata or {}).get(b"ARROW:extension:name") == name.encode()


def _pixels(name: str, image: Image) -> spiral.Expression:
    """The scan's own resize and to-tensor of the pixel column ``name``, as ``image`` asks."""
    try:
        layout, normalize = _SCAN_TENSORS[(image.layout, image.dtype, image.normalize)]
    except KeyError:
        supported = [f"layout={a!r}, dtype={b!r}, normalize={c!r}" for a, b, c in _SCAN_TENSORS]
        raise ValueError(
            f"column {name!r} holds decoded pixels, which the scan turns into tensors as {supported} only, not "
            f"layout={image.layout!r}, dtype={image.dtype!r}, normalize={image.normalize!r}"
        ) from None
    pixels = spiral.column(name)
    if image.size is not None:
        # The size is (height, width); Spiral's resize takes width first.
        height, width = image.size
        pixels = spiral.call(
            "spql.image.resize",
            pixels,
            spiral.literal(width, "u32"),
            spiral.literal(height, "u32"),
            spiral.literal("bilinear"),
        )
    return spiral.call("spql.image.to_tensor", pixels, spiral.literal(layout), spiral.literal(normalize))


def _projection(
    schema: pa.Schema, columns: Sequence[str], images: dict[str, Image]
) -> dict[str, spiral.Expression] | None:
    """The selected columns with what the scan computes itself: each blob column's payload bytes
    (a blob reference is of no use to a training loop, and the scan reads payloads in bulk) and
    each pixel column's image projection (resized and made a tensor inside the scan, far faster
    than in Python). ``None`` when there is none, so plain scans keep their column selection."""
    blobs = {name for name in columns if _is_extension(schema.field(name), _BLOB)}
    if not blobs and not images:
        return None
    projection = {}
    for name in columns:
        if name in images:
            projection[name] = _pixels(name, images[name])
        elif name in blobs:
            projection[name] = spiral.call("spql.io.read_bytes", spiral.column(name))
        else:
            projection[name] = spiral.column(name)
    return projection


class SpiralSource:
    """One Spiral table version opened for a scan with the spec's columns and filter."""

    def __init__(self, spec: TableSpec) -> None:
        location = parse(spec.uri)
        if not location.resolved:
            raise ValueError(f"{spec.uri!r} names no exact version yet; call TableSpec.resolve() first")
        self._uri = spec.uri
        self._version = version(spec)
        table, schema = self._open_table(location)
        self._filter = _native_filter(spec.filter, schema)
        if spec.columns is not None:
            unknown = [name for name in spec.columns if name not in schema.names]
            if unknown:
                raise ValueError(f"unknown columns {unknown} in {spec.uri!r}; the table has {schema.names}")
        self._selected = list(spec.columns or schema.names)
        pixels = {image.column: image for image in spec.media if isinstance(image, Image)}
        # A projection of a column the scan does not return is named by open_source, not here.
        self._decoded = frozenset(
            name for name in pixels if name in self._selected and _is_extension(schema.field(name), _PIXELS)
        )
        self._projection = _projection(schema, self._selected, {name: pixels[name] for name in self._decoded})
        try:
            self._scan = table.scan(self._columns(), projection=self._projection, filter=self._filter)
        except spiral.SpiralError as error:
            reason = str(error).split("\n", 1)[0]
            raise ValueError(f"the filter {spec.filter} cannot scan {spec.uri!r}: {reason}") from error
        self._metadata = _schema_metadata(location)
        self._splits = Plan(
            Split(index, split.start, split.end, split.estimated_rows) for index, split in enumerate(self._scan.splits)
        )

    def _columns(self) -> list[str] | None:
        """The columns a scan selects by name: none when the blob projection names them all."""
        return None if self._projection else self._selected

    @staticmethod
    def _open_table(location: SpiralLocation) -> tuple[spiral.Table, pa.Schema]:
        """The table of ``location`` and its schema (read once: each read costs a millisecond)."""
        resource_id, version_id = location.resource_id or "", location.version_id or ""
        if location.root is None:
            table = spiral.Client().table_by_id(resource_id, version_id)
            return table, table.schema()
        root = Path(location.root)
        if not root.is_dir():
            raise FileNotFoundError(f"no Spiral table at {str(root)!r}: the folder does not exist")
        try:
            table = _local_client().local_table(root, resource_id, version_id)
            schema = table.schema()
        except (spiral.SpiralError, ValueError) as error:
            raise ValueError(
                f"cannot open version {resource_id}@{version_id} of the Spiral table at {str(root)!r}: {error}; "
                f"check the ids (the table's own are in {IDS_FILE})"
            ) from error
        return table, schema

    @property
    def version(self) -> str:
        return self._version

    @property
    def schema(self) -> pa.Schema:
        return self._scan.schema.with_metadata(self._metadata) if self._metadata else self._scan.schema

    @property
    def decoded(self) -> frozenset[str]:
        return self._decoded

    @property
    def splits(self) -> Plan:
        return self._splits

    def read(self, items: Sequence[WorkItem]) -> Iterator[ReadBatch]:
        reads = self._scan.read_work([spiral.WorkItem(*item) for item in items])
        return located(reads, items, self._uri, (spiral.SpiralError, pa.ArrowInvalid, OSError), _DAMAGED)

    def count(self, items: Sequence[WorkItem]) -> list[int]:
        return self._scan.count_rows([spiral.WorkItem(*item) for item in items])

    def take(self, takes: Sequence[Take]) -> pa.Table:
        if self._filter is None:
            return self._scan.take([spiral.Take(split, positions) for split, positions in takes])
        return self._unfiltered.take(takes)

    def kept(self, split: int) -> np.ndarray:
        return self._splits.row_numbers(split) if self._filter is None else self._unfiltered.kept(split)

    @cached_property
    def _unfiltered(self) -> _KeptRows:
        """What filtered takes read through, opened on the first one: spiral-sdk takes no
        positions from a filtered scan."""
        if self._filter is None:
            raise ValueError(f"the scan of {self._uri!r} has no filter; it takes positions itself")
        table, _ = self._open_table(parse(self._uri))
        rows = table.scan(self._columns(), projection=self._projection)
        return _KeptRows(table, rows, self._filter, self._scan.splits)


class _KeptRows:
    """Positions of a filtered scan taken from an unfiltered scan of the same version.

    A kept row is a stored row the filter holds for; position ``p`` of a filtered split is its
    ``p``-th kept row. The filter prunes splits, so a filtered split is found in the unfiltered
    plan by its fragment and stored rows, never by its index. Each split's kept rows are found
    once, on its first take, by evaluating the filter as the only projected column, which reads
    only the filter's columns.
    """

    def __init__(
        self, table: spiral.Table, rows: spiral.Scan, condition: spiral.Expression, splits: Sequence[spiral.Split]
    ) -> None:
        self._rows = rows
        self._keys = table.scan(projection={"keep": condition})
        self._splits = list(splits)
        self._in_rows = [_containing(self._rows.splits, split) for split in self._splits]
        self._in_keys = [_containing(self._keys.splits, split) for split in self._splits]
        self._kept: dict[int, np.ndarray] = {}

    def take(self, takes: Sequence[Take]) -> pa.Table:
        return self._rows.take([self._stored(split, positions) for split, positions in takes])

    def _stored(self, split: int, positions: Sequence[int]) -> spiral.Take:
        """The take of the unfiltered scan that reads ``positions`` of filtered ``split``."""
        wanted = np.asarray(positions, dtype=np.int64)
        kept = self.kept(split)
        if wanted.size and (wanted.min() < 0 or wanted.max() >= kept.size):
            outside = int(wanted[(wanted < 0) | (wanted >= kept.size)][0])
            raise IndexError(
                f"position {outside} is outside split {split} of the filtered scan, which keeps {kept.size} rows"
            )
        index, start = self._in_rows[split]
        return spiral.Take(index, (kept[wanted] - start).tolist())

    def kept(self, split: int) -> np.ndarray:
        """The stored rows (fragment row numbers) of filtered ``split`` that the filter keeps."""
        if split not in self._kept:
            index, _ = self._in_keys[split]
            planned = self._splits[split]
            keep = [
                batch.column(0)
                for batch, _, _ in self._keys.read_work([spiral.WorkItem(index, planned.start, planned.end)])
            ]
            # A filter that is null for a row drops it, as the filtered scan does.
            mask = pa.chunked_array(keep, pa.bool_()).fill_null(False).to_numpy()
            self._kept[split] = np.flatnonzero(mask) + planned.start
        return self._kept[split]


def _containing(plan: Sequence[spiral.Split], split: spiral.Split) -> tuple[int, int]:
    """The index and first stored row of the split of ``plan`` that holds every stored row of
    ``split``, a split of another scan of the same version."""
    for index, candidate in enumerate(plan):
        if candidate.fragment == split.fragment and candidate.start <= split.start and split.end <= candidate.end:
            return index, candidate.start
    raise ValueError(f"no split of the unfiltered scan holds fragment {split.fragment} rows {split.start}..{split.end}")


def write(uri: str, data: ArrowData, split_rows: int, storage_options: object = None) -> TableSpec:
    """Write ``data`` as the first version of a new local table, one split per ``split_rows`` rows,
    and return the spec of that exact version."""
    refuse_storage_options(uri, storage_options)
    location = parse(uri)
    if location.root is None or location.resolved:
        raise ValueError(f"write_table writes a new local table, named 'spiral:<empty folder>', not {uri!r}")
    root = Path(location.root)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise FileExistsError(f"{str(root)!r} is not an empty folder; write_table never overwrites, pick a new root")
    root.mkdir(parents=True, exist_ok=True)
    reader = as_reader(data)
    writer = _local_client().create_local_table(root, reader.schema)
    for split in chunks(reader, split_rows):
        writer.append(_bounded(split))
    table = writer.finish()
    ids = {
        "resource_id": table.resource_id,
        "version_id": table.version_id,
        # Local Spiral tables keep no schema metadata (class names, for one), so it lives here.
        "schema_metadata": {
            base64.b64encode(key).decode(): base64.b64encode(value).decode()
            for key, value in (reader.schema.metadata or {}).items()
        },
    }
    (root / IDS_FILE).write_text(json.dumps(ids))
    return TableSpec(_format(location, table.resource_id, table.version_id))


def _bounded(table: pa.Table) -> pa.Table:
    """``table`` in chunks within spiral-sdk's input bounds."""
    row_bytes = max(1, table.nbytes // max(1, table.num_rows))
    chunk = max(1, min(_MAX_BATCH_ROWS, _MAX_BATCH_BYTES // row_bytes))
    return pa.Table.from_batches(table.to_batches(max_chunksize=chunk), schema=table.schema)


def open(spec: TableSpec) -> SpiralSource:  # the backend registry's name for it
    """A source of the version ``spec`` pins, in this process."""
    return SpiralSource(spec)
