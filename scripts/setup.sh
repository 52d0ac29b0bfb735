#!/usr/bin/env bash
# Creates .venv and installs the project with its dev tools, once per change of pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=".venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  # pip compiles what it installs to bytecode. Keep it (no --no-compile): where PYTHONDONTWRITEBYTECODE
  # is set, as on this project's machines, no interpreter writes bytecode later, and every process
  # would compile torch, Lightning and Ray from source (tried: the suite slowed several times over).
  .venv/bin/python -m pip install -q --upgrade pip
  # The CPU build this machine keeps on disk; an unpinned torch would download a multi-GB CUDA build.
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e '.[dev]'
  rm -f .venv/.installed-*
  touch "$stamp"
fi
