#!/usr/bin/env bash
# Points Bazel's external repositories (WORKSPACE) at jaxlib's FFI headers and
# at an MPI: the mpich wheel beside this Python, or the prefix of JAXFOG_MPICXX.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
include=$("$python" -c "import jax; print(jax.ffi.include_dir())")
mpicxx=${JAXFOG_MPICXX:-$(dirname "$("$python" -c 'import sys; print(sys.executable)')")/mpicxx}
mpi_prefix=$(cd "$(dirname "$(readlink -f "$mpicxx")")/.." && pwd)
mkdir -p "$repo/third_party/local"
ln -sfn "$include" "$repo/third_party/local/xla_ffi"
ln -sfn "$mpi_prefix" "$repo/third_party/local/mpi"
echo "xla_ffi -> $include"
echo "mpi     -> $mpi_prefix"
cat > "$repo/.bazelrc.local" <<RC
build --override_repository=rules_cc=$repo/third_party/bazel_rules_cc
build --override_repository=rules_java=$repo/third_party/bazel_rules_java
RC
echo "wrote .bazelrc.local"
