#!/usr/bin/env bash
# Installs the loaders benchmarks/peers.py compares against (Lance, LitData, MosaicML Streaming)
# into benchmarks/.peers, beside the project and outside its virtualenv. Run scripts/setup.sh first.
#
# Why this way:
# - Every package goes in with --no-deps. LitData and Streaming require torch and torchvision, and
#   an unpinned torch from the registry is a multi-GB CUDA build that would replace the CPU torch
#   in .venv. What they need to import and run is listed here by hand instead (found by importing
#   them until nothing was missing); packages .venv already has (numpy, pyarrow, requests, tqdm,
#   filelock, fsspec, pyyaml, lightning-utilities, matplotlib, ...) are not installed again.
# - A folder of its own (--target), not .venv: the test suite runs on .venv, and some of its
#   benchmarks measure a peer only where it imports; the project's own dependencies stay as
#   pyproject.toml says. benchmarks/peers.py adds the folder to its import path itself; other
#   scripts get it with PYTHONPATH=benchmarks/.peers. Delete the folder to uninstall.
# - Not installed: torchvision. The registry's build for torch 2.13 links CUDA torch libraries that
#   the CPU torch lacks, so it does not load. Streaming imports it only for its vision datasets;
#   benchmarks/peers.py stands an empty module in for streaming.vision (MDS needs none of it).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "no .venv: run scripts/setup.sh first" >&2; exit 1; }
target=benchmarks/.peers
# A clean folder each time: pip --target leaves an older version's metadata beside a newer one.
rm -rf "$target"
packages=(
  # Lance: its Rust scanner, and the namespace client it imports.
  pylance==14.0.2 lance-namespace==0.13.0 lance-namespace-urllib3-client==0.13.0
  # LitData and what it imports at start: S3 clients, TIFF reading, object store.
  litdata==0.2.76 boto3 botocore s3transfer jmespath tifffile obstore
  # MosaicML Streaming: its compressors and hashes, and transformers, which its data loader
  # imports for one type (transformers 5 is refused by Streaming's own requirement).
  mosaicml-streaming==0.13.0 Brotli python-snappy cramjam zstd xxhash catalogue
  'transformers<5' 'huggingface_hub<1.0' regex 'tokenizers>=0.22,<0.23'
)
.venv/bin/python -m pip install -q --no-deps --target "$target" "${packages[@]}"
# The check that torch was left alone: still the CPU build .venv had.
.venv/bin/python -c "import torch; assert torch.__version__.endswith('+cpu'), torch.__version__"
ls "$target" | grep -q '^torch' && { echo "a torch package landed in $target" >&2; exit 1; }
echo "peers installed in $target"
