"""Tokens per second of ``PackedDataset`` against a raw scan of the same token column flattened to
one numpy array, the floor no packer can beat, and against LitData's ``TokensLoader`` approach.

Run ``.venv/bin/python benchmarks/packing.py`` (``--tokens 10000000`` for a quick look). The table
is a local Spiral table of documents of 1 to 2,000 int32 token ids (uniform, so about 1,000 on
average) holding ``--tokens`` tokens, in splits of ``--split-rows`` documents. Every path reads
the same column in process and delivers every token once:

- *raw scan*: spiral-sdk's ``Scan.to_reader()`` of the column, each read batch's values viewed as
  numpy (no copy), then joined into one flat array: reading and flattening, nothing more.
- *TokensLoader approach*: what LitData's ``TokensLoader`` does (flat tokens, then blocks): the
  raw scan's flat array cut into ``[length]`` blocks as int64 and handed out in batches of
  ``--batch-size`` blocks. LitData itself is not installed here (its streaming format would also
  need its own copy of the data), so this is the approach in numpy, on the same scan.
- ``PackedDataset``: blocks of ``--length`` tokens and their positions (both int64), resumable
  mid-document: with its defaults (no separator, reading ahead), in line (``read_ahead=0``), and
  with a separator token after each document (``separator=0``), which costs one more pass that
  places the separators.

Tokens/s counts the tokens delivered in blocks; the ratio is against the raw scan (target:
``PackedDataset`` with its defaults at least 0.7x). Each path is timed ``--repeats`` times, best
run kept.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import spiral
import torch

from spiral_lightning import PackedDataset, TableSpec, write_table

#: The ratio of ``PackedDataset``'s tokens/s to the raw scan's it must reach.
TARGET = 0.7
#: The separator token the separator path puts after each document.
SEPARATOR = 0


def documents(tokens: int, split_rows: int, seed: int = 0) -> Iterator[pa.RecordBatch]:
    """Documents of 1..2,000 random token ids holding about ``tokens`` tokens, one split at a time."""
    generator = np.random.default_rng(seed)
    written = 0
    while written < tokens:
        lengths = generator.integers(1, 2001, split_rows)
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
        values = generator.integers(1, 50_000, int(offsets[-1]), dtype=np.int32)
        written += int(offsets[-1])
        yield pa.record_batch({"tokens": pa.LargeListArray.from_arrays(offsets, values)})


def open_table(spec: TableSpec) -> spiral.Table:
    """The Spiral table version ``spec`` names, opened with spiral-sdk alone."""
    resource_id, version_id = spec.version.split("@")
    root = spec.uri.split(":", 1)[1].split("?", 1)[0]
    return spiral.Client.local().local_table(root, resource_id, version_id)


def raw_flat(table: spiral.Table) -> np.ndarray:
    """The raw scan: every read batch's token values as numpy, joined into one array."""
    parts = []
    for batch in table.scan(["tokens"]).to_reader():
        lists = batch.column(0)
        offsets = lists.offsets.to_numpy()
        parts.append(lists.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0])).to_numpy())
    return np.concatenate(parts)


def tokens_loader(table: spiral.Table, length: int, batch_size: int) -> int:
    """LitData's approach on the raw scan: flat tokens, then ``[length]`` int64 blocks in batches."""
    flat = raw_flat(table)
    blocks = flat[: len(flat) // length * length].astype(np.int64).reshape(-1, length)
    delivered = 0
    for start in range(0, len(blocks), batch_size):
        delivered += torch.from_numpy(blocks[start : start + batch_size]).numel()
    return delivered


def packed(dataset: PackedDataset) -> int:
    return sum(batch["tokens"].numel() for batch in dataset)


def best(path: Callable[[], int], repeats: int) -> tuple[float, int]:
    """The fastest of ``repeats`` passes, in seconds, and the tokens one pass delivers."""
    times = []
    delivered = 0
    for _ in range(repeats):
        began = time.perf_counter()
        delivered = path()
        times.append(time.perf_counter() - began)
    return min(times), delivered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=50_000_000, help="tokens in the table (about)")
    parser.add_argument("--split-rows", type=int, default=5_000, help="documents per split")
    parser.add_argument("--length", type=int, default=2048, help="tokens per block")
    parser.add_argument("--batch-size", type=int, default=8, help="blocks per batch")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "corpus"
        schema = pa.schema({"tokens": pa.large_list(pa.int32())})
        reader = pa.RecordBatchReader.from_batches(schema, documents(args.tokens, args.split_rows))
        spec = write_table(f"spiral:{root}", reader, split_rows=args.split_rows)
        table = open_table(spec)
        total = len(raw_flat(table))
        options = {"column": "tokens", "length": args.length, "batch_size": args.batch_size}
        defaults = PackedDataset(spec, **options)
        in_line = PackedDataset(spec, **options, read_ahead=0)
        separated = PackedDataset(spec, **options, separator=SEPARATOR)
        paths: dict[str, Callable[[], int]] = {
            "raw scan, flattened to one numpy array": lambda: len(raw_flat(table)),
            "TokensLoader approach (flat tokens, then blocks)": lambda: tokens_loader(
                table, args.length, args.batch_size
            ),
            "`PackedDataset`": lambda: packed(defaults),
            "`PackedDataset(read_ahead=0)`": lambda: packed(in_line),
            f"`PackedDataset(separator={SEPARATOR})`": lambda: packed(separated),
        }
        rates = {}
        for name, path in paths.items():
            seconds, delivered = best(path, args.repeats)
            rates[name] = delivered / seconds
        raw = rates["raw scan, flattened to one numpy array"]
        print(
            f"{total:,} tokens in documents of 1-2,000 tokens, splits of {args.split_rows:,} documents; blocks of "
            f"{args.length} tokens, {args.batch_size} a batch; best of {args.repeats}\n"
        )
        print("| path | tokens/s | vs raw scan |")
        print("| --- | ---: | ---: |")
        for name, rate in rates.items():
            print(f"| {name} | {rate:,.0f} | {rate / raw:.2f}x |")
        ours = rates["`PackedDataset`"]
        verdict = "met" if ours >= TARGET * raw else "NOT met"
        print(f"\ntarget PackedDataset >= {TARGET}x the raw scan: {ours / raw:.2f}x, {verdict}")


if __name__ == "__main__":
    main()
