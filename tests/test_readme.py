"""Every python block of the README, saved as a script and run in a folder of its own, as a new
user would paste it: the docs cannot drift from the code."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.objectstore import S3Server

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
    environment = dict(os.environ)
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
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=500,
        check=False,
    )
    assert done.returncode == 0, f"the block under {heading!r} failed:\n{done.stderr[-5000:]}"
