#!/usr/bin/env bash
# Fetches, on a machine with a package index, the wheels scripts/gpu_check.sh
# installs on the GPU machine (Python 3.12, x86-64; it has jax, CUDA and NCCL).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip download -q --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform any \
  -d wheels -r scripts/gpu_requirements.txt
du -sh wheels
