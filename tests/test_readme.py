"""Every python block of the README, saved as a script and run in a folder of its own, as a new
user would paste it: the docs cannot drift from the code.

A block runs as ``__main__`` in a process forked from the test process's forkserver, a clean
interpreter that imported torch, pyarrow and Lightning once (``warm_forkserver`` in conftest),
so a block does not spend seconds of CPU importing them again; what it starts (DataLoader
workers, DDP ranks) starts as it would from a script. A block that starts Ray runs in a fresh
interpreter: Ray's driver keeps threads and sockets a fork would share."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.objectstore import S3Server
from tests.ranks import run_processes

README = Path(__file__).resolve().parent.parent / "README.md"


def blocks() -> list[tuple[str, str]]:
    """Each python block with the heading it sits under, in order."""
    found = []
    heading = "top"
    for part in re.split(r"(^#+ [^\n]*$|^```python\n.*?^```$)", README.read_text(), flags=re.M | re.S):
        if part.startswith("#"):
            heading = part.lstrip("#").strip()
        elif part.startswith("```python"):
            found.append((heading, part.removeprefix("```python\n").removesuffix("```")))
    return found


BLOCKS = blocks()


def test_the_readme_has_its_quickstarts() -> None:
    headings = [heading for heading, _ in BLOCKS]
    for quickstart in ("Quickstart: torch", "Quickstart: Lightning", "Ray Train, plain loop"):
        assert quickstart in headings


@pytest.mark.slow
@pytest.mark.parametrize(
    ("heading", "code"), BLOCKS, ids=[f"{index}-{heading}" for index, (heading, _) in enumerate(BLOCKS)]
)
def test_a_readme_block_runs_as_a_script(
    heading: str, code: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    environment: dict[str, str] = {}
    if "s3://" in code:
        # The examples name the bucket my-bucket and take the store from the environment.
        server: S3Server = request.getfixturevalue("s3_server")
        server.make_bucket("my-bucket")
        environment.update(
            AWS_ENDPOINT_URL=server.endpoint,
            AWS_ACCESS_KEY_ID=server.access_key,
            AWS_SECRET_ACCESS_KEY=server.secret_key,
            AWS_REGION=server.region,
        )
    if re.search(r"^\s*(import|from) ray\b", code, flags=re.M):
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env={**os.environ, **environment},
            capture_output=True,
            text=True,
            timeout=500,
            check=False,
        )
        codes, printed = [done.returncode], done.stderr
    else:
        codes, printed, _ = run_processes(run_script, [[str(script)]], [environment], tmp_path, timeout=500)
    assert codes == [0], f"the block under {heading!r} failed:\n{printed[-5000:]}"


def run_script(argv: Sequence[str]) -> None:
    """In a forked process: run the script ``argv[0]`` from its folder as ``python script``
    would, with ``__name__`` set to ``"__main__"``."""
    script = Path(argv[0])
    os.chdir(script.parent)
    sys.argv = [str(script)]
    sys.path[0] = str(script.parent)
    runpy.run_path(str(script), run_name="__main__")
