"""Ingest files of rows: CSV, Parquet or JSON-lines files, streamed into a new table.

``SRC`` is one file, a folder (every ``.csv``, ``.parquet``, ``.jsonl`` or ``.ndjson`` file under
it, hidden and ``_``-prefixed ones aside, in sorted path order) or a glob, of one format. The
files are read one at a time, a block at a time (``pyarrow.csv.open_csv``,
``ParquetFile.iter_batches``, ``pyarrow.json.open_json``), so memory holds a few blocks, never a
file. Their columns must agree:

- Parquet: every footer is read first and the schemas unified (``pa.unify_schemas``, permissive:
  ``int32`` with ``int64`` gives ``int64``); each batch is cast to the result with a safe cast, so
  a value the wider type cannot hold exactly fails instead of changing.
- CSV and JSON lines: column types are inferred from the first file's first block and imposed on
  every later block and file; ``column_types`` (``--column-types name=type``) sets a column's type
  instead. A JSON-lines row or file that lacks a key gives a null.

A file that does not parse, or whose columns differ, is an ``IngestError`` naming the file (and
the column, and the row when pyarrow gives it). A write that fails part way leaves nothing behind
in a local ``DEST`` (the folder is removed when the ingest made it, emptied when it was empty);
in an object store the message says to remove the part written.
"""

from __future__ import annotations

import csv
import glob
import re
import shutil
from collections.abc import Generator, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.json as pjson
import pyarrow.parquet as pq
from tqdm import tqdm  # type: ignore[import-untyped]

from spiral_lightning.core.secrets import masked
from spiral_lightning.core.spec import TableSpec
from spiral_lightning.sources.write import DEFAULT_SPLIT_ROWS, write_table

#: The formats ingest reads, by file name suffix.
FORMATS = {".csv": "csv", ".parquet": "parquet", ".jsonl": "json", ".ndjson": "json"}

#: Rows per batch read from a Parquet file.
_PARQUET_BATCH_ROWS = 65_536

_GLOB_CHARACTERS = re.compile(r"[*?\[]")
_CSV_COLUMN = re.compile(r"In CSV column #(\d+): ")


class IngestError(ValueError):
    """A file that cannot become rows of the table: one line naming the file and the fault."""


@dataclass(frozen=True)
class FilesReport:
    """What an ingest of files wrote: the table's exact version, its rows, its columns, and the
    files read, in order."""

    spec: TableSpec
    rows: int
    columns: tuple[str, ...]
    files: tuple[str, ...]


def _format_of(path: Path) -> str | None:
    return FORMATS.get(path.suffix.lower())


def find_files(src: str | Path) -> tuple[tuple[Path, ...], str]:
    """The files ``src`` names, in order, and their format (``csv``, ``parquet`` or ``json``):
    one file, every file of a known suffix under a folder, or a glob's matches."""
    text = str(src)
    path = Path(text)
    if path.is_dir():
        found = sorted(
            (
                file
                for file in path.rglob("*")
                if file.is_file()
                and _format_of(file)
                and not any(part.startswith((".", "_")) for part in file.relative_to(path).parts)
            ),
            key=lambda file: file.relative_to(path).as_posix(),
        )
        if not found:
            raise FileNotFoundError(f"the folder {text!r} holds no {', '.join(FORMATS)} file")
    elif path.is_file():
        found = [path]
    elif _GLOB_CHARACTERS.search(text):
        found = sorted(Path(match) for match in glob.glob(text, recursive=True) if Path(match).is_file())
        if not found:
            raise FileNotFoundError(f"no file matches {text!r}")
    else:
        raise FileNotFoundError(f"{text!r} is not a file, a folder or a glob that matches files")
    unknown = [str(file) for file in found if _format_of(file) is None]
    if unknown:
        raise ValueError(f"{unknown[0]!r} is not a {', '.join(FORMATS)} file; ingest rows reads only those")
    kinds: dict[str, Path] = {}
    for file in found:
        kinds.setdefault(FORMATS[file.suffix.lower()], file)
    if len(kinds) > 1:
        examples = ", ".join(f"{kind} ({str(file)!r})" for kind, file in kinds.items())
        raise ValueError(f"{text!r} holds files of {len(kinds)} formats, {examples}; ingest one format at a time")
    return tuple(found), next(iter(kinds))


def column_types(types: Mapping[str, str | pa.DataType] | None) -> dict[str, pa.DataType]:
    """``types`` with every type a pyarrow type: names such as ``int64``, ``float64``,
    ``string``, ``bool``, ``date32`` or ``timestamp[ms]`` (``pa.type_for_alias``)."""
    resolved = {}
    for name, kind in (types or {}).items():
        try:
            resolved[name] = kind if isinstance(kind, pa.DataType) else pa.type_for_alias(kind)
        except ValueError:
            raise ValueError(
                f"the type {kind!r} given to column {name!r} is not a pyarrow type name; use one such as int64, "
                "float64, string, bool, date32 or timestamp[ms]"
            ) from None
    return resolved


def _header(path: Path) -> list[str]:
    """A CSV file's column names, as pyarrow's default dialect reads them; none if unreadable."""
    try:
        with path.open(newline="", encoding="utf-8", errors="replace") as lines:
            return next(csv.reader(lines), [])
    except (OSError, csv.Error):
        return []


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _fault(path: Path, error: BaseException, names: list[str], rows: int) -> IngestError:
    """``error`` from reading ``path`` as one line: the file, the CSV column by name, and where."""
    text = _one_line(error)
    column = _CSV_COLUMN.search(text)
    if column and int(column.group(1)) < len(names):
        name = names[int(column.group(1))]
        text = _CSV_COLUMN.sub(f"in column {name!r}: ", text)
        if "conversion error" in text:
            text += (
                f"; CSV column types come from the first file's first block, so give this one its type "
                f"(--column-types {name}=<type>, or column_types=)"
            )
    elif "changed from" in text:
        text += "; a JSON-lines key needs values of one kind (number, string, ...) in every row and file"
    elif "Failed to convert JSON" in text:
        text += (
            "; JSON-lines column types come from the first file's first block, so give the column a type that holds "
            "every value (--column-types NAME=TYPE, or column_types=)"
        )
    # pyarrow numbers a JSON row within its block, and a block is the batch after the rows read.
    text, counted = re.subn(r" in row (\d+)", lambda found: f" in row {rows + int(found.group(1)) + 1:,}", text)
    where = f" (after row {rows:,})" if rows and not counted and "Row #" not in text else ""
    return IngestError(f"{path}{where}: {text}")


class _Open:
    """One file being read: its batches, and how many of its bytes are read."""

    def __init__(self, path: Path, kind: str, types: dict[str, pa.DataType], schema: pa.Schema | None) -> None:
        self.path = path
        self.size = path.stat().st_size
        self._stack = ExitStack()
        self._stream: Any = None
        self.rows = 0
        try:
            if kind == "parquet":
                self._file = self._stack.enter_context(pq.ParquetFile(path, page_checksum_verification=True))
                self.schema = self._file.schema_arrow
                self._batches: Iterator[pa.RecordBatch] = self._file.iter_batches(_PARQUET_BATCH_ROWS)
            else:
                self._stream = self._stack.enter_context(pa.OSFile(str(path)))
                reader = self._csv(types, schema) if kind == "csv" else self._json(types, schema)
                self._stack.callback(reader.close)
                self.schema = reader.schema
                self._batches = iter(reader)
        except BaseException as error:
            self._stack.close()
            if isinstance(error, pa.ArrowException | OSError):
                raise _fault(path, error, _header(path) if kind == "csv" else [], 0) from error
            raise

    def _csv(self, types: dict[str, pa.DataType], schema: pa.Schema | None) -> pa.RecordBatchReader:
        wanted = dict(types) if schema is None else dict(zip(schema.names, schema.types, strict=True))
        return pcsv.open_csv(self._stream, convert_options=pcsv.ConvertOptions(column_types=wanted))

    def _json(self, types: dict[str, pa.DataType], schema: pa.Schema | None) -> pa.RecordBatchReader:
        if schema is None and types:
            # An explicit schema puts its columns first; keep the file's order instead.
            with pa.OSFile(str(self.path)) as stream, pjson.open_json(stream) as reader:
                inferred = reader.schema
            schema = pa.schema([(field.name, types.get(field.name, field.type)) for field in inferred])
        options = pjson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="infer")
        return pjson.open_json(self._stream, parse_options=options)

    def batches(self) -> Iterator[pa.RecordBatch]:
        """The file's batches as read, each one's fault an ``IngestError`` naming the file."""
        while True:
            try:
                batch = next(self._batches, None)
            except (pa.ArrowException, OSError) as error:
                raise _fault(self.path, error, self.schema.names, self.rows) from error
            if batch is None:
                return
            self.rows += batch.num_rows
            yield batch

    def bytes_read(self) -> int:
        """The file's bytes read so far (the reader reads ahead; Parquet's by rows decoded)."""
        if self._stream is not None:
            return min(self.size, int(self._stream.tell()))
        total = self._file.metadata.num_rows
        return self.size if not total else self.size * self.rows // total

    def close(self) -> None:
        self._stack.close()


class FileRows:
    """The rows of the files ``src`` names as a stream of Arrow batches under ``schema``, with a
    progress bar of bytes read on stderr; ``rows`` counts the rows streamed."""

    def __init__(
        self, src: str | Path, types: Mapping[str, str | pa.DataType] | None = None, *, progress: bool = True
    ) -> None:
        self.files, self.kind = find_files(src)
        self.types = column_types(types)
        self.progress = progress
        self.rows = 0
        self._first: _Open | None = None
        self._pass: Generator[pa.RecordBatch, None, None] | None = None
        self.schema = self._schema()

    def _schema(self) -> pa.Schema:
        if self.kind == "parquet":
            schema = self._unified()
        else:
            self._first = _Open(self.files[0], self.kind, self.types, None)
            schema = self._first.schema
        unknown = sorted(set(self.types) - set(schema.names))
        if unknown:
            self.close()
            raise ValueError(f"column types name columns {unknown} that {self.files[0]} lacks; it has {schema.names}")
        return pa.schema([(field.name, self.types.get(field.name, field.type)) for field in schema])

    def _unified(self) -> pa.Schema:
        """Every Parquet footer's schema, unified."""
        schema: pa.Schema | None = None
        for path in self.files:
            opened = _Open(path, "parquet", {}, None)
            opened.close()
            # A type given for a column is what every file's values are cast to, so it unifies.
            found = pa.schema([(field.name, self.types.get(field.name, field.type)) for field in opened.schema])
            if schema is None:
                schema = found
                continue
            self._same_columns(path, found.names, schema.names)
            try:
                schema = pa.unify_schemas([schema, found], promote_options="permissive")
            except (pa.ArrowException, TypeError, ValueError) as error:
                raise IngestError(
                    f"{path}: its columns do not fit those of {self.files[0]}: {_one_line(error)}; cast the files "
                    "to one schema, or set the column's type (--column-types)"
                ) from error
        assert schema is not None
        return schema

    def _same_columns(self, path: Path, names: list[str], expected: list[str]) -> None:
        """Refuse a file whose column names (in any order) are not the first file's."""
        if set(names) == set(expected):
            return
        missing = [name for name in expected if name not in names]
        extra = [name for name in names if name not in expected]
        first = self.files[0]
        parts = ([f"lacks {missing}"] if missing else []) + ([f"adds {extra}"] if extra else [])
        raise IngestError(
            f"{path}: its columns {names} differ from those of {first} ({expected}): it {' and '.join(parts)}; "
            "ingest files with the same columns"
        )

    def batches(self) -> Generator[pa.RecordBatch, None, None]:
        """The rows in one pass over the files, each batch cast to ``schema``; begins it."""
        self._pass = self._read()
        return self._pass

    def close(self) -> None:
        """End the pass (and its progress bar) when a writer stops early."""
        if self._pass is not None:
            self._pass.close()
        if self._first is not None:
            self._first.close()
            self._first = None

    def _read(self) -> Generator[pa.RecordBatch, None, None]:
        sizes = [path.stat().st_size for path in self.files]
        bar = tqdm(
            total=sum(sizes),
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc="ingest rows",
            disable=not self.progress,
        )
        with bar:
            done = 0
            for index, (path, size) in enumerate(zip(self.files, sizes, strict=True)):
                opened, self._first = self._first or _Open(path, self.kind, self.types, self.schema), None
                try:
                    if index:
                        self._same_columns(path, opened.schema.names, self.schema.names)
                    for batch in opened.batches():
                        self.rows += batch.num_rows
                        yield self._cast(path, batch, opened.rows - batch.num_rows)
                        bar.update(done + opened.bytes_read() - bar.n)
                        bar.set_postfix_str(f"{self.rows:,} rows, file {index + 1}/{len(self.files)}", refresh=False)
                finally:
                    opened.close()
                done += size
                bar.update(done - bar.n)

    def _cast(self, path: Path, batch: pa.RecordBatch, before: int) -> pa.RecordBatch:
        """``batch`` under ``schema``: columns by name, a JSON-lines key the file lacks as nulls,
        each column cast safely, so a value its type cannot hold exactly fails, naming it and the
        file's rows ``before`` the batch."""
        if batch.schema.equals(self.schema):
            return batch
        columns = []
        for field in self.schema:
            index = batch.schema.get_field_index(field.name)
            column = pa.nulls(batch.num_rows, field.type) if index < 0 else batch.column(index)
            try:
                columns.append(column.cast(field.type, safe=True))
            except (pa.ArrowException, TypeError, ValueError) as error:
                where = f" (after row {before:,})" if before else ""
                raise IngestError(
                    f"{path}{where}: column {field.name!r}: {_one_line(error)}; set the column's type (--column-types)"
                ) from error
        return pa.record_batch(columns, schema=self.schema)


def check_destination(dest_uri: str) -> Path | None:
    """Refuse, before any file is read, a destination other than a Spiral or Parquet table (an SDS
    dataset holds no bytes) and a local one that is not an empty folder; the local folder, or
    ``None`` in an object store. ``write_table`` checks every destination again as it writes."""
    scheme, _, target = dest_uri.partition(":")
    if scheme not in ("spiral", "parquet"):
        raise ValueError(f"ingest writes a 'spiral:<folder>' or 'parquet:<folder>' table, not {masked(dest_uri)!r}")
    folder = target.partition("?")[0] if scheme == "spiral" else target
    if not folder or folder.startswith("//") or "://" in folder:
        return None
    path = Path(folder)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{folder!r} is not an empty folder; ingest writes a new table, give DEST a new folder")
    return path


def _clear(folder: Path, existed: bool) -> None:
    """Remove what a failed write left in ``folder``, which was empty or absent before it."""
    if not folder.exists():
        return
    if not existed:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def ingest_files(
    src: str | Path,
    dest_uri: str,
    *,
    split_rows: int = DEFAULT_SPLIT_ROWS,
    column_types: Mapping[str, str | pa.DataType] | None = None,
    progress: bool = True,
) -> FilesReport:
    """Write the rows of the CSV, Parquet or JSON-lines files ``src`` names (a file, a folder or
    a glob, one format) as a new table at ``dest_uri``, one split per ``split_rows`` rows,
    streaming. ``column_types`` sets columns' types (``{"zip": "string"}``); without it CSV and
    JSON-lines types come from the first file's first block. A file that does not parse or does
    not fit the others raises ``IngestError`` naming it, and a local ``dest_uri`` is left as it
    was (absent or empty)."""
    folder = check_destination(dest_uri)
    existed = folder is not None and folder.exists()
    rows = FileRows(src, column_types, progress=progress)
    try:
        spec = write_table(dest_uri, rows.batches(), split_rows=split_rows, schema=rows.schema)
    except BaseException as error:
        rows.close()
        if folder is not None:
            _clear(folder, existed)
            note = f"nothing was left in {dest_uri}"
        else:
            note = f"{dest_uri} may hold part of a table: remove it before ingesting again"
        if isinstance(error, IngestError):
            error.args = (f"{error}; {note}",)
        elif isinstance(error, Exception):
            error.add_note(note)
        raise
    rows.close()
    return FilesReport(spec, rows.rows, tuple(rows.schema.names), tuple(str(path) for path in rows.files))
