"""The DataLoader a dataset's ``loader()`` returns, and the settings a table reads right with."""

from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import sys
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import BuiltinFunctionType, FunctionType, ModuleType
from typing import Any, Protocol

from torchdata.stateful_dataloader import StatefulDataLoader

from spiral_lightning.core.backends import module_name
from spiral_lightning.core.checks import check_count
from spiral_lightning.core.integrity import dataset_states
from spiral_lightning.core.spec import TableSpec
from spiral_lightning.datasets.groups import (
    GROUP_HANDED,
    GROUP_LEFT,
    Grouped,
    GroupedIterator,
    as_they_are,
    group_size,
)
from spiral_lightning.datasets.pipes import piped
from spiral_lightning.datasets.stuck import WatchedIterator
from spiral_lightning.reading.tensors import to_torch

#: Seconds a loader waits for the next batch of a worker before it gives the worker up with a
#: ``stuck.WorkerTimeout`` naming it (the DataLoader option ``timeout``; 0 waits forever). Long enough
#: for a worker's start, a first read planned over a large table and an object store's outage
#: ridden out by retries; short enough that a stopped or hung worker ends the run, not stalls it.
WORKER_TIMEOUT = 300.0


class Batched(Protocol):
    """A dataset that cuts its own batches and counts them: ``batches(workers)`` is the exact
    number of batches of its current epoch read by ``workers`` DataLoader workers."""

    def batches(self, workers: int) -> int: ...


#: The warning torchdata's ``StatefulDataLoader`` gives at every loader made: it calls
#: ``torch.set_vital``, which torch deprecated. torchdata's to change, not the user's.
SET_VITAL_WARNING = "'set_vital' is deprecated"


@contextmanager
def without_set_vital_warning() -> Iterator[None]:
    """Make a ``StatefulDataLoader`` in this block without torchdata's deprecation warning
    (``SET_VITAL_WARNING``), so that a user sees only warnings about their own data."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", SET_VITAL_WARNING, UserWarning)
        yield


#: What the forkserver imports before it forks a worker (see ``warm_forkserver``): torch, pyarrow
#: and the table reader, then what the main script imports.
_PRELOAD = ["torch", "pyarrow", "spiral_lightning.datasets.table"]


def warm_forkserver(*modules: str) -> None:
    """Have the forkserver import torch, pyarrow, the table reader, the modules the main script
    imports (``main_imports``) and ``modules`` (added to those asked for before) once, so each
    worker forks from it in milliseconds instead of importing them again. Every worker runs the
    main script again, as Python's forkserver does to find its functions, and then finds its
    imports done: a script that imports Lightning would otherwise cost each worker seconds
    (Python 3.11's ``"__main__"`` preload never reaches the server: it asks for a ``main_path``
    its own preparation data does not hold). The server only imports; it never opens a table, so
    its children may. A server already running keeps what it imported."""
    wanted = [*main_imports(), *modules]
    _PRELOAD.extend(module for module in dict.fromkeys(wanted) if module not in _PRELOAD)
    multiprocessing.set_forkserver_preload(list(_PRELOAD))


def main_imports() -> list[str]:
    """The modules the main script's names come from: those it imported, and those of its
    classes and functions, in the order it holds them."""
    main = sys.modules.get("__main__")
    found: dict[str, None] = {}
    for value in vars(main).values() if main is not None else ():
        name = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", None)
        if isinstance(name, str) and name not in ("__main__", "__mp_main__", "builtins"):
            found[name] = None
    return list(found)


def warm_for(dataset: Any) -> None:
    """``warm_forkserver`` with the modules a worker imports to unpickle ``dataset`` (those of
    its transform, collate, policy and classes): a transform in a module that imports Lightning
    or a tokenizer costs its import once, not once per worker."""
    warm_forkserver(*referenced_modules(dataset))


def referenced_modules(value: Any) -> list[str]:
    """The modules that unpickling ``value`` imports, in the order pickling meets them, each table
    spec's backend module after the spec (a worker imports it to open its source: about 0.15 s for
    Parquet's); none when ``value`` does not pickle (the DataLoader says why when it sends it to a
    worker)."""
    found: dict[str, None] = {}

    class Finder(pickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, (type, FunctionType, BuiltinFunctionType)):
                found[getattr(obj, "__module__", None) or "builtins"] = None
            elif isinstance(obj, TableSpec):
                found[module_name(obj.uri)] = None
            return NotImplemented

    try:
        Finder(io.BytesIO(), pickle.HIGHEST_PROTOCOL).dump(value)
    except (pickle.PicklingError, TypeError, AttributeError):
        return []
    return list(found)


#: Workers a loader gets at most when not told how many.
MOST_WORKERS = 4


def workers_for(dataset: Any, num_workers: int | None) -> int:
    """``num_workers``, or when ``None`` the count that reads ``dataset`` fastest as a rule: none
    for batches of plain columns, read in this process on threads, with no processes to start or
    hold (on 2 cores at 0.79-0.98x the rate of 2 workers in ``benchmarks/defaults.py``; a Spiral
    scan keeps about one core busy a process, so on more cores workers may read faster, which
    ``spiral-lightning bench`` measures); for a dataset that runs Python on every batch (a
    transform, a collate of its own, images or video to decode) one process per core of this
    rank's share (``LOCAL_WORLD_SIZE`` ranks share the machine), 1 to ``MOST_WORKERS``: the
    trainer mostly waits on its accelerator, and on 2 cores 2 workers decoded images 1.8x as fast
    as one (``benchmarks/defaults.py``)."""
    if num_workers is not None:
        check_count("num_workers", num_workers)
        return num_workers
    workers = default_workers(runs_python(dataset))
    if workers:
        try:
            pickle.dumps(dataset)
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            warnings.warn(
                f"this dataset runs Python on every batch, which DataLoader worker processes would run beside the "
                f"trainer, but it does not pickle ({error}), so it is read in this process; define its transform "
                "or collate at a module's top level (not a lambda or a local function) to read it in workers",
                stacklevel=3,
            )
            return 0
    return workers


def default_workers(python: bool) -> int:
    """``workers_for``'s count for a dataset that runs Python on every batch (``python``) or not."""
    if not python:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(MOST_WORKERS, cores // ranks))


def runs_python(dataset: Any) -> bool:
    """Whether ``dataset`` runs Python on every batch: a transform, a collate other than
    ``to_torch``, media to decode; a ``Mixture``'s or ``WindowDataset``'s, whether one of its tables does."""
    parts = [*getattr(dataset, "tables", ()), *filter(None, [getattr(dataset, "table", None)])]
    spec = getattr(dataset, "spec", None)
    return (
        getattr(dataset, "transform", None) is not None
        or getattr(dataset, "collate", to_torch) not in (to_torch, None)
        or bool(getattr(spec, "media", ()))
        or any(runs_python(part) for part in parts)
    )


def loader_options(num_workers: int, options: Mapping[str, Any], dataset: Any) -> dict[str, Any]:
    """The DataLoader settings a table reads right with, under ``options`` the caller gives:
    ``forkserver`` workers (a parent that opened a table cannot fork) warmed for ``dataset``
    (``warm_for``), persistent so that start-up is paid once. Batches travel by torch's default
    sharing strategy; ``worker_init_fn=send_by_name`` is faster and less robust (see there). A
    ``Loader`` made with them gives a silent worker up after ``timeout`` seconds."""
    check_count("num_workers", num_workers)
    settings: dict[str, Any] = {"num_workers": num_workers}
    if num_workers:
        warm_for(dataset)
        settings["multiprocessing_context"] = "forkserver"
        settings["persistent_workers"] = True
    settings.update(options)
    return settings


class Loader(StatefulDataLoader):  # type: ignore[misc]  # torchdata ships no type hints
    """A ``StatefulDataLoader`` that gives up a worker which sends no batch for ``timeout``
    seconds (default ``WORKER_TIMEOUT``; 0 waits forever) with a ``stuck.WorkerTimeout`` naming
    it: its id, process id, rank, what its process is doing and the work item it was to read.
    Torch's own ``timeout`` names none of them, and while it waits it no longer looks every few
    seconds for a worker that died (a killed worker would go unnoticed for the whole timeout);
    this one still does. Without workers there is no one to wait for, and ``timeout`` is left
    out (torch's single-process iterator refuses any other than 0). With ``group`` above 1 each
    worker sends that many batches as one item (``groups.Grouped``), handed on one by one."""

    next_iter_state: dict[str, Any] | None

    def __init__(self, dataset: Any, *, group: int = 1, **options: Any) -> None:
        #: The dataset read, also when ``loader.dataset`` is the ``Grouped`` that reads it in groups.
        self.table = dataset
        if options.get("num_workers"):
            options.setdefault("timeout", WORKER_TIMEOUT)
            if "multiprocessing_context" in options:
                options["multiprocessing_context"] = piped(options["multiprocessing_context"])
            if group > 1:
                dataset = Grouped(dataset, group)
                # torch's default for unbatched items would walk every batch and state of a group.
                options.setdefault("collate_fn", as_they_are)
        else:
            options.pop("timeout", None)
        super().__init__(dataset, **options)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        left = state_dict.pop(GROUP_LEFT, None)
        handed = state_dict.pop(GROUP_HANDED, None)
        if isinstance(self.dataset, Grouped):
            self.dataset.left = {} if left is None else {int(left["worker"]): int(left["left"])}
            self.dataset.handed = {} if handed is None else {worker: int(n) for worker, n in enumerate(handed)}
        super().load_state_dict(state_dict)

    def _get_iterator(self) -> Any:
        if self.num_workers == 0:
            return super()._get_iterator()
        self.check_worker_number_rationality()
        iterator = (GroupedIterator if isinstance(self.dataset, Grouped) else WatchedIterator)(
            self, self.next_iter_state
        )
        self.next_iter_state = None
        if isinstance(self.dataset, Grouped):
            # The workers took them: the loader's next workers (a new epoch without persistent
            # workers) start their epoch from its beginning.
            self.dataset.left, self.dataset.handed = {}, {}
        return iterator


class TableLoader(Loader):
    """The ``StatefulDataLoader`` of a ``TableDataset``, made by ``TableDataset.loader``: it hands
    on the dataset's own batches (``batch_size=None``), and ``len`` is the exact number of batches
    in the dataset's current epoch, not its rows."""

    def __init__(self, dataset: Batched, **options: Any) -> None:
        if options.get("batch_size") is not None:
            raise ValueError(
                "a TableDataset cuts its own batches (TableDataset(batch_size=...)); a DataLoader batch_size would "
                "stack them into [batch_size, rows, ...] tensors"
            )
        options.pop("batch_size", None)
        with without_set_vital_warning():
            options.setdefault("group", group_size(dataset))
            super().__init__(dataset, batch_size=None, **options)

    def __len__(self) -> int:
        batches: int = self.table.batches(self.num_workers)
        return batches

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # torchdata passes over a missing dataset state, which would start that consumer's epoch again.
        dataset_states(state_dict)
        super().load_state_dict(state_dict)


def batch_loader(dataset: Any, num_workers: int, options: Mapping[str, Any]) -> StatefulDataLoader:
    """A ``StatefulDataLoader`` that hands on ``dataset``'s own batches as they are
    (``batch_size=None``), with the settings of ``loader_options``: for a kind that cuts its own
    batches but cannot count them ahead (a ``Mixture``, a ``WindowDataset``)."""
    settings = loader_options(num_workers, options, dataset)
    with without_set_vital_warning():
        loader: StatefulDataLoader = Loader(dataset, batch_size=None, **settings)
    return loader
