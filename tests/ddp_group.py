"""What the two-process DDP job scripts share: their rank arguments and the gloo process group
they meet in."""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed


def rank_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--rank r`` of ``--world-size w``, meeting at ``--port``, to ``parser``."""
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)


@contextmanager
def process_group(args: argparse.Namespace) -> Iterator[None]:
    """A gloo group of the ranks ``rank_arguments`` parsed into ``args``, on 127.0.0.1; a rank
    that finishes waits for the others before the group goes."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.distributed.init_process_group("gloo", rank=args.rank, world_size=args.world_size)
    try:
        yield
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()
