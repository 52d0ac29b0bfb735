"""The shipped YAML experiments: settings a user copies should be the ones that run well."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[path.name for path in CONFIGS])
def test_configs_that_train_several_epochs_keep_their_workers(path: Path) -> None:
    config = yaml.safe_load(path.read_text())
    data = config["data"]["init_args"]
    if config["trainer"].get("max_epochs", 1) > 1 and data.get("num_workers", 0) > 0:
        # Workers restarted every epoch pay their start-up again, each epoch.
        assert data.get("persistent_workers") is True, f"{path.name} trains several epochs without persistent workers"
