#!/usr/bin/env bash
# The GPU check, in one call on the GPU machine (no package index there):
#   1. installs the wheels it must carry (scripts/gpu_wheels.sh fetches them on
#      a machine with an index into ./wheels) and builds jaxfog from this tree;
#   2. runs the GPU tests: tests/test_gpu.py (NCCL, host staging, simulated
#      agents on the GPU), then the multi-rank suite on GPU arrays, host-staged
#      (JAXFOG_BACKEND=mpi, 2-4 ranks sharing the GPU) and over NCCL where
#      NCCL accepts the ranks;
#   3. runs the GPU benchmarks, writing their tables under $OUT.
# Usage (device tool):  bash scripts/gpu_check.sh   with carry=["wheels"]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
WHEELS=${JAXFOG_WHEELS:-wheels}
LOG="$OUT/gpu_check.log"
mkdir -p "$OUT"
status=0
step() { echo "== $*" | tee -a "$LOG"; }
run() { "$@" 2>&1 | tee -a "$LOG"; local rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || status=1; return "$rc"; }

step "machine"
run nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
run python -c "import jax; print(jax.__version__, jax.devices())"

step "install carried wheels and build jaxfog (CUDA + NCCL)"
if [ -d "$WHEELS" ]; then
  run python -m pip install --no-index --find-links "$WHEELS" -q -r scripts/gpu_requirements.txt
fi
rm -rf build jaxfog/ffi/libjaxfog_ffi.so
run python -m pip install --no-index --no-build-isolation --no-deps -q -e . || exit 1
run jaxfog info

step "GPU tests"
run python -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_build.py
step "optax and simulation tests on GPU arrays (simulated agents on one GPU)"
run python -m pytest -q -p no:cacheprovider tests/test_sim.py tests/test_optax.py tests/test_compressed_optax.py
step "multi-rank suite on GPU arrays, host-staged MPI"
JAXFOG_TEST_PLATFORMS=cuda JAXFOG_BACKEND=mpi run python -m pytest -q -p no:cacheprovider \
  tests/test_ops_mpi.py tests/test_optax_mpi.py tests/test_window_mpi.py tests/test_train_digits.py
step "multi-rank suite on GPU arrays, NCCL (where NCCL accepts ranks sharing one GPU)"
JAXFOG_TEST_PLATFORMS=cuda run python -m pytest -q -p no:cacheprovider \
  tests/test_ops_mpi.py tests/test_optax_mpi.py

step "GPU benchmarks"
run python benchmarks/bench_gpu.py --out "$OUT"
echo "gpu_check: exit $status" | tee -a "$LOG"
exit "$status"
