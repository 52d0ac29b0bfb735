"""Every python block of the README and of docs/*.md, saved as a script and run in a folder of its
own, as a new user would paste it: the docs cannot drift from the code.

A block runs as ``__main__`` in a process forked from the test process's forkserver, a clean
interpreter that imported torch, pyarrow and Lightning once (``warm_forkserver`` in conftest),
so a block does not spend seconds of CPU importing them again; its DataLoader workers come from
that server too (see ``tests/ranks.py``), and DDP ranks start as they would from a script. A
block that starts Ray runs in a fresh interpreter: Ray's driver keeps threads and sockets a fork
would share."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.objectstore import S3Server
from tests.ranks import run_processes, run_script

README = Path(__file__).resolve().parent.parent / "README.md"
DOCS = README.parent / "docs"


def blocks(page: Path) -> list[tuple[str, str]]:
    """Each python block of ``page`` with the heading it sits under, in order."""
    found = []
    heading = "top"
    for part in re.split(r"(^#+ [^\n]*$|^```python\n.*?^```$)", page.read_text(), flags=re.M | re.S):
        if part.startswith("#"):
            heading = part.lstrip("#").strip()
        elif part.startswith("```python"):
            found.append((heading, part.removeprefix("```python\n").removesuffix("```")))
    return found


#: The README, then every page of docs/ by name.
PAGES = [README, *sorted(DOCS.glob("*.md"))]
#: Each python block of every page: its test id (page, index in the page, heading), heading and code.
BLOCKS = [
    (f"{page.stem}-{index}-{heading}", heading, code)
    for page in PAGES
    for index, (heading, code) in enumerate(blocks(page))
]


def test_the_readme_has_its_quickstarts() -> None:
    headings = [heading for heading, _ in blocks(README)]
    for quickstart in ("Quickstart: torch", "Quickstart: Lightning", "Ray Train, plain loop"):
        assert quickstart in headings


def test_the_readme_stays_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines < 300, f"README.md has {lines} lines: move the depth to a page of docs/"


def test_the_readme_links_every_page_of_the_docs() -> None:
    links = set(re.findall(r"\]\((docs/[^)#\s]+)", README.read_text()))
    unlinked = [page.name for page in PAGES[1:] if f"docs/{page.name}" not in links]
    assert not unlinked, f"README.md links no docs/ page named {unlinked}"


@pytest.mark.slow
@pytest.mark.parametrize(("heading", "code"), [block[1:] for block in BLOCKS], ids=[block[0] for block in BLOCKS])
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
