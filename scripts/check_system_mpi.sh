#!/usr/bin/env bash
# Builds jaxfog against a system MPI instead of the mpich wheel and runs it on
# 2 ranks: the check for the JAXFOG_MPICXX switch (docs/building.rst, "A system MPI").
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
# A window under its mutex (a 64-bit compare-and-swap there crashed Open MPI <= 4.1.4).
from jaxfog.ops import window as W
peer, left = (jf.rank() + 1) % jf.size(), (jf.rank() - 1) % jf.size()
W.win_create(jnp.zeros(2), "w", src_ranks=[left])
jf.barrier()
with W.win_mutex("w", ranks=[peer]):
    W.win_put(jnp.full(2, jf.rank() + 1.0), "w", dst_weights={peer: 1.0})
jf.barrier()
y = W.win_update(jnp.zeros(2), "w", self_weight=0.0, src_weights={left: 1.0})
assert float(y[0]) == left + 1.0, y
jf.barrier()
W.win_free("w")
print(f"rank {jf.rank()}/{jf.size()} ok on {MPI.Get_library_version().splitlines()[0]}")
' | sort | tee run.txt
test "$(grep -c ' ok on ' run.txt)" = 2
echo "system MPI check passed: $MPICXX"
