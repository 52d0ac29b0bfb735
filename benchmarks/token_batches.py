"""Token-budget batches against fixed-row padded batches and packed blocks on one corpus: the
tokens of documents delivered per second and the share of each batch that is padding.

Run ``.venv/bin/python benchmarks/token_batches.py`` (``--tokens 2000000`` for a quick look). The
table is a local Spiral table of documents of 10 to 2,000 int32 token ids (uniform) holding about
``--tokens`` tokens, in splits of ``--split-rows`` documents. Each path reads the token column in
one pass:

- *raw scan*: spiral-sdk's ``Scan.to_reader()`` of the column, each read batch's values viewed as
  numpy: the floor no batching can beat.
- *fixed rows, padded*: ``TableDataset`` with ``Padded("tokens")`` in batches of as many rows as a
  token-budget batch holds on average, each padded to its longest document.
- ``PackedDataset``: blocks of ``--length`` tokens, ``budget // length`` blocks a batch (no
  padding; documents cut across blocks, the stream's tail dropped).
- ``TokenBatchDataset``: whole documents within ``--max-tokens``, padded with length grouping
  (the default), padded in stored order (``group=False``), and flat (``form="flat"``); the first
  also through ``loader(num_workers=2)`` (persistent workers sending groups of batches; the
  fastest pass is kept, so the workers' start is not counted).

Tokens/s counts document tokens delivered (padding and separators not counted); the ratio is
against the raw scan. The padding share is the padded positions over all positions of the padded
batches (target: ``TokenBatchDataset`` padded, with grouping, under 10%). Each path is timed
``--repeats`` times, the paths taking turns, and its best run kept.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from packing import open_table, raw_flat
from throughput import fastest_in_turns

from spiral_lightning import PackedDataset, Padded, TableDataset, TableSpec, TokenBatchDataset, TokenBudget, write_table

#: The highest padding share of ``TokenBatchDataset``'s padded batches with grouping.
TARGET = 0.10


def documents(tokens: int, split_rows: int, seed: int = 0) -> Iterator[pa.RecordBatch]:
    """Documents of 10..2,000 random token ids holding about ``tokens`` tokens, one split at a time."""
    generator = np.random.default_rng(seed)
    written = 0
    while written < tokens:
        lengths = generator.integers(10, 2001, split_rows)
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
        values = generator.integers(1, 50_000, int(offsets[-1]), dtype=np.int32)
        written += int(offsets[-1])
        yield pa.record_batch({"tokens": pa.ListArray.from_arrays(offsets, values)})


class Pass:
    """One pass's tally: document tokens, all positions of padded batches, and batches."""

    def __init__(self) -> None:
        self.tokens = self.positions = self.batches = 0

    def padded(self, batch: Any, lengths: Any) -> None:
        self.tokens += int(lengths.sum())
        self.positions += batch.numel()
        self.batches += 1

    def flat(self, tokens: int) -> None:
        self.tokens += tokens
        self.positions += tokens
        self.batches += 1


def fixed_rows(spec: TableSpec, rows: int) -> Pass:
    tally = Pass()
    for batch in TableDataset(spec, batch_size=rows):
        tally.padded(batch["tokens"], batch["tokens_length"])
    return tally


def packed(dataset: PackedDataset) -> Pass:
    tally = Pass()
    for batch in dataset:
        tally.flat(batch["tokens"].numel())
    return tally


def budgeted(dataset: Iterable[Any]) -> Pass:
    tally = Pass()
    for batch in dataset:
        if "lengths" in batch:
            tally.padded(batch["tokens"], batch["lengths"])
        else:
            tally.flat(batch["tokens"].numel())
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=20_000_000, help="tokens in the table (about)")
    parser.add_argument("--split-rows", type=int, default=2_000, help="documents per split")
    parser.add_argument("--max-tokens", type=int, default=16_384, help="the token budget of a batch")
    parser.add_argument("--length", type=int, default=2048, help="tokens per packed block")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder) / "corpus"
        schema = pa.schema({"tokens": pa.list_(pa.int32())})
        reader = pa.RecordBatchReader.from_batches(schema, documents(args.tokens, args.split_rows))
        spec = write_table(f"spiral:{root}", reader, split_rows=args.split_rows)
        table = open_table(spec)
        budget = TokenBudget("tokens", max_tokens=args.max_tokens)
        grouped = TokenBatchDataset(spec, budget=budget)
        # Fixed rows as many as a budget batch holds on average, so both deliver as many batches.
        counted = budgeted(grouped)
        rows = max(1, round(len(raw_lengths(table)) / max(1, counted.batches)))
        padded_spec = TableSpec(spec.uri, padded=(Padded("tokens"),))
        blocks = max(1, args.max_tokens // args.length)
        through_workers = TokenBatchDataset(spec, budget=budget).loader(num_workers=2)
        paths: dict[str, Callable[[], Pass]] = {
            "raw scan, flattened to one numpy array": lambda: _flat(len(raw_flat(table))),
            f"fixed rows, padded ({rows} rows a batch)": lambda: fixed_rows(padded_spec, rows),
            f"`PackedDataset` ({blocks} blocks of {args.length})": lambda: packed(
                PackedDataset(spec, column="tokens", length=args.length, batch_size=blocks)
            ),
            "`TokenBatchDataset` padded": lambda: budgeted(grouped),
            "`TokenBatchDataset` padded, 2 workers": lambda: budgeted(through_workers),
            "`TokenBatchDataset` padded, group=False": lambda: budgeted(
                TokenBatchDataset(spec, budget=TokenBudget("tokens", max_tokens=args.max_tokens, group=False))
            ),
            "`TokenBatchDataset` flat": lambda: budgeted(
                TokenBatchDataset(spec, budget=TokenBudget("tokens", max_tokens=args.max_tokens, form="flat"))
            ),
        }
        timed = fastest_in_turns(paths, args.repeats)
    floor = timed["raw scan, flattened to one numpy array"]
    floor_rate = floor[1].tokens / floor[0]
    print(f"{args.tokens:,} tokens (about), documents of 10-2,000 tokens, budget {args.max_tokens:,} tokens a batch")
    print()
    print("| path | tokens/s | vs raw scan | padding share | batches |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, (seconds, tally) in timed.items():
        rate = tally.tokens / seconds
        share = 1 - tally.tokens / tally.positions if tally.positions else 0.0
        print(f"| {name} | {rate:,.0f} | {rate / floor_rate:.2f}x | {share:.3f} | {tally.batches:,} |")
    grouped_share = 1 - timed["`TokenBatchDataset` padded"][1].tokens / timed["`TokenBatchDataset` padded"][1].positions
    verdict = "met" if grouped_share < TARGET else "NOT met"
    print()
    print(f"target TokenBatchDataset padded share < {TARGET:.2f}: {grouped_share:.3f}, {verdict}")


def raw_lengths(table: Any) -> np.ndarray[Any, Any]:
    """Every document's token count, from the raw scan's offsets."""
    return np.concatenate([np.diff(batch.column(0).offsets.to_numpy()) for batch in table.scan(["tokens"]).to_reader()])


def _flat(tokens: int) -> Pass:
    tally = Pass()
    tally.flat(tokens)
    return tally


if __name__ == "__main__":
    main()
