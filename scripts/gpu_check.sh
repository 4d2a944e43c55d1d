#!/usr/bin/env bash
# The GPU check in one device call: every stage in priority order under one
# global deadline, every stage's log written under $OUT as it goes.
#
#   bash scripts/gpu_wheels.sh                 # here: the mpich wheel into wheels/
#   bash scripts/gpu_check.sh                  # device tool: carry=["wheels"], timeout_s=480
#   bash scripts/gpu_check.sh STAGE...         # only these stages, in the order given
#
# Why one call: the GPU machine is lent 15 minutes per session, each start
# (about a minute) included; a command may run 10 minutes; it stays warm 30 s;
# only 8 files come back from $OUT. So the default run takes at most
# GPU_CHECK_DEADLINE seconds (default 420) and writes at most 8 files, and each
# stage has a time budget (budget_of below; the default stages' sum to 420 s):
# a slow stage is cut at its budget, not at the cost of the stages after it
# (with one deadline only, the 2026-11-27 run never reached training and gave
# lm 46 s).
#
# Default stages, most important first (the crash check leads; a failed build
# ends the run, since nothing after it can load the library):
#   build           the carried MPI wheel installed; jaxfog built (only if the library
#                   is missing or stale: pip install --no-build-isolation --no-deps -e .);
#                   `jaxfog info`; the exported-symbol check (no std::, GNU_UNIQUE,
#                   cuda* or nccl* symbol)
#   gpu-tests       tests/gpu/test_gpu.py whole (staged and nccl are parts of it)
#   exit            scripts/exit_probe.py on the GPU: how long a process that used it
#                   takes to exit, phase by phase (NCCL, host-staged, 2 ranks)
#   mpi-suite       tests/ops/test_ops_mpi.py and test_nonblocking_mpi.py on GPU arrays,
#                   host-staged, each test at its smallest rank count
#   bench-exchange  exchange 4 KB..64 MB (NCCL, staged) against device copies and
#                   pinned host round trips, the staged allgather against its floor
#                   (pinned copies); dispatch (bench_gpu.py --short)
#   bench-sim       the simulation backend, n = 16, 128, 1024, d = 1e4, 1e6, 1e7
#   lm              examples/train_lm.py --size gpu, 100 steps of allreduce, float32
#                   then bfloat16 (tokens/s, MFU)
#   overlap         benchmarks/bench_overlap.py on the CPU cores: how much of an
#                   exchange start/wait and one step hide behind the backward pass
#                   (every rank computing; rank 0 only; then a peer 30 ms late)
#   training        windows, the digits demo and optax on GPU arrays, host-staged,
#                   each test at its smallest rank count (last: the longest; one
#                   optax test alone took 93 s on the H200, so its budget ends it)
# Explicit only: probe (the machine), mpi (a 2-rank MPI hello), units (build, JAX-compat
# and C++ unit tests), staged and nccl (the two halves of gpu-tests), throughput
# (benchmarks/bench_throughput.py on the CPU cores: steps per second of every method,
# digits MLP on 4 and 8 ranks, then the language model on 4; its own call:
# `bash scripts/gpu_check.sh build throughput`).
#
# Files under $OUT (8 at most; each log is appended to while its steps run, so a
# step killed at its limit keeps what it printed):
#   summary.log      one line per step: start, limit, exit status, seconds; skips
#   build.log        probe, mpi, build, units
#   gpu.log          gpu-tests, staged, nccl, exit
#   suites.log       mpi-suite, training
#   bench.log        bench-sim, bench-exchange, lm, overlap
#   simulate_DEV.md, exchange_DEV.md, dispatch_2ranks_DEV.md: the tables, named by the
#                    device (DEV from nvidia-smi: h200, h100, ...), as they belong in
#                    benchmarks/results/
#
# Time: each step runs under `timeout` with min(its own limit, what is left of the
# deadline less a kill grace); a step that would get under GPU_CHECK_MIN_STEP
# seconds (default 5) is skipped and said so. pytest gets per-test timeouts
# shorter than its step (pytest-timeout where installed, else faulthandler's
# stack dump), and scripts/pytest_progress.py prints each test's outcome and
# failure report as it ends.
#
# Environment: OUT (default /tmp/gpu_check), GPU_CHECK_DEADLINE (seconds, default
# 420), GPU_CHECK_MIN_STEP, GPU_CHECK_PLAN=1 (print the stages' budgets, the steps
# and their limits, run nothing), GPU_CHECK_BUDGETS=0 (no stage budgets: a stage
# named alone, e.g. training, runs to its steps' own limits), GPU_CHECK_NO_BUILD=1
# (never build; fail if the library is missing or stale), PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/gpu_check}
DEADLINE=${GPU_CHECK_DEADLINE:-420}
MIN_STEP=${GPU_CHECK_MIN_STEP:-5}
PLAN=${GPU_CHECK_PLAN:-0}
BUDGETS=${GPU_CHECK_BUDGETS:-1}
PY=${PYTHON:-python3}
GRACE=5        # timeout's --kill-after: SIGKILL this long after SIGTERM
MAX_FILES=8    # what the device tool brings back
mkdir -p "$OUT"
SUMMARY="$OUT/summary.log"
LOG="$SUMMARY"
# Several processes share the one GPU: none may take 75% of it up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}"  # pytest_progress
status=0
skipped=()
failed=()

elapsed() { echo $((SECONDS)); }
say() {
  local line="== [$(elapsed)s] $*"
  echo "$line"
  echo "$line" >>"$SUMMARY"
  [ "$LOG" = "$SUMMARY" ] || echo "$line" >>"$LOG"
}

# Seconds each stage may take, its steps together. Measured on the H200
# (2026-11-27, seconds): build 25, gpu-tests 27, exit 15, mpi-suite 184 with every
# rank count (about 80 with the smallest), bench-exchange 67 + dispatch 22 at the
# full grids, bench-sim 149 at the full grid, lm 75 for 200 steps of 3 methods,
# overlap 24; training never ran whole. bench-sim now times a second path (the
# tiled kernel, a Triton compile per shape): 65, not yet measured. The default
# stages' budgets sum to 420.
budget_of() {
  case $1 in
    build) echo 35 ;;
    gpu-tests) echo 30 ;;
    exit) echo 20 ;;
    mpi-suite) echo 85 ;;
    bench-exchange) echo 55 ;;
    bench-sim) echo 65 ;;
    lm) echo 60 ;;
    overlap) echo 30 ;;
    training) echo 40 ;;
    probe | mpi) echo 60 ;;
    throughput) echo 420 ;;
    staged | nccl) echo 60 ;;
    units) echo 300 ;;
  esac
}

# limit_of OWN: a step's limit, the smallest of its own, what is left of the
# deadline (less the kill grace) and what is left of its stage's budget.
STAGE_END=0
limit_of() {
  local own=$1 left=$((DEADLINE - SECONDS - GRACE))
  [ "$left" -lt "$own" ] && own=$left
  if [ "$BUDGETS" != 0 ] && [ $((STAGE_END - SECONDS)) -lt "$own" ]; then
    own=$((STAGE_END - SECONDS))
  fi
  echo "$own"
}

# step NAME LIMIT COMMAND...: COMMAND bounded by LIMIT, the deadline and the
# stage's budget, its output appended to the stage's log. 0 ok, 125 skipped, else
# its exit status (a failure counts against the run unless STEP_SOFT=1: a
# question, not a check).
STEP_LIMIT=0
step() {
  local name=$1 own=$2
  shift 2
  STEP_LIMIT=$(limit_of "$own")
  if [ "$STEP_LIMIT" -lt "$MIN_STEP" ]; then
    if [ $((DEADLINE - SECONDS - GRACE)) -lt "$MIN_STEP" ]; then
      say "SKIP $name: $((DEADLINE - SECONDS)) s left of the ${DEADLINE} s deadline"
    else
      say "SKIP $name: $((STAGE_END - SECONDS)) s left of its stage's budget"
    fi
    skipped+=("$name")
    return 125
  fi
  if [ "$PLAN" = 1 ]; then
    local command="$*"
    say "PLAN $name (limit ${STEP_LIMIT} s): ${command//$'\n'/ }"
    return 0
  fi
  say "$name (limit ${STEP_LIMIT} s)"
  local begin=$SECONDS marker="$$.$SECONDS.$name"
  GPU_CHECK_STEP=$marker timeout --kill-after=$GRACE "$STEP_LIMIT" "$@" >>"$LOG" 2>&1
  local rc=$?
  sweep "$marker" "$name"
  local took=$((SECONDS - begin))
  if [ "$rc" = 0 ]; then
    say "$name ok (${took} s)"
  else
    case $rc in
      124 | 137) say "$name TIMED OUT at ${STEP_LIMIT} s (exit $rc)" ;;
      *) say "$name FAILED: exit $rc after ${took} s" ;;
    esac
    if [ -z "${STEP_SOFT:-}" ]; then status=1 failed+=("$name"); fi
  fi
  # pytest_progress stamps pytest's end: the gap to here is the process's exit.
  echo "[gpu_check] step $name ended at $(date +%s.%N | cut -c1-14) (epoch s)" >>"$LOG"
  return "$rc"
}

# sweep MARKER NAME: kills what a step left running. timeout ends its process
# group, but MPI launches (run_mpi, mpiexec) start sessions of their own; the
# step's marker in their environment finds them.
sweep() {
  local pid left=()
  for pid in $(grep -lsa "GPU_CHECK_STEP=$1" /proc/[0-9]*/environ | cut -d/ -f3); do
    [ "$pid" = $$ ] || left+=("$pid")
  done
  [ ${#left[@]} = 0 ] && return
  kill -KILL "${left[@]}" 2>/dev/null
  say "$2 left ${#left[@]} processes running: killed"
}

# pytest_ NAME LIMIT ARGS...: per-test timeouts well inside the step's, so a hung
# test fails with its traceback and the session goes on to report.
pytest_() {
  local name=$1 own=$2
  shift 2
  local limit
  limit=$(limit_of "$own")
  local per_test=$((limit > 150 ? 120 : limit * 4 / 5))
  local timeouts=(-o "faulthandler_timeout=$per_test")
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    timeouts=(--timeout="$per_test")
  fi
  step "$name" "$own" "$PY" -m pytest -q -rfE -p no:cacheprovider -p pytest_progress \
    "${timeouts[@]}" "$@"
}

# The device's short name (nvidia-smi "NVIDIA H200" -> h200), for table names.
device_tag() {
  local name
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
  name=$(echo "${name#NVIDIA }" | awk '{print tolower($1)}' | tr -cd 'a-z0-9')
  echo "${name:-nogpu}"
}

# keep SOURCE NAME: a table copied to $OUT/NAME and benchmarks/results/NAME,
# unless $OUT already holds MAX_FILES files.
keep() {
  local source=$1 name=$2
  [ "$PLAN" = 1 ] && return 0
  [ -f "$source" ] || { say "no table $source"; return 1; }
  cp "$source" "benchmarks/results/$name"
  if [ ! -e "$OUT/$name" ] && [ "$(find "$OUT" -type f | wc -l)" -ge "$MAX_FILES" ]; then
    say "no room under \$OUT for $name ($MAX_FILES files at most): see benchmarks/results/"
    return 1
  fi
  cp "$source" "$OUT/$name" && say "table $name"
}

install_wheels() {
  if command -v mpicxx >/dev/null && "$PY" -c "from mpi4py import MPI" 2>/dev/null; then
    return 0
  fi
  if ! ls wheels/*.whl >/dev/null 2>&1; then
    say "no MPI here and no wheels/ carried: run scripts/gpu_wheels.sh, carry wheels"
    return 1
  fi
  step wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile wheels/*.whl
}

build() {
  install_wheels || return 1
  # The library knows whether its sources changed (setup.py's fingerprint).
  STEP_SOFT=1 step library-current 60 "$PY" -c "
import jaxfog.ffi as f
f.library()
assert f.build_info()['nccl_built'] or not f.build_info()['cuda_built'], 'built without NCCL'
" && return 0
  [ $? = 125 ] && return 125
  if [ "${GPU_CHECK_NO_BUILD:-0}" = 1 ]; then
    say "the library is missing or stale, and GPU_CHECK_NO_BUILD=1"
    return 1
  fi
  step build 300 "$PY" -m pip install --no-index --no-build-isolation --no-deps -e .
}

stage_probe() {
  step nvidia-smi 30 nvidia-smi --query-gpu=name,uuid,memory.total,driver_version --format=csv
  step versions 60 bash -c "$PY --version; nvcc --version | tail -n 2; \
    ls -l /usr/local/cuda/include/cuda_runtime.h /usr/local/cuda/lib64/libcudart_static.a; \
    $PY -m pip list --format=freeze 2>/dev/null | grep -iE \
    '^(jax|jaxlib|jax-cuda|nvidia-nccl|mpi4py|mpich|flax|optax|setuptools|pytest)'"
  step jax-devices 60 "$PY" -c "import jax; print(jax.__version__, jax.devices())"
}

stage_mpi() {
  install_wheels || return 1
  step mpi-hello 60 mpiexec -n 2 "$PY" -c "
from mpi4py import MPI
c = MPI.COMM_WORLD
assert c.allreduce(c.rank) == 1
print(c.rank, 'of', c.size, MPI.Get_library_version().splitlines()[0])"
}

stage_build() {
  build || return
  step info 60 jaxfog info || return
  # The first GPU run died in every process: the library exported the static
  # libstdc++ it carried (std:: and GNU_UNIQUE symbols). Only jaxfog's own
  # entry points may be exported.
  step exported-symbols 30 bash -c '
lib=jaxfog/ffi/libjaxfog_ffi.so
std=$(nm -D --defined-only -C "$lib" | grep -cE " (std::|__gnu_cxx::|operator new|operator delete)")
unique=$(readelf --dyn-syms -W "$lib" | grep -c UNIQUE)
cuda=$(nm -D --defined-only "$lib" | grep -ciE " (cuda|nccl)")
echo "exported: std:: $std, GNU_UNIQUE $unique, cuda*/nccl* $cuda (expect 0 each)"
[ "$std$unique$cuda" = 000 ]'
  return 0  # counted as a failure above; the tests after it still tell what runs
}

stage_units() {
  build || return
  pytest_ units 300 tests/ops/test_jax_compat.py tests/ffi/test_gpu_build.py tests/ffi/test_ffi_units.py
}

stage_gpu_tests() { pytest_ gpu-tests 240 tests/gpu/test_gpu.py; }
stage_staged() { pytest_ staged 180 tests/gpu/test_gpu.py -k "simulated or one_process_staged"; }
stage_nccl() { pytest_ nccl 180 tests/gpu/test_gpu.py -k nccl; }

stage_exit() {
  step exit-nccl 60 "$PY" scripts/exit_probe.py --platform cuda --timeout 50
  JAXFOG_BACKEND=mpi step exit-staged 60 "$PY" scripts/exit_probe.py --platform cuda \
    --timeout 50
  JAXFOG_BACKEND=mpi step exit-2ranks 90 "$PY" scripts/exit_probe.py --platform cuda \
    --ranks 2 --timeout 80
}

# Each test at its smallest rank count (--first-param-only, scripts/pytest_progress.py):
# every rank count took 184 s on the H200.
stage_mpi_suite() {
  JAXFOG_TEST_PLATFORMS=cuda JAXFOG_BACKEND=mpi pytest_ mpi-suite 240 --first-param-only \
    tests/ops/test_ops_mpi.py tests/ops/test_nonblocking_mpi.py
}

# Windows first (about 4 s a test), optax last (93 s for one test on the H200).
stage_training() {
  JAXFOG_TEST_PLATFORMS=cuda JAXFOG_BACKEND=mpi pytest_ training 300 --first-param-only \
    tests/ops/test_window_mpi.py tests/examples/test_train_digits.py tests/optax/test_optax_mpi.py
}

# The language model at its GPU size, shortened to fit (100 steps of allreduce,
# in float32, then computed in bfloat16): tokens/s, MFU and bits per byte; the
# tables go into bench.log (the 8 files under $OUT are taken), the full run is
# `train_lm.py --size gpu`.
stage_lm() {
  local dtype tmp
  for dtype in float32 bfloat16; do
    tmp=$(mktemp -d)
    step "lm-$dtype" 40 "$PY" examples/train_lm.py --size gpu --steps 100 --eval-every 50 \
      --methods allreduce --dtype "$dtype" --out "$tmp" --no-progress --quiet || return
    [ "$PLAN" = 1 ] || cat "$tmp"/lm_*.md >>"$LOG"
  done
}

# Start/wait against the backward pass on the CPU, with a core per thread
# (these 16 cores; the 2-core CI machines share theirs): 2 ranks, both
# computing, then rank 1 only communicating. The tables go into bench.log.
stage_throughput() {
  local n
  for n in 4 8; do
    step "throughput-digits-$n" 150 env JAX_PLATFORMS=cpu "$PY" -m jaxfog.cli run -np "$n" \
      "$PY" benchmarks/bench_throughput.py --label "digits_${n}ranks_$(device_tag)" || return
  done
  step throughput-lm-4 150 env JAX_PLATFORMS=cpu "$PY" -m jaxfog.cli run -np 4 "$PY" \
    benchmarks/bench_throughput.py --model lm --label "lm_4ranks_$(device_tag)" || return
  [ "$PLAN" = 1 ] || cat benchmarks/results/throughput_*_"$(device_tag)".md >>"$LOG"
}

stage_overlap() {
  local tmp
  tmp=$(mktemp -d)
  step overlap 120 env JAX_PLATFORMS=cpu "$PY" -m jaxfog.cli run -np 2 "$PY" \
    benchmarks/bench_overlap.py --both --label "cpu_both_$(device_tag)" &&
    step overlap-peer 90 env JAX_PLATFORMS=cpu "$PY" -m jaxfog.cli run -np 2 "$PY" \
      benchmarks/bench_overlap.py --label "cpu_peer_$(device_tag)" &&
    step overlap-late 60 env JAX_PLATFORMS=cpu "$PY" -m jaxfog.cli run -np 2 "$PY" \
      benchmarks/bench_overlap.py --late 0.03 --repeats 7 --label "cpu_late_$(device_tag)" ||
    return
  [ "$PLAN" = 1 ] || cat benchmarks/results/overlap_cpu_*_"$(device_tag)".md >>"$LOG"
}

stage_bench_sim() {
  step bench-sim 240 "$PY" benchmarks/bench_gpu.py --part simulate --short || return
  keep benchmarks/results/simulate_gpu.md "simulate_$(device_tag).md"
}

stage_bench_exchange() {
  local tmp
  tmp=$(mktemp -d)
  step bench-exchange 200 "$PY" benchmarks/bench_gpu.py --part exchange --short --out "$tmp" &&
    keep "$tmp/exchange_gpu.md" "exchange_$(device_tag).md"
  step bench-dispatch 90 "$PY" benchmarks/bench_gpu.py --part dispatch --short &&
    keep benchmarks/results/dispatch_2ranks.md "dispatch_2ranks_$(device_tag).md"
}

log_of() {
  case $1 in
    probe | mpi | build | units) echo build.log ;;
    gpu-tests | staged | nccl | exit) echo gpu.log ;;
    mpi-suite | training) echo suites.log ;;
    bench-sim | bench-exchange | lm | overlap | throughput) echo bench.log ;;
  esac
}

DEFAULT="build gpu-tests exit mpi-suite bench-exchange bench-sim lm overlap training"
STAGES="probe mpi build units gpu-tests staged nccl exit mpi-suite training bench-sim bench-exchange lm overlap throughput"
[ $# -gt 0 ] || set -- $DEFAULT
for stage in "$@"; do
  case " $STAGES " in
    *" $stage "*) ;;
    *) echo "unknown stage $stage (stages: $STAGES)"; exit 2 ;;
  esac
done
: >"$SUMMARY"
say "gpu_check $* (deadline ${DEADLINE} s; device $(device_tag); OUT=$OUT)"
for stage in "$@"; do
  LOG="$OUT/$(log_of "$stage")"
  budget=$(budget_of "$stage")
  STAGE_END=$((SECONDS + budget))
  if [ "$BUDGETS" = 0 ]; then
    say "stage $stage"
  else
    say "stage $stage (budget ${budget} s)"
  fi
  "stage_${stage//-/_}"
  rc=$?
  if [ "$stage" = build ] && [ "$rc" != 0 ] && [ "$rc" != 125 ]; then
    LOG="$SUMMARY"
    say "the build failed: nothing after it can load the library; stopping"
    status=1
    break
  fi
done
LOG="$SUMMARY"
[ ${#skipped[@]} = 0 ] || say "skipped (deadline): ${skipped[*]}"
[ ${#failed[@]} = 0 ] || say "failed: ${failed[*]}"
say "gpu_check done: exit $status; $(find "$OUT" -type f | wc -l) files under $OUT"
exit "$status"
