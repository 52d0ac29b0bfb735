"""The module paths of release 0.1 keep working for one release: each names the very object that
now lives in a subpackage, with a DeprecationWarning that says where it went."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest

import spiral_lightning
from spiral_lightning._moved import MOVED

#: Old deep paths the README, configs and users' code named, and where each lives now.
OLD_PATHS = {
    "spiral_lightning.ingest.ingest_images": "spiral_lightning.media.ingest.ingest_images",
    "spiral_lightning.loader.consumer_states": "spiral_lightning.lightning.loader.consumer_states",
    "spiral_lightning.loader.TableLoader": "spiral_lightning.datasets.loader.TableLoader",
    "spiral_lightning.padding.VALID": "spiral_lightning.lightning.padding.VALID",
    "spiral_lightning.demo.DemoModel": "spiral_lightning.demos.tabular.DemoModel",
    "spiral_lightning.demo.DemoDataModule": "spiral_lightning.demos.tabular.DemoDataModule",
    "spiral_lightning.demo_lm.BigramLM": "spiral_lightning.demos.lm.BigramLM",
    "spiral_lightning.demo_images.ImageDemoModel": "spiral_lightning.demos.images.ImageDemoModel",
    "spiral_lightning.dataset.TableDataset": "spiral_lightning.datasets.table.TableDataset",
    "spiral_lightning.work.balanced": "spiral_lightning.planning.policies.balanced",
    "spiral_lightning.work.Shard": "spiral_lightning.core.plan.Shard",
    "spiral_lightning.media.Image": "spiral_lightning.core.media.Image",
    "spiral_lightning.media.decode_image": "spiral_lightning.media.decode.decode_image",
    "spiral_lightning.storage.StorageOptions": "spiral_lightning.core.storage.StorageOptions",
}


def named(path: str) -> object:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_an_old_path_names_the_same_object_and_says_where_it_moved(old: str) -> None:
    module = old.rpartition(".")[0]
    if module in MOVED:
        sys.modules.pop(module, None)
    with pytest.warns(DeprecationWarning, match=re.escape(module) + r"(\.\w+)? moved to"):
        found = named(old)
    assert found is named(OLD_PATHS[old])


def test_every_old_module_resolves_every_name_it_had() -> None:
    for old, targets in MOVED.items():
        for target in targets:
            module = importlib.import_module(target)
            public = [name for name in vars(module) if not name.startswith("_") and name != "annotations"]
            alias = importlib.import_module(old)
            assert all(getattr(alias, name) is getattr(module, name) for name in public if name not in vars(alias))


def test_an_unknown_name_of_an_old_path_says_where_the_module_went() -> None:
    alias = importlib.import_module("spiral_lightning.loader")
    with pytest.raises(AttributeError, match=r"moved to spiral_lightning\.lightning\.loader"):
        alias.no_such_name  # noqa: B018


def test_every_public_name_is_importable_from_the_package() -> None:
    for name in spiral_lightning.__all__:
        assert getattr(spiral_lightning, name) is not None
    assert sorted(spiral_lightning.__all__) == spiral_lightning.__all__


def test_a_config_naming_an_old_class_path_still_builds_the_model() -> None:
    code = (
        "from jsonargparse import ArgumentParser\n"
        "parser = ArgumentParser()\n"
        "parser.add_argument('--model', type=object)\n"
        "import importlib\n"
        "cls = getattr(importlib.import_module('spiral_lightning.demo'), 'DemoModel')\n"
        "print(cls.__module__)\n"
    )
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "spiral_lightning.demos.tabular"


def test_an_old_module_path_still_runs_with_python_m() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "spiral_lightning.cli", "bench", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: spiral-lightning bench")


def test_checkpoint_position_is_read_from_its_old_module_with_a_warning() -> None:
    """Moved to ``lightning.callbacks`` in 0.2, so that Ray Train's loaders start without Lightning."""
    from spiral_lightning.lightning import callbacks, checkpoint

    with pytest.warns(DeprecationWarning, match=r"moved to spiral_lightning\.lightning\.callbacks"):
        assert checkpoint.CheckpointPosition is callbacks.CheckpointPosition
    with pytest.raises(AttributeError, match="has no attribute 'Nothing'"):
        checkpoint.Nothing  # noqa: B018


def test_ray_trains_loaders_import_no_lightning() -> None:
    code = "import sys, ray_adapter; print(sorted(m for m in sys.modules if m.startswith('lightning')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["[]"]
