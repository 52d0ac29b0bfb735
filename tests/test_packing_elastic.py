"""Packed streams re-planned for another topology or batch size: the documents no saved consumer
began arrive once, the one each saved consumer was inside of arrives again whole, no fully
delivered document comes again, and only the new streams' tails shorter than a block are left
out; checked by token id (every token's id is unique) over layouts, stops and topologies, with
states saved by real DataLoader workers."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from spiral_lightning import PackedDataset, TableSpec
from spiral_lightning.lightning.loader import consumer_states
from tests.examples import examples
from tests.tables import write_uneven
from tests.test_elastic_lightning import stopped_and_resumed
from tests.test_packing import SEPARATOR, corpus, documents

EXAMPLES = examples(
    20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
LENGTH = 8


def packed(spec: TableSpec, batch_size: int, rank: int = 0, world_size: int = 1, **options: Any) -> PackedDataset:
    return PackedDataset(
        spec,
        column="tokens",
        length=LENGTH,
        batch_size=batch_size,
        separator=SEPARATOR,
        rank=rank,
        world_size=world_size,
        **options,
    )


def tokens_of(batches: Any) -> list[int]:
    return [token for batch in batches for token in batch["tokens"].flatten().tolist() if token != SEPARATOR]


def check_re_planned(lengths: list[int], before: list[int], after: list[int], saved: int, new_consumers: int) -> None:
    """``before`` then ``after`` deliver every document once, but for at most one document a saved
    consumer that comes again whole, and the new streams' tails (under a block each) left out."""
    docs = documents(lengths)
    owner = {token: number for number, doc in enumerate(docs) for token in doc}
    once, again = Counter(before), Counter(after)
    assert max(once.values(), default=1) == 1 and max(again.values(), default=1) == 1
    twice = {owner[token] for token in once.keys() & again.keys()}
    assert len(twice) <= saved, f"{len(twice)} documents came twice from {saved} saved consumers"
    for number in twice:
        # Read again from its first token (a new stream's dropped tail may cut it short).
        read = [token for token in after if owner[token] == number]
        assert read == docs[number][: len(read)], "re-read, but not from its start"
    missing = sum(lengths) - len(once.keys() | again.keys())
    # Each new stream drops its tail (separators count toward it), so under a block's tokens each.
    assert 0 <= missing < new_consumers * LENGTH, missing


@EXAMPLES
@given(
    lengths=st.lists(st.integers(0, 30), min_size=8, max_size=60),
    splits=st.integers(1, 6),
    stops=st.lists(st.integers(0, 4), min_size=4, max_size=4),
    old=st.sampled_from([2, 4]),
    new=st.sampled_from([1, 3, 5]),
    batches=st.sampled_from([(2, 2), (2, 3), (3, 1)]),
)
def test_a_packed_epoch_re_plans_for_other_ranks_and_batch_sizes(
    tmp_path_factory: pytest.TempPathFactory,
    lengths: list[int],
    splits: int,
    stops: list[int],
    old: int,
    new: int,
    batches: tuple[int, int],
) -> None:
    sizes = [len(part) for part in np.array_split(np.arange(len(lengths)), splits)]
    spec = write_uneven(tmp_path_factory.mktemp("packed") / "t", corpus(lengths), sizes)
    before: list[int] = []
    states = []
    for rank in range(old):
        saving = packed(spec, batches[0], rank, old)
        before += tokens_of(itertools.islice(iter(saving), stops[rank]))
        states.append(saving.state_dict())
    after: list[int] = []
    for rank in range(new):
        resumed = packed(spec, batches[1], rank, new)
        resumed.load_elastic(states)
        after += tokens_of(resumed)
    check_re_planned(lengths, before, after, saved=old, new_consumers=new)


def test_real_workers_saved_as_2x2_resume_as_one_process_in_other_batches(tmp_path: Path) -> None:
    lengths = [int(n) for n in np.random.default_rng(0).integers(0, 40, 400)]
    spec = write_uneven(tmp_path / "t", corpus(lengths), [100, 100, 50, 150])
    before: list[int] = []
    states = []
    for rank in range(2):
        loader = packed(spec, 4, rank, 2).loader(num_workers=2)
        before += tokens_of(itertools.islice(iter(loader), 7))
        states += consumer_states(loader.state_dict())
        del loader
    resumed = packed(spec, 6)
    resumed.load_elastic(states)
    lineage = resumed.lineage()
    assert lineage is not None and len(lineage["links"]) == 1
    reading = iter(resumed.loader(num_workers=0))
    after = tokens_of(itertools.islice(reading, 5))
    # The re-planned epoch stops and resumes again from its lineage, under the same layout.
    state = resumed.state_dict()
    again = packed(spec, 6)
    again.load_lineage(lineage)
    again.load_state_dict(state)
    after += tokens_of(again)
    check_re_planned(lengths, before, after, saved=4, new_consumers=1)


def test_a_packed_state_of_another_stream_is_refused_in_a_re_plan(tmp_path: Path) -> None:
    spec = write_uneven(tmp_path / "t", corpus([5, 9, 3, 20]), [4])
    saving = packed(spec, 1)
    next(iter(saving))
    state = saving.state_dict()
    with pytest.raises(ValueError, match="length: saved 8, now 4"):
        PackedDataset(spec, column="tokens", length=4, batch_size=1, separator=SEPARATOR).load_elastic([state])
    with pytest.raises(ValueError, match="was edited or damaged"):
        packed(spec, 1).load_elastic([{**state, "offset": state["offset"] + 1}])


def test_a_2_rank_ddp_packed_run_resumes_as_one_process(tmp_path: Path) -> None:
    lengths = [int(n) for n in np.random.default_rng(1).integers(0, 40, 300)]
    spec = write_uneven(tmp_path / "t", corpus(lengths), [80, 70, 90, 60])
    # 2 ranks x 2 workers, 3 batches of 4 blocks each rank, then one process without workers.
    before, after = stopped_and_resumed(tmp_path, spec.uri, 3, "--batch-size", "4", "--packed", str(LENGTH))
    before, after = [t for t in before if t != SEPARATOR], [t for t in after if t != SEPARATOR]
    assert len(before) > 0 and len(after) > 0
    check_re_planned(lengths, before, after, saved=4, new_consumers=1)
