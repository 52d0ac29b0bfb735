"""SDS random access through a DataLoader: ``TableMapDataset`` on an ``sds:`` table against the
map-style adapter SDS's guide describes (reopen the dataset per process, read one record per
``__getitem__``, copy each read-only field before ``torch.from_numpy``).

Run ``.venv/bin/python benchmarks/sds.py`` (``--records 3000`` for a quick look). The dataset has
``--records`` records of a complex64 ``iq`` [2, ``--samples``] field and an int ``label``, in
``--shards`` shards, published once with ``sds.write_shard`` and ``sds.publish`` (``--root`` keeps
it between runs). Both paths run ``DataLoader(batch_size=256, shuffle=True, num_workers=2)``
with spawned, persistent workers and check in every epoch that every record arrives once. The
first epoch starts the workers and is not timed; a *time* is the best of the ``--repeats``
epochs after it, the paths taking turns so that load from other processes falls on both alike.
Records/s is records over that time, and the ratio divides the adapter's time by the path's
(above 1: the path is faster than the adapter).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import signal_dataset as sds
import torch
from torch.utils.data import DataLoader, Dataset

from spiral_lightning import TableMapDataset, TableSpec


class GuideAdapter(Dataset[dict[str, Any]]):
    """The one-record-at-a-time adapter: the dataset opens again in each process (by pid), and
    each field is copied out of its read-only array before ``torch.from_numpy``."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.length = len(sds.open(root))
        self.opened: tuple[int, sds.Dataset] | None = None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self.opened is None or self.opened[0] != os.getpid():
            self.opened = (os.getpid(), sds.open(self.root))
        record = self.opened[1][index]
        sample = {name: torch.from_numpy(field.data.copy()) for name, field in record.fields.items()}
        return {"id": record.id, **sample, "label": record.metadata["label"]}


def publish(root: Path, records: int, shards: int, samples: int) -> None:
    """``records`` records in ``shards`` shards at ``root``, unless a dataset is already there."""
    if (root / "root.json").exists():
        return
    generator = np.random.default_rng(0)
    published = []
    for shard, part in enumerate(np.array_split(np.arange(records), shards)):
        batch = []
        for number in part.tolist():
            iq = generator.normal(size=(2, samples * 2)).astype(np.float32).view(np.complex64)
            axes = (sds.Axis("channel", 2), sds.Axis("time", samples))
            batch.append(sds.Record(f"{number:08d}", {"iq": sds.Field(iq, axes=axes)}, metadata={"label": number % 10}))
        published.append(sds.write_shard(batch, str(root), work_id=f"{shard:06d}"))
    sds.publish(str(root), published, dataset_id="bench", snapshot_id="0")


def loader(dataset: Dataset[Any]) -> DataLoader[Any]:
    """The DataLoader both paths run under; its workers persist, so epochs after the first
    measure reading rather than starting processes."""
    return DataLoader(
        dataset, batch_size=256, shuffle=True, num_workers=2, multiprocessing_context="spawn", persistent_workers=True
    )


def epoch(batches: DataLoader[Any], records: int) -> float:
    """Seconds for one shuffled epoch through ``batches``; checks every record arrived once."""
    start = time.perf_counter()
    seen = [name for batch in batches for name in batch["id"]]
    seconds = time.perf_counter() - start
    if sorted(seen) != [f"{number:08d}" for number in range(records)]:
        raise AssertionError("a path did not deliver every record exactly once")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", type=Path, default=None)
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = arguments.root or Path(scratch) / "sds"
        publish(root, arguments.records, arguments.shards, arguments.samples)
        paths = {
            "TableMapDataset": loader(TableMapDataset(TableSpec(f"sds:{root}"))),
            "guide adapter": loader(GuideAdapter(str(root))),
        }
        for batches in paths.values():
            # The first epoch starts the workers (and checks the rows); it is not timed.
            epoch(batches, arguments.records)
        best = {name: float("inf") for name in paths}
        for _ in range(arguments.repeats):
            for name, batches in paths.items():
                best[name] = min(best[name], epoch(batches, arguments.records))
        print(f"{arguments.records} records, iq complex64 [2, {arguments.samples}], {arguments.shards} shards")
        print("| path | records/s | adapter time / path time |")
        print("| --- | ---: | ---: |")
        for name, seconds in best.items():
            print(f"| {name} | {arguments.records / seconds:,.0f} | {best['guide adapter'] / seconds:.2f} |")


if __name__ == "__main__":
    main()
