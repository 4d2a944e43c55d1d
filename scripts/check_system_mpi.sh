#!/usr/bin/env bash
# Builds jaxfog against a system MPI instead of the mpich wheel and runs it on
# 2 ranks: the check for the JAXFOG_MPICXX switch (README, "Using a system MPI").
#
#   apt-get install -y libopenmpi-dev openmpi-bin     # Debian's Open MPI
#   scripts/check_system_mpi.sh [MPICXX] [MPIEXEC]
#
# Defaults: Debian's Open MPI wrappers. Works in a throw-away virtualenv.
set -euo pipefail
MPICXX=${1:-/usr/bin/mpicxx.openmpi}
MPIEXEC=${2:-/usr/bin/mpiexec.openmpi}
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q --upgrade pip
# mpi4py finds the system libmpi by itself when no mpich wheel is installed.
JAXFOG_MPICXX="$MPICXX" "$py" -m pip install -q "$repo"
"$py" -m pip list 2>/dev/null | grep -qi '^mpich ' && { echo "FAIL: mpich wheel installed"; exit 1; }

cd "$work"
"$work/venv/bin/jaxfog" info | tee info.txt
grep -q "(system MPI)" info.txt
JAXFOG_MPIEXEC="$MPIEXEC" "$work/venv/bin/jaxfog" run -np 2 "$py" -c '
import jax, jax.numpy as jnp, jaxfog as jf
jf.init()  # first: it makes mpi4py adopt the MPI jaxfog was built against
from mpi4py import MPI
out = jax.jit(lambda x: x * jf.ops.comm_size() + jf.ops.comm_rank())(jnp.int32(10))
jf.barrier()
assert int(out) == 10 * jf.size() + jf.rank(), out
print(f"rank {jf.rank()}/{jf.size()} ok on {MPI.Get_library_version().splitlines()[0]}")
' | sort | tee run.txt
test "$(grep -c ' ok on ' run.txt)" = 2
echo "system MPI check passed: $MPICXX"
