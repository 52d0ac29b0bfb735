"""Decoded rows kept on local disk: a source whose work items, once read whole, are read again from
a local folder of uncompressed Arrow instead of being fetched and decoded each pass.

Decoding is most of a pass's cost on a local table with compressed columns: a Parquet column of
fixed-size lists is rebuilt from its repetition levels row by row, at about a tenth of a second of
one core per million 16-float rows, every epoch. An entry holds one work item's read batches as
the source returned them (after the filter, with the backend's own media decoding) in Arrow's IPC
format, with the stored row after each batch, so a pass read from entries yields the same batches
and the same resume positions as one read from the table. Entries are named by the version, the
read's settings and the item, so a changed table or setting never reads another's rows; the
folder is a ``ByteCache`` (a byte budget, least recently used dropped first) that every process of
a job may share.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from spiral_lightning.core.plan import Plan, WorkItem
from spiral_lightning.core.spec import TableSpec
from spiral_lightning.sources.cache import ByteCache
from spiral_lightning.sources.damage import damaged
from spiral_lightning.sources.protocol import ReadBatch, Source, Take

#: The key of a kept batch's own metadata that holds the stored row after it.
_NEXT_ROW = "next_row"
#: What a damaged entry's ``DamagedData`` says to do: the entry is dropped as it is raised.
_RESTART = "the entry was dropped: resume from the last state, and the item is read from the table again"


class DecodedCache:
    """``source`` with each work item it reads whole kept in ``cache``, decoded, and read from there
    by later reads of the same item. Everything but ``read`` is the source's own.

        spec = TableSpec("parquet:/data/train", decoded_cache_dir="/nvme/decoded", decoded_cache_bytes=50 << 30)
        dataset = TableDataset(spec, batch_size=1024)  # the first epoch fills the folder
        for batch in dataset: ...                      # later epochs read it
    """

    def __init__(self, source: Source, spec: TableSpec, cache: ByteCache) -> None:
        self.source = source
        self.cache = cache
        # What the rows of an item depend on besides the item: the version and the read's settings.
        # A native filter has no stable text, so TableSpec accepts only filter text with this cache.
        self._read = (source.version, str(source.schema), spec.filter, spec.media, spec.on_error)
        self._uri = spec.uri

    @property
    def version(self) -> str:
        return self.source.version

    @property
    def schema(self) -> pa.Schema:
        return self.source.schema

    @property
    def decoded(self) -> frozenset[str]:
        return self.source.decoded

    @property
    def splits(self) -> Plan:
        return self.source.splits

    @property
    def fetches_ahead(self) -> bool:
        """The source's own answer: a pass with every item kept never fetches, and reads alike
        on one thread or several."""
        return bool(getattr(self.source, "fetches_ahead", False))

    def count(self, items: Sequence[WorkItem]) -> list[int]:
        return self.source.count(items)

    def kept(self, split: int) -> np.ndarray:
        return self.source.kept(split)

    def take(self, takes: Sequence[Take]) -> pa.Table:
        return self.source.take(takes)

    def key(self, item: WorkItem) -> str:
        """The entry name of ``item``'s rows under this source's version and settings."""
        return ByteCache.key(*self._read, item.split, item.start, item.end)

    def read(self, items: Sequence[WorkItem]) -> Iterator[ReadBatch]:
        """The rows of ``items``: each kept item from its entry, each run of items not kept in one
        read of the source (a read sets up a scan), kept as it completes."""
        index = 0
        while index < len(items):
            kept = self._kept(items[index])
            if kept is not None:
                yield from self._replay(kept, index)
                index += 1
                continue
            end = index + 1
            while end < len(items) and not self.cache.has(self.key(items[end])):
                end += 1
            yield from self._read_keeping(items, index, end)
            index = end

    def _kept(self, item: WorkItem) -> _Kept | None:
        """The entry kept for ``item``, opened, or ``None``. An entry that does not open as one (cut
        short on its disk) is dropped, and the item is read from the source again."""
        key = self.key(item)
        file = self.cache.open(key)
        if file is None:
            return None
        try:
            return _Kept(key, file, pa.ipc.open_file(file))
        except ValueError:  # pyarrow's ArrowInvalid: no footer
            file.close()
            self.cache.drop(key)
            return None

    def _replay(self, kept: _Kept, index: int) -> Iterator[ReadBatch]:
        """The batches of an opened entry, read one at a time, as item ``index`` of a read. One
        that does not decode drops the entry (a restart reads the item from the source) and raises
        ``DamagedData``: the batches before it were delivered already."""
        with kept.file:
            for number in range(kept.reader.num_record_batches):
                try:
                    batch, metadata = kept.reader.get_batch_with_custom_metadata(number)
                    next_row = int(metadata[_NEXT_ROW])
                except (KeyError, TypeError, ValueError) as error:
                    self.cache.drop(kept.key)
                    where = f"batch {number} of the decoded cache's entry {kept.key} in {str(self.cache.folder)!r}"
                    raise damaged(self._uri, where, error, _RESTART) from error
                yield batch, index, next_row

    def _read_keeping(self, items: Sequence[WorkItem], first: int, end: int) -> Iterator[ReadBatch]:
        """Items ``first..end`` read from the source, each written into an entry as its batches
        come and kept once they all came; the entry of an item whose read was left is removed."""
        current = first
        entry: _Entry | None = None
        try:
            for batch, offset, next_row in self.source.read(items[first:end]):
                while first + offset > current:
                    self._keep(items[current], entry)
                    entry, current = None, current + 1
                yield batch, current, next_row
                entry = entry or _Entry(self.cache, batch.schema)
                entry.add(batch, next_row)
            # The source's read ended: every item from ``current`` on has had all its batches.
            for item in items[current:end]:
                self._keep(item, entry)
                entry = None
        finally:
            if entry is not None:
                entry.abandon()

    def _keep(self, item: WorkItem, entry: _Entry | None) -> None:
        """Keep ``entry`` as ``item``'s (an item without batches gets an entry without any)."""
        entry = entry or _Entry(self.cache, self.source.schema)
        if entry.close():
            self.cache.keep(self.key(item), entry.path)


class _Kept(NamedTuple):
    """An entry opened for reading: its name, its file and the Arrow reader over it."""

    key: str
    file: pa.OSFile
    reader: pa.ipc.RecordBatchFileReader


class _Entry:
    """One item's batches being written into a new file of ``cache``, up to its budget: an item
    larger than the whole cache is abandoned at once, not written to the end."""

    def __init__(self, cache: ByteCache, schema: pa.Schema) -> None:
        self.path = cache.temporary()
        self._room = cache.max_bytes
        self._schema = schema
        self._sink = pa.OSFile(str(self.path), "wb")
        self._writer: pa.ipc.RecordBatchFileWriter | None = pa.ipc.new_file(self._sink, schema)

    def add(self, batch: pa.RecordBatch, next_row: int) -> None:
        """Write ``batch`` and the stored row after it, unless the entry was abandoned."""
        if self._writer is None:
            return
        self._room -= batch.nbytes
        # A batch of another schema (a source may conform its batches late) is not kept either.
        if self._room < 0 or not batch.schema.equals(self._schema):
            self.abandon()
            return
        self._writer.write_batch(batch, custom_metadata={_NEXT_ROW: str(next_row)})

    def close(self) -> bool:
        """Finish the file; whether it holds the whole item (it was not abandoned)."""
        if self._writer is None:
            return False
        self._writer.close()
        self._sink.close()
        self._writer = None
        return True

    def abandon(self) -> None:
        """Stop writing and remove the file."""
        if self._writer is not None:
            self._writer = None
            self._sink.close()
        self.path.unlink(missing_ok=True)
