"""Writing a Parquet table: one new file of row groups of ``split_rows``, every page with its CRC."""

from __future__ import annotations

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from spiral_lightning.core.spec import TableSpec
from spiral_lightning.core.storage import StorageOptions
from spiral_lightning.sources.chunks import ArrowData, as_reader, chunks
from spiral_lightning.sources.parquet_files import locate_table, remote_error, resolve


def write(uri: str, data: ArrowData, split_rows: int, storage_options: StorageOptions | None = None) -> TableSpec:
    """Write ``data`` into a new folder (a new prefix of an object store) as one Parquet file with
    row groups of ``split_rows``. Each page carries a CRC of its bytes (``write_page_checksum``),
    which every read of the table checks: a damaged page fails instead of reading as wrong rows."""
    spec = TableSpec(uri, storage_options=storage_options)
    location = locate_table(spec)
    filesystem, path = location.filesystem, location.path
    try:
        info = filesystem.get_file_info(path)
        occupied = info.type == pafs.FileType.File or (
            info.type == pafs.FileType.Directory and bool(filesystem.get_file_info(pafs.FileSelector(path)))
        )
    except OSError as error:
        if location.remote:
            raise remote_error(spec, "looking at the destination", error) from error
        raise
    if occupied:
        raise FileExistsError(f"{path!r} is not an empty folder; write_table never overwrites, pick a new folder")
    if not location.remote:
        # An object store has no folders: the file's key makes its prefix.
        filesystem.create_dir(path, recursive=True)
    reader = as_reader(data)
    try:
        with (
            filesystem.open_output_stream(f"{path}/part-00000.parquet") as sink,
            pq.ParquetWriter(sink, reader.schema, write_page_checksum=True) as writer,
        ):
            for chunk in chunks(reader, split_rows):
                writer.write_table(chunk, row_group_size=split_rows)
    except OSError as error:
        if location.remote:
            raise remote_error(spec, "writing the table", error) from error
        raise
    return resolve(spec)
