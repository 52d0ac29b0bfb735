"""The package's layers hold: each subpackage imports only those below it (planning no source,
reading module or I/O library), no module imports itself back through others, none is over the
size a reader takes in, and importing the package loads nothing heavy."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import spiral_lightning
from spiral_lightning.datasets.stuck import WorkerTimeout
from spiral_lightning.sources.damage import DamagedData
from spiral_lightning.sources.retry import StoreUnavailable

PACKAGE = Path(__file__).parent.parent / "spiral_lightning"
RAY = PACKAGE.parent / "ray_adapter"

#: Each layer and the layers it may import, its own included. Bottom up: the order of the data flow.
ALLOWED = {
    "core": {"core"},
    "sources": {"core", "sources"},
    "planning": {"core", "planning"},
    "reading": {"core", "sources", "planning", "reading"},
    "media": {"core", "sources", "reading", "media"},
    "datasets": {"core", "sources", "planning", "reading", "media", "datasets"},
    "lightning": {"core", "sources", "planning", "reading", "media", "datasets", "lightning"},
    "demos": {"core", "sources", "planning", "reading", "media", "datasets", "lightning", "demos"},
}
#: Libraries that read or write: planning is pure and imports none of them (torch it may: the
#: map-style re-plan draws the sampler's permutation with its generator).
IO_LIBRARIES = {"pyarrow", "spiral", "signal_dataset", "av", "PIL", "lightning", "ray", "boto3", "fsspec"}
#: The longest a module may be, in lines.
MOST_LINES = 450


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (lazy imports count too)."""
    found: set[str] = set()
    package = module_name(path).rsplit(".", 0 if path.name == "__init__.py" else 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            found.add(base)
            # `from spiral_lightning.core import filters` imports the module spiral_lightning.core.filters.
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted([*PACKAGE.rglob("*.py"), *RAY.rglob("*.py")])}


def own(name: str, known: dict[str, Path]) -> str | None:
    """The package module ``name`` is, or None for another library."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if parts[0] == "spiral_lightning" and len(parts) > 1 and parts[1] in ALLOWED else None


def test_each_layer_imports_only_the_layers_below_it() -> None:
    known = modules()
    wrong = []
    for name, path in known.items():
        mine = layer(name)
        if mine is None:
            continue
        for target in imports(path):
            theirs = layer(own(target, known) or "")
            if theirs is not None and theirs not in ALLOWED[mine]:
                wrong.append(f"{name} imports {target} ({mine} may import {sorted(ALLOWED[mine])})")
            if mine == "planning" and target.split(".")[0] in IO_LIBRARIES:
                wrong.append(f"{name} imports the I/O library {target}; planning is pure")
    assert wrong == []


def test_no_module_imports_itself_back() -> None:
    known = modules()
    graph = {
        name: {
            found
            for target in imports(path)
            if (found := own(target, known)) and found != name and not found.endswith(("spiral_lightning", "_moved"))
        }
        for name, path in known.items()
    }
    circles = []
    for start in graph:
        # Depth-first search for a path back to `start`.
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, trail = stack.pop()
            for following in graph[node]:
                if following == start:
                    circles.append(" -> ".join([*trail, start]))
                elif following not in seen:
                    seen.add(following)
                    stack.append((following, [*trail, following]))
    assert circles == []


def test_no_module_is_longer_than_a_reader_takes_in() -> None:
    long = {
        name: lines for name, path in modules().items() if (lines := len(path.read_text().splitlines())) > MOST_LINES
    }
    assert long == {}


def test_importing_the_package_and_its_datasets_loads_nothing_heavy() -> None:
    heavy = ["av", "PIL", "lightning", "pytorch_lightning", "ray", "sqlglot"]
    code = (
        "import sys, spiral_lightning\n"
        "from spiral_lightning import TableDataset, TableSpec, Mixture, WindowDataset, PackedDataset\n"
        "from spiral_lightning import DamagedData, StoreUnavailable, WorkerTimeout\n"
        f"print([name for name in {heavy!r} if name in sys.modules])"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


def test_the_errors_a_run_may_meet_are_served_by_the_package_but_not_listed_as_built() -> None:
    for error in (DamagedData, StoreUnavailable, WorkerTimeout):
        assert getattr(spiral_lightning, error.__name__) is error
        assert error.__name__ in dir(spiral_lightning) and error.__name__ not in spiral_lightning.__all__


def test_spiral_lightning_ray_serves_exactly_ray_adapters_names() -> None:
    # Imported here: Ray's import takes seconds that the other tests of this file do without.
    import ray_adapter
    import spiral_lightning.ray

    assert spiral_lightning.ray.__all__ == ray_adapter.__all__
    assert all(getattr(spiral_lightning.ray, name) is getattr(ray_adapter, name) for name in ray_adapter.__all__)


def test_a_demo_table_loads_neither_lightning_nor_a_model() -> None:
    """A script that only writes a demo table is imported again by every DataLoader worker (and by
    every Ray Train worker); Lightning would cost each of them seconds."""
    code = (
        "import sys\n"
        "from spiral_lightning.demos.data import corpus_tables, demo_image_folder, demo_table\n"
        "print([name for name in ('lightning', 'pytorch_lightning', 'torch') if name in sys.modules])"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
