"""Rows per second of ``TableDataset`` against the loaders users would pick instead, on identical
data and batch sizes, measured in one run.

Run ``bash scripts/install-peers.sh`` first: it installs Lance, LitData and MosaicML Streaming
into ``benchmarks/.peers`` (without their torch requirement, which would replace the CPU torch),
and this script adds that folder to its import path. Then ``.venv/bin/python benchmarks/peers.py``
(``--rows 50000`` for a quick look; ``--batch-sizes 256,1024,4096`` for several batch sizes;
``--skip ray streaming`` leaves those peers out; ``--root`` keeps the data and its copies between
runs). Ray Data comes with the project's ``[ray]`` extra. A peer that does not import gets a row
saying so and the run goes on; one that fails while running gets a row saying that, its traceback
on stderr. Streaming imports with an empty stand-in for its ``streaming.vision`` subpackage, which
needs a torchvision the CPU torch cannot load (see the install script). Stdout is the report;
progress and the peers' own output go to stderr.

The data: ``--rows`` rows (default 1,000,000) of ``id`` int64 (0 to rows - 1), ``x`` float32 and
``emb`` fixed_size_list<float32>[16], made in memory once, then written in each format the paths
read. The *conversion* table gives the seconds each write took from that in-memory table:

- Parquet (``write_table("parquet:...")``, one file, 20 row groups) and Spiral
  (``write_table("spiral:...")``, 20 splits), both this project's writer;
- Lance (``lance.write_dataset``, its defaults);
- LitData (``litdata.optimize`` with 2 worker processes, one input per Parquet row group, each
  yielding one item per row: ``id`` an int, ``x`` a numpy float32, ``emb`` a float32 array);
- MDS (``streaming.MDSWriter`` in this process, one sample per row: ``int64``, ``float32``,
  ``ndarray:float32:16``).

The *paths*, each delivering batches of ``B`` rows (``--batch-sizes``) as a dict of torch tensors of
every column (``id`` int64 ``[n]``, ``x`` float32 ``[n]``, ``emb`` float32 ``[n, 16]``; a batch may
be shorter where a file, fragment or split ends):

- ``TableDataset`` on the Parquet table and on the Spiral table, in process
  (``iter(TableDataset(spec, batch_size=B))``) and through its default loader
  (``dataset.loader(num_workers=2)``: persistent ``forkserver`` workers); and in process with
  ``decoded_cache_dir`` (a fresh folder, filled by one untimed pass first: the rate of every epoch
  after the first, which reads uncompressed Arrow instead of decoding the table);
- pyarrow ``ParquetFile.iter_batches(batch_size=B)`` on the Parquet file, each column made a
  tensor by ``torch.from_numpy`` (no copy), in process;
- Lance ``dataset.to_batches(batch_size=B)`` made tensors the same way, and Lance's own torch
  dataset ``lance.torch.data.LanceDataset(path, batch_size=B)``, in process;
- LitData ``StreamingDataset`` + ``StreamingDataLoader(batch_size=B)`` and MosaicML Streaming
  ``StreamingDataset(local=..., batch_size=B)`` + ``StreamingDataLoader(batch_size=B)``, in
  process (``num_workers=0``): both keep one item per row and collate ``B`` of them per batch,
  which is how they are used;
- Ray Data ``ray.data.read_parquet(folder).iter_torch_batches(batch_size=B)`` on the Parquet
  folder, with a local Ray of 2 CPUs started once beforehand (its reads run in Ray's processes).

Every pass is checked to deliver ``rows`` rows whose ids add up to ``rows * (rows - 1) / 2``
(each id once, as far as a count and a sum tell), every column a tensor of the dtype and shape
above. A *rate* is the rows of one full pass divided by its wall time. In process, each path takes
the best of ``--repeats`` passes, the paths taking turns (each round starting at another one) so
that load from other processes falls on all of them alike; a path stops being repeated once its
passes took ``--path-seconds`` in all (slow peers run minutes a pass, and their gap to the others
dwarfs the run-to-run noise), so the *passes* column says how many were timed. Through
``dataset.loader`` the first epoch starts the workers and is not timed; the rate is the best of
up to two epochs after it. Ray's first pass starts its worker processes and is not timed either;
its rate is the best of up to ``--repeats`` passes after it, each from ``read_parquet`` to its last
batch (planning included).

The ratio columns divide each rate by Lance ``to_batches``'s and by ``TableDataset`` on Parquet in
process's at the same batch size. Target (issue 27): ``TableDataset`` on Parquet in process at least
1.0x Lance ``to_batches`` (without and with the decoded cache). Rates swing by up to about 30%
between runs on shared machines: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import tempfile
import time
import traceback
import types
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from throughput import in_turns

from spiral_lightning import TableDataset, TableSpec, write_table
from spiral_lightning.sources.spiral import IDS_FILE

HERE = Path(__file__).resolve().parent
#: Where ``scripts/install-peers.sh`` puts the peers. Appended, never prepended, so that a package
#: .venv has always wins over one of the same name there.
PEERS = HERE / ".peers"
if PEERS.is_dir() and str(PEERS) not in sys.path:
    sys.path.append(str(PEERS))

# Ray would otherwise start its workers through ``uv run`` when it sees one in the environment.
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

WIDTH = 16
#: Splits of the Spiral table and row groups of the Parquet file, whatever the rows.
SPLITS = 20
WORKERS = 2
#: Epochs timed through ``dataset.loader`` after the untimed first one, at most.
LOADER_EPOCHS = 2
#: The row whose rate the ratio columns divide by, and the one the target is about.
LANCE = "Lance `to_batches` + `torch.from_numpy`, in process"
OURS = "`TableDataset` on Parquet, in process"
CACHED = "`TableDataset` on Parquet with `decoded_cache_dir`, in process, 2nd+ pass"
TARGET = 1.0

#: One pass of a path: every batch it delivers, as a dict of tensors by column name.
Pass = Callable[[], Iterable[Mapping[str, Any]]]

# The raw Arrow paths hand torch read-only buffers, which it warns about once; nothing writes them.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def make_data(rows: int) -> pa.Table:
    """``rows`` rows of the benchmark's columns, seeded, in memory."""
    generator = np.random.default_rng(0)
    return pa.table(
        {
            "id": pa.array(np.arange(rows, dtype=np.int64)),
            "x": pa.array(generator.standard_normal(rows, dtype=np.float32)),
            "emb": pa.FixedSizeListArray.from_arrays(
                pa.array(generator.standard_normal(rows * WIDTH, dtype=np.float32)), WIDTH
            ),
        }
    )


def arrow_tensors(batch: pa.RecordBatch) -> dict[str, torch.Tensor]:
    """The columns of a raw Arrow batch as tensors over its own buffers (no copy)."""
    return {
        "id": torch.from_numpy(batch.column("id").to_numpy()),
        "x": torch.from_numpy(batch.column("x").to_numpy()),
        # ``flatten`` honours the batch's offset into the list's values, which ``.values`` would not.
        "emb": torch.from_numpy(batch.column("emb").flatten().to_numpy().reshape(batch.num_rows, WIDTH)),
    }


#: What every batch must hold: each column's dtype and its shape after the batch's rows.
EXPECTED = {"id": (torch.int64, ()), "x": (torch.float32, ()), "emb": (torch.float32, (WIDTH,))}


def consume(batches: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
    """The rows of ``batches`` and the sum of their ids, each column checked to be a tensor of the
    expected dtype and shape: what a training step would receive."""
    rows = ids = 0
    for batch in batches:
        count = batch["id"].shape[0]
        for name, (dtype, shape) in EXPECTED.items():
            value = batch[name]
            if not isinstance(value, torch.Tensor) or value.dtype != dtype or tuple(value.shape) != (count, *shape):
                got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise TypeError(f"column {name} arrived as {got}, not {dtype} {(count, *shape)}")
        rows += count
        ids += int(batch["id"].sum())
    return rows, ids


def timed(path: Pass, rows: int) -> float:
    """Seconds of one pass of ``path``, checked to deliver every id of ``rows`` rows once."""
    began = time.perf_counter()
    seen, ids = consume(path())
    seconds = time.perf_counter() - began
    if (seen, ids) != (rows, rows * (rows - 1) // 2):
        raise AssertionError(f"a pass delivered {seen} rows with ids summing to {ids}, not every id of {rows} once")
    return seconds


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """This process's and its children's standard output sent to standard error meanwhile: the
    peers print progress there, and stdout is this script's report."""
    sys.stdout.flush()
    kept = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(kept, 1)
        os.close(kept)


#: When the run began, for the progress lines on stderr.
START = time.perf_counter()


def progress(message: str) -> None:
    """A line on stderr saying how far the run is: passes of slow peers take minutes."""
    print(f"[{time.perf_counter() - START:6.1f} s] {message}", file=sys.stderr, flush=True)


#: The peers ``--skip`` leaves out, by top-level module name.
SKIPPED: set[str] = set()
PEER_MODULES = ("lance", "litdata", "streaming", "ray")


def peer_module(name: str) -> types.ModuleType | str:
    """The module ``name`` imported, or why not: skipped, ``"not installed"``, or its import error."""
    if name.split(".")[0] in SKIPPED:
        return "skipped (`--skip`)"
    if importlib.util.find_spec(name.split(".")[0]) is None:
        return "not installed"
    if name.startswith("streaming"):
        # Streaming's package imports its vision datasets, which need torchvision; the registry's
        # torchvision for this torch is a CUDA build that does not load beside the CPU torch. MDS
        # reading and writing use none of it, so an empty module stands in for that subpackage.
        sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    try:
        return importlib.import_module(name)
    except Exception as error:  # a peer's import may fail in any way; it is reported, not raised
        return cell(f"does not import: {type(error).__name__}: {error}")


def cell(text: str) -> str:
    """``text`` made fit for one markdown table cell: its first line, no ``|``, at most 100 characters."""
    lines = text.strip().splitlines()
    return (lines[0] if lines else "").replace("|", "/")[:100]


def failure(error: BaseException) -> str:
    """A cell for a peer that failed, its traceback sent to stderr."""
    traceback.print_exception(error, file=sys.stderr)
    return cell(f"failed: {type(error).__name__}: {error}")


def version(package: str) -> str:
    """``package`` and its installed version, for the report's header."""
    try:
        return f"{package} {importlib.metadata.version(package)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{package} not installed"


@dataclass
class Copy:
    """The data in one format: where it is, what wrote it, how long that took (``None`` when an
    earlier run's copy was kept), its layout, or why there is none (``missing``)."""

    format: str
    writer: str
    location: Path
    seconds: float | None = None
    layout: str = ""
    missing: str = ""
    spec: TableSpec | None = None

    def table_spec(self) -> TableSpec:
        """The spec of this project's table (Parquet or Spiral) this copy is."""
        if self.spec is None:
            raise ValueError(f"the {self.format} copy is no table of this project's")
        return self.spec


def fresh(folder: Path, complete: Path) -> bool:
    """Whether ``folder`` must be written: not when ``complete`` (a file only a finished write
    leaves) shows an earlier run's copy; a folder without it, left by a write that failed, goes."""
    if complete.exists():
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return True


def write_ours(kind: str, folder: Path, data: pa.Table) -> Copy:
    """The data written by this project's ``write_table`` as a ``kind`` table."""
    copy = Copy("Parquet" if kind == "parquet" else "Spiral", f'`write_table("{kind}:...")`', folder)
    split_rows = -(-data.num_rows // SPLITS)
    complete = folder / IDS_FILE if kind == "spiral" else folder / "part-00000.parquet"
    if fresh(folder, complete):
        began = time.perf_counter()
        copy.spec = write_table(f"{kind}:{folder}", data, split_rows=split_rows)
        copy.seconds = time.perf_counter() - began
    else:
        copy.spec = TableSpec(f"{kind}:{folder}").resolve()
    noun = "splits" if kind == "spiral" else "row groups"
    copy.layout = f"{-(-data.num_rows // split_rows)} {noun} of {split_rows:,} rows"
    return copy


def write_lance(folder: Path, data: pa.Table) -> Copy:
    """The data written as a Lance dataset with Lance's defaults."""
    copy = Copy("Lance", "`lance.write_dataset` (its defaults)", folder)
    lance = peer_module("lance")
    if isinstance(lance, str):
        copy.missing = lance
        return copy
    try:
        if fresh(folder, folder / "_versions"):
            began = time.perf_counter()
            lance.write_dataset(data, str(folder))
            copy.seconds = time.perf_counter() - began
        copy.layout = f"{len(lance.dataset(str(folder)).get_fragments())} fragment(s)"
    except Exception as error:  # reported as the peer's row
        copy.missing = failure(error)
    return copy


def litdata_rows(group: int, parquet: str) -> Iterator[dict[str, Any]]:
    """One Parquet row group's rows as LitData items, a dict per row (``optimize``'s ``fn``)."""
    batch = pq.ParquetFile(parquet).read_row_group(group)
    # Plain ints become LitData's int serializer; numpy scalars and arrays keep their float32 type.
    ids = batch.column("id").to_numpy().tolist()
    xs = batch.column("x").to_numpy()
    emb = batch.column("emb").combine_chunks().flatten().to_numpy().reshape(-1, WIDTH)
    for row, identifier in enumerate(ids):
        yield {"id": identifier, "x": xs[row], "emb": emb[row]}


def write_litdata(folder: Path, parquet: Path) -> Copy:
    """The data written by ``litdata.optimize`` from the Parquet file's row groups, an item per row."""
    copy = Copy("LitData", f"`litdata.optimize(num_workers={WORKERS})`", folder)
    litdata = peer_module("litdata")
    if isinstance(litdata, str):
        copy.missing = litdata
        return copy
    try:
        if fresh(folder, folder / "index.json"):
            groups = pq.ParquetFile(parquet).num_row_groups
            began = time.perf_counter()
            litdata.optimize(
                fn=functools.partial(litdata_rows, parquet=str(parquet)),
                inputs=list(range(groups)),
                output_dir=str(folder),
                chunk_bytes="64MB",
                num_workers=WORKERS,
            )
            copy.seconds = time.perf_counter() - began
        copy.layout = f"{len(list(folder.glob('*.bin')))} chunk file(s)"
    except Exception as error:  # reported as the peer's row
        copy.missing = failure(error)
    return copy


def write_mds(folder: Path, data: pa.Table) -> Copy:
    """The data written by Streaming's ``MDSWriter``, a sample per row."""
    copy = Copy("MDS", "`streaming.MDSWriter`, in process", folder)
    streaming = peer_module("streaming")
    if isinstance(streaming, str):
        copy.missing = streaming
        return copy
    try:
        if fresh(folder, folder / "index.json"):
            began = time.perf_counter()
            ids = data.column("id").to_numpy()
            xs = data.column("x").to_numpy()
            emb = data.column("emb").combine_chunks().flatten().to_numpy().reshape(-1, WIDTH)
            columns = {"id": "int64", "x": "float32", "emb": f"ndarray:float32:{WIDTH}"}
            with streaming.MDSWriter(out=str(folder), columns=columns) as writer:
                for row in range(data.num_rows):
                    writer.write({"id": ids[row], "x": xs[row], "emb": emb[row]})
            copy.seconds = time.perf_counter() - began
        copy.layout = f"{len(list(folder.glob('shard.*.mds*')))} shard(s)"
    except Exception as error:  # reported as the peer's row
        copy.missing = failure(error)
    return copy


def write_copies(root: Path, data: pa.Table) -> dict[str, Copy]:
    """Every format's copy of ``data`` under ``root``, by format. LitData's ``optimize`` makes
    ``spawn`` this process's default start method for its workers; the loaders here name
    ``forkserver`` themselves, so that changes nothing else."""
    parquet = root / "parquet"
    writers: dict[str, Callable[[], Copy]] = {
        "Parquet": lambda: write_ours("parquet", parquet, data),
        "LitData": lambda: write_litdata(root / "litdata", parquet / "part-00000.parquet"),
        "MDS": lambda: write_mds(root / "mds", data),
        "Lance": lambda: write_lance(root / "lance", data),
        "Spiral": lambda: write_ours("spiral", root / "spiral", data),
    }
    copies: dict[str, Copy] = {}
    for name, writer in writers.items():
        copies[name] = writer()
        progress(f"{name}: {copies[name].missing or 'ready'}")
    return copies


def in_process(copies: Mapping[str, Copy], batch_size: int) -> dict[str, Pass | str]:
    """The paths measured in this process at ``batch_size``, by name; a string for a path that
    cannot run, saying why."""
    paths: dict[str, Pass | str] = {}
    for name in ("Parquet", "Spiral"):
        spec = copies[name].table_spec()
        dataset = TableDataset(spec, batch_size=batch_size)
        paths[f"`TableDataset` on {name}, in process"] = functools.partial(iter, dataset)
        folder = copies[name].location.parent / f"decoded-{name}-{batch_size}"
        shutil.rmtree(folder, ignore_errors=True)
        cached = TableDataset(
            replace(spec, decoded_cache_dir=str(folder), decoded_cache_bytes=1 << 40), batch_size=batch_size
        )
        consume(cached)
        paths[CACHED.replace("Parquet", name)] = functools.partial(iter, cached)
    files = sorted(copies["Parquet"].location.glob("*.parquet"))

    def pyarrow_pass() -> Iterator[dict[str, torch.Tensor]]:
        for file in files:
            yield from map(arrow_tensors, pq.ParquetFile(file).iter_batches(batch_size=batch_size))

    paths["pyarrow `ParquetFile.iter_batches` + `torch.from_numpy`, in process"] = pyarrow_pass
    paths.update(lance_paths(copies["Lance"], batch_size))
    paths["LitData `StreamingDataset` + `StreamingDataLoader`, in process"] = litdata_path(
        copies["LitData"], batch_size
    )
    paths["MosaicML `StreamingDataset` + `StreamingDataLoader` (MDS), in process"] = mosaic_path(
        copies["MDS"], batch_size
    )
    return paths


def lance_paths(copy: Copy, batch_size: int) -> dict[str, Pass | str]:
    """Lance's raw ``to_batches`` (made tensors here) and its own torch dataset, over ``copy``."""
    own = "Lance `LanceDataset` (`lance.torch`), in process"
    if copy.missing:
        return {LANCE: copy.missing, own: copy.missing}
    lance = peer_module("lance")
    assert not isinstance(lance, str)
    dataset = lance.dataset(str(copy.location))
    paths: dict[str, Pass | str] = {
        LANCE: lambda: map(arrow_tensors, dataset.to_batches(batch_size=batch_size)),
    }
    data = peer_module("lance.torch.data")
    if isinstance(data, str):
        paths[own] = data
    else:
        paths[own] = functools.partial(data.LanceDataset, str(copy.location), batch_size=batch_size)
    return paths


def litdata_path(copy: Copy, batch_size: int) -> Pass | str:
    """LitData's loader over its copy, in process: a new ``StreamingDataLoader`` each pass."""
    if copy.missing:
        return copy.missing
    litdata = peer_module("litdata")
    assert not isinstance(litdata, str)
    dataset = litdata.StreamingDataset(str(copy.location), shuffle=False)
    return lambda: litdata.StreamingDataLoader(dataset, batch_size=batch_size, num_workers=0)


def mosaic_path(copy: Copy, batch_size: int) -> Pass | str:
    """Streaming's loader over the MDS copy, in process: a new ``StreamingDataLoader`` each pass."""
    if copy.missing:
        return copy.missing
    streaming = peer_module("streaming")
    assert not isinstance(streaming, str)
    # Streaming registers each dataset's local folder in shared memory; one left by an earlier
    # dataset of this run (another batch size), or by a run that crashed, would be refused.
    gc.collect()
    importlib.import_module("streaming.base.util").clean_stale_shared_memory()
    dataset = streaming.StreamingDataset(local=str(copy.location), batch_size=batch_size, shuffle=False)
    return lambda: streaming.StreamingDataLoader(dataset, batch_size=batch_size, num_workers=0)


@dataclass
class Result:
    """One path's outcome at one batch size: its rate and timed passes, or why it has none."""

    data: str
    rate: float | None = None
    passes: int = 0
    note: str = ""


def data_of(name: str) -> str:
    """The format a path reads, from its name."""
    for word, data in (
        ("on Spiral", "Spiral"),
        ("Lance", "Lance"),
        ("LitData", "LitData"),
        ("MDS", "MDS"),
    ):
        if word in name:
            return data
    return "Parquet"


def measure_in_process(
    paths: Mapping[str, Pass | str], rows: int, repeats: int, path_seconds: float
) -> dict[str, Result]:
    """Every path's best pass of up to ``repeats``, taking turns; a path stops once its passes
    took ``path_seconds`` in all. A peer that fails is reported; this project's paths raise."""
    results = {name: Result(data_of(name), note=path if isinstance(path, str) else "") for name, path in paths.items()}
    runnable = [name for name, path in paths.items() if not isinstance(path, str)]
    best = dict.fromkeys(runnable, float("inf"))
    spent = dict.fromkeys(runnable, 0.0)
    for repeat in range(repeats):
        for name in in_turns(runnable, repeat):
            if results[name].note or spent[name] >= path_seconds:
                continue
            path = paths[name]
            assert not isinstance(path, str)
            try:
                seconds = timed(path, rows)
            except Exception as error:
                if "TableDataset" in name:
                    raise
                results[name].note = failure(error)
                continue
            spent[name] += seconds
            best[name] = min(best[name], seconds)
            results[name].passes += 1
    for name in runnable:
        if not results[name].note:
            results[name].rate = rows / best[name]
    return results


def measure_loaders(copies: Mapping[str, Copy], rows: int, batch_size: int, repeats: int) -> dict[str, Result]:
    """``TableDataset``'s default loader with ``WORKERS`` workers on each table: the best of up to
    ``LOADER_EPOCHS`` epochs after a first one that starts the workers."""
    results: dict[str, Result] = {}
    for name in ("Parquet", "Spiral"):
        loader = TableDataset(copies[name].table_spec(), batch_size=batch_size).loader(num_workers=WORKERS)
        timed(functools.partial(iter, loader), rows)
        epochs = min(repeats, LOADER_EPOCHS)
        seconds = min(timed(functools.partial(iter, loader), rows) for _ in range(epochs))
        # Dropping the loader stops its persistent workers before the next one starts.
        del loader
        gc.collect()
        label = f"`TableDataset` on {name}, `loader(num_workers={WORKERS})`, 2nd+ epoch"
        results[label] = Result(name, rows / seconds, epochs)
    return results


def measure_ray(
    folder: Path, rows: int, batch_sizes: list[int], repeats: int, path_seconds: float
) -> dict[int, Result]:
    """Ray Data's ``read_parquet`` + ``iter_torch_batches`` at each batch size, Ray started once
    and warmed by one untimed pass (it starts Ray's worker processes, as a loader's first epoch
    does); each timed pass plans and runs a new dataset."""
    ray = peer_module("ray")
    if isinstance(ray, str):
        return {size: Result("Parquet", note=ray) for size in batch_sizes}
    results: dict[int, Result] = {}
    try:
        data = importlib.import_module("ray.data")
        ray.init(num_cpus=WORKERS, include_dashboard=False, log_to_driver=False)
        data.DataContext.get_current().enable_progress_bars = False
    except Exception as error:
        return {size: Result("Parquet", note=failure(error)) for size in batch_sizes}

    def run(size: int) -> Iterable[Mapping[str, Any]]:
        batches: Iterable[Mapping[str, Any]] = data.read_parquet(str(folder)).iter_torch_batches(batch_size=size)
        return batches

    try:
        for number, size in enumerate(batch_sizes):
            result = results[size] = Result("Parquet")
            best, spent = float("inf"), 0.0
            for _ in range(repeats):
                if spent >= path_seconds:
                    break
                try:
                    if number == 0 and result.passes == 0:
                        timed(functools.partial(run, size), rows)
                    seconds = timed(functools.partial(run, size), rows)
                except Exception as error:
                    result.note = failure(error)
                    break
                spent += seconds
                best = min(best, seconds)
                result.passes += 1
            if not result.note:
                result.rate = rows / best
    finally:
        ray.shutdown()
    return results


def table(results: Mapping[str, Result], batch_size: int) -> list[str]:
    """One batch size's results as a markdown table."""
    lance = results.get(LANCE)
    ours = results[OURS].rate

    def ratio(rate: float | None, base: float | None) -> str:
        if not rate or not base:
            return "-"
        # Three decimals below 0.1x: the slowest peers are hundreds of times slower.
        return f"{rate / base:.2f}x" if rate >= 0.1 * base else f"{rate / base:.3f}x"

    lines = [
        f"### batch {batch_size:,}",
        "",
        "| path | data | passes | rows/s | vs Lance to_batches | vs TableDataset on Parquet |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for name, result in results.items():
        rate = f"{result.rate:,.0f}" if result.rate else result.note
        base = lance.rate if lance else None
        lines.append(
            f"| {name} | {result.data} | {result.passes or '-'} | {rate} | {ratio(result.rate, base)} | "
            f"{ratio(result.rate, ours)} |"
        )
    return lines


def conversions(copies: Mapping[str, Copy], rows: int) -> list[str]:
    """The conversion table: each copy's writer, seconds, rows per second of writing and layout."""
    lines = [
        "### conversions",
        "",
        "| format | written by | seconds | rows/s | layout |",
        "| --- | --- | ---: | ---: | --- |",
    ]
    for copy in copies.values():
        if copy.missing:
            seconds, rate = copy.missing, "-"
        elif copy.seconds is None:
            seconds, rate = "kept from an earlier run", "-"
        else:
            seconds, rate = f"{copy.seconds:.1f}", f"{rows / copy.seconds:,.0f}"
        lines.append(f"| {copy.format} | {copy.writer} | {seconds} | {rate} | {copy.layout} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of data (default 1,000,000)")
    parser.add_argument("--batch-sizes", default="1024", help="comma-separated batch rows (default 1024)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per path, the best counts (default 3)")
    parser.add_argument(
        "--path-seconds",
        type=float,
        default=60.0,
        help="a path is not timed again once its passes took this long in all (default 60)",
    )
    parser.add_argument(
        "--root", type=Path, help="folder that keeps the data's copies between runs (default: a temp one)"
    )
    parser.add_argument(
        "--skip",
        nargs="+",
        default=[],
        choices=PEER_MODULES,
        help="peers to leave out, by module (their rows say so), e.g. for a quick check of this script",
    )
    options = parser.parse_args()
    SKIPPED.update(options.skip)
    batch_sizes = [int(size) for size in options.batch_sizes.split(",") if size.strip()]
    if options.rows < SPLITS or options.repeats < 1 or not batch_sizes or min(batch_sizes) < 1:
        parser.error(f"--rows must be at least {SPLITS}, --repeats and every batch size at least 1")
    rows = options.rows
    with tempfile.TemporaryDirectory(prefix="spiral-lightning-peers-") as temp:
        root = (options.root or Path(temp)) / f"peers-{rows}"
        root.mkdir(parents=True, exist_ok=True)
        with stdout_to_stderr():
            copies = write_copies(root, make_data(rows))
            results: dict[int, dict[str, Result]] = {}
            for size in batch_sizes:
                paths = in_process(copies, size)
                results[size] = measure_in_process(paths, rows, options.repeats, options.path_seconds)
                del paths
                progress(f"measured in process at batch {size}")
            for size in batch_sizes:
                results[size].update(measure_loaders(copies, rows, size, options.repeats))
                progress(f"measured loaders at batch {size}")
            ray = measure_ray(copies["Parquet"].location, rows, batch_sizes, options.repeats, options.path_seconds)
            for size in batch_sizes:
                results[size]["Ray Data `read_parquet` + `iter_torch_batches` (Ray's processes)"] = ray[size]
    packages = ("torch", "pyarrow", "spiral-sdk", "pylance", "litdata", "mosaicml-streaming", "ray")
    lines = [
        f"{rows:,} rows (id int64, x float32, emb float32[{WIDTH}]); in process best of up to {options.repeats} passes "
        f"(a path stops after {options.path_seconds:.0f} s of passes); loaders best of up to {LOADER_EPOCHS} "
        "epochs after the first",
        "",
        "Versions: " + ", ".join(version(package) for package in packages),
    ]
    for size in batch_sizes:
        lines += ["", *table(results[size], size)]
    lines += ["", *conversions(copies, rows), ""]
    for size in batch_sizes:
        lance = results[size][LANCE].rate
        for name, label in ((OURS, "in process"), (CACHED, "with a decoded cache, 2nd+ pass")):
            ours = results[size][name].rate
            said = f"target TableDataset on Parquet {label} >= {TARGET:.1f}x Lance to_batches at batch {size}: "
            if ours and lance:
                lines.append(said + f"{ours / lance:.2f}x, {'met' if ours >= TARGET * lance else 'NOT met'}")
            else:
                lines.append(said + "no result (Lance did not run)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
