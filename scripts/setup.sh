#!/usr/bin/env bash
# Creates .venv and installs the project with its dev tools, once per change of pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=".venv/.installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  # --no-compile: pip would compile every module of torch, Ray and the rest to bytecode (about 50 s
  # of a fresh set-up here); the interpreter compiles the few it imports on first use instead.
  .venv/bin/python -m pip install -q --no-compile --upgrade pip
  # The CPU build this machine keeps on disk; an unpinned torch would download a multi-GB CUDA build.
  .venv/bin/python -m pip install -q --no-compile torch==2.13.0
  .venv/bin/python -m pip install -q --no-compile -e '.[dev]'
  rm -f .venv/.installed-*
  touch "$stamp"
fi
