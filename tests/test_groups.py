"""Workers send small batches in groups; a state saved between two batches of a group resumes
exactly where it was, in the same order as a run that never stopped."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from spiral_lightning import PackedDataset, TableDataset, TableSpec
from spiral_lightning.datasets.groups import GROUP_LEFT, MOST_GROUPED, Grouped, group_size


def test_small_batches_are_grouped_and_large_ones_and_token_blocks_are_not(
    make_table: Callable[..., TableSpec],
) -> None:
    spec = make_table([100])
    assert group_size(TableDataset(spec, batch_size=10)) == MOST_GROUPED
    assert group_size(TableDataset(spec, batch_size=1024)) == 4
    assert group_size(TableDataset(spec, batch_size=4096)) == 1
    assert group_size(TableDataset(spec)) == 1  # each read batch is a batch: no size to group by
    assert PackedDataset.GROUPS is False  # its batches are blocks of tokens, not rows
    assert isinstance(TableDataset(spec, batch_size=10).loader(num_workers=1).dataset, Grouped)
    assert isinstance(TableDataset(spec, batch_size=10).loader(num_workers=0).dataset, TableDataset)


@pytest.mark.slow
@pytest.mark.parametrize("stop", [5, 16, 23, 37, 99])
def test_a_state_saved_inside_a_group_resumes_in_the_uninterrupted_order(
    make_table: Callable[..., TableSpec], stop: int
) -> None:
    spec = make_table([130] * 7 + [90])
    whole = [batch["id"].tolist() for batch in TableDataset(spec, batch_size=10).loader(num_workers=2)]
    assert sorted(row for batch in whole for row in batch) == list(range(1000))
    loader = TableDataset(spec, batch_size=10).loader(num_workers=2)
    batches = iter(loader)
    before = [next(batches)["id"].tolist() for _ in range(stop)]
    state = loader.state_dict()
    # Inside a group the state says which worker was sending it and what it had left.
    assert (GROUP_LEFT in state) == (stop % MOST_GROUPED != 0)
    del batches, loader
    resumed = TableDataset(spec, batch_size=10).loader(num_workers=2)
    resumed.load_state_dict(state)
    after = [batch["id"].tolist() for batch in resumed]
    assert before + after == whole
    # The next epoch of the resumed loader groups from the start again.
    assert [batch["id"].tolist() for batch in resumed] == whole
