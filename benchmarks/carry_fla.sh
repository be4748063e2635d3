#!/usr/bin/env bash
# Builds build/fla: flash-linear-attention and what it imports that the GPU machine lacks (fla-core,
# einops, transformers, tokenizers, regex for CPython 3.12), as plain folders to put on PYTHONPATH
# there. To stay small (about 30 MB), transformers keeps only its `auto` models (fla's own models
# import nothing else of it) and the three the integration's tests build (llama, kimi_linear,
# glm5_next), and does not enforce its pinned versions of the machine's libraries.
# Needs PyPI (or a wheel mirror) on this machine.
#   bash benchmarks/carry_fla.sh [FLA_VERSION]    then, on the GPU machine:
#   PYTHONPATH=.:build/fla python benchmarks/prefill.py --tokens 1024 4096 16384 65536
set -euo pipefail
version=${1:-0.6.0}
dest=build/fla; wheels=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$wheels" \
  "flash-linear-attention==$version" "fla-core==$version" einops "transformers>=5.17,<5.18" "tokenizers>=0.22,<0.23" regex
rm -rf "$dest"; mkdir -p "$dest"
for wheel in "$wheels"/*.whl; do python3 -m zipfile -e "$wheel" "$dest"; done
find "$dest/transformers/models" -mindepth 1 -maxdepth 1 -type d ! -name auto ! -name llama ! -name kimi_linear \
  ! -name glm5_next -exec rm -rf {} +
sed -i 's/^        require_version_core(deps\[pkg\])/        pass/' "$dest/transformers/dependency_versions_check.py"
rm -rf "$wheels"; du -sh "$dest"
