"""Tokens per second of ``PackedDataset`` against a raw scan of the same token column flattened to
one numpy array, the floor no packer can beat, and against LitData's ``TokensLoader``.

Run ``.venv/bin/python benchmarks/packing.py`` (``--tokens 10000000`` for a quick look). The table
is a local Spiral table of documents of 1 to 2,000 int32 token ids (uniform, so about 1,000 on
average) holding ``--tokens`` tokens, in splits of ``--split-rows`` documents. Every path reads
the same column in process and delivers every token once:

- *raw scan*: spiral-sdk's ``Scan.to_reader()`` of the column, each read batch's values viewed as
  numpy (no copy), then joined into one flat array: reading and flattening, nothing more.
- *LitData*: LitData's own ``StreamingDataset`` with ``TokensLoader(block_size=length)`` and its
  ``StreamingDataLoader`` in batches of ``--batch-size`` blocks, in process, over its own copy of
  the same documents written once by ``litdata.optimize`` (timed apart: the copy is the price of
  its speed). It yields the stored int32 ids and no positions, and resumes by whole blocks.
  Measured only when ``litdata`` imports: it is no dependency of this project, since its
  requirements pull a CUDA build of torch. Install it beside the project without them::

      .venv/bin/pip install --no-deps --target benchmarks/.peers litdata==0.2.76 boto3 botocore \
          s3transfer jmespath six tifffile obstore
      PYTHONPATH=benchmarks/.peers .venv/bin/python benchmarks/packing.py

- *TokensLoader approach*: what ``TokensLoader`` does (flat tokens, then blocks), in numpy on the
  raw scan: its flat array cut into ``[length]`` blocks as int64 and handed out in batches of
  ``--batch-size`` blocks, without a copy of the data.
- ``PackedDataset``: blocks of ``--length`` tokens and their positions (both int64), resumable
  mid-document: with its defaults (no separator, reading ahead), in line (``read_ahead=0``), and
  with a separator token after each document (``separator=0``), which costs one more pass that
  places the separators.

Tokens/s counts the tokens delivered in blocks; the ratio is against the raw scan (target:
``PackedDataset`` with its defaults at least 0.7x). Each path is timed ``--repeats`` times, the paths
taking turns, and its best run kept.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import spiral
import torch
from throughput import fastest_in_turns

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


def _documents_of(part: int, folder: str) -> Iterator[torch.Tensor]:
    """The documents of part ``part`` of the flat arrays saved in ``folder``, as LitData's
    ``optimize`` takes them (one 1-D token tensor per document)."""
    offsets = np.load(Path(folder) / "offsets.npy", mmap_mode="r")
    values = np.load(Path(folder) / "values.npy", mmap_mode="r")
    bounds = np.load(Path(folder) / "parts.npy")
    for document in range(int(bounds[part]), int(bounds[part + 1])):
        yield torch.from_numpy(np.array(values[offsets[document] : offsets[document + 1]]))


def litdata_copy(table: spiral.Table, folder: Path, parts: int = 8) -> tuple[Path, float] | None:
    """The table's documents written by ``litdata.optimize`` for ``TokensLoader``, and the
    seconds it took; ``None`` when LitData is not installed."""
    try:
        import litdata
    except ImportError:
        return None
    lengths = np.concatenate(
        [np.diff(batch.column(0).offsets.to_numpy()) for batch in table.scan(["tokens"]).to_reader()]
    )
    np.save(folder / "offsets.npy", np.concatenate(([0], np.cumsum(lengths))))
    np.save(folder / "values.npy", raw_flat(table))
    np.save(folder / "parts.npy", np.linspace(0, len(lengths), parts + 1).astype(np.int64))
    output = folder / "litdata"
    began = time.perf_counter()
    with _silenced():
        litdata.optimize(
            fn=partial(_documents_of, folder=str(folder)),
            inputs=list(range(parts)),
            output_dir=str(output),
            chunk_bytes="64MB",
            item_loader=litdata.TokensLoader(),
            num_workers=1,
        )
    return output, time.perf_counter() - began


@contextmanager
def _silenced() -> Iterator[None]:
    """Standard output sent nowhere, for this process and the processes it starts: LitData prints
    its progress there, which is this script's report."""
    sys.stdout.flush()
    kept = os.dup(1)
    with open(os.devnull, "w") as sink:
        os.dup2(sink.fileno(), 1)
        try:
            yield
        finally:
            sys.stdout.flush()
            os.dup2(kept, 1)
            os.close(kept)


def litdata_blocks(copy: Path, length: int, batch_size: int) -> int:
    """One pass of LitData's ``StreamingDataLoader`` over ``copy`` in batches of ``[length]`` blocks."""
    import litdata

    dataset = litdata.StreamingDataset(str(copy), item_loader=litdata.TokensLoader(block_size=length), shuffle=False)
    return sum(batch.numel() for batch in litdata.StreamingDataLoader(dataset, batch_size=batch_size))


def packed(dataset: PackedDataset) -> int:
    return sum(batch["tokens"].numel() for batch in dataset)


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
        copy = litdata_copy(table, Path(folder))
        paths: dict[str, Callable[[], int]] = {"raw scan, flattened to one numpy array": lambda: len(raw_flat(table))}
        if copy is not None:
            paths["LitData `TokensLoader` (its own copy; int32, no positions)"] = lambda: litdata_blocks(
                copy[0], args.length, args.batch_size
            )
        paths |= {
            "TokensLoader approach (flat tokens, then blocks)": lambda: tokens_loader(
                table, args.length, args.batch_size
            ),
            "`PackedDataset`": lambda: packed(defaults),
            "`PackedDataset(read_ahead=0)`": lambda: packed(in_line),
            f"`PackedDataset(separator={SEPARATOR})`": lambda: packed(separated),
        }
        rates = {name: tokens / seconds for name, (seconds, tokens) in fastest_in_turns(paths, args.repeats).items()}
        raw = rates["raw scan, flattened to one numpy array"]
        print(
            f"{total:,} tokens in documents of 1-2,000 tokens, splits of {args.split_rows:,} documents; blocks of "
            f"{args.length} tokens, {args.batch_size} a batch; best of {args.repeats}"
        )
        if copy is None:
            print("LitData is not installed, so only its approach is measured (see this script's docstring)\n")
        else:
            print(f"LitData's `optimize` wrote its copy of the documents in {copy[1]:.1f} s (not in its rate)\n")
        print("| path | tokens/s | vs raw scan |")
        print("| --- | ---: | ---: |")
        for name, rate in rates.items():
            print(f"| {name} | {rate:,.0f} | {rate / raw:.2f}x |")
        ours = rates["`PackedDataset`"]
        verdict = "met" if ours >= TARGET * raw else "NOT met"
        print(f"\ntarget PackedDataset >= {TARGET}x the raw scan: {ours / raw:.2f}x, {verdict}")


if __name__ == "__main__":
    main()
