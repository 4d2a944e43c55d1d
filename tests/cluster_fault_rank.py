"""One rank of a fault test (tests/runtime/test_cluster_netns.py): ring averaging until
something fails, a checkpoint before the fault; prints how it ended.

Usage: python cluster_fault_rank.py DIRECTORY ELEMENTS. Each rank saves its state at
step 2 under DIRECTORY/ckpt, then creates DIRECTORY/ready.<rank> and goes on
exchanging until an op fails, which it reports in one line, printed and
written to DIRECTORY/report.<rank> (a launcher that ends the job may drop
what the survivors print).
"""

import os
import sys
import time

import jax.numpy as jnp

import jaxfog as jf
import jaxfog.topology as T
from jaxfog.checkpoint import CheckpointManager

directory, elements = sys.argv[1], int(sys.argv[2])
jf.init()
jf.set_topology(T.ring(jf.size()))
rank = jf.rank()
x = jnp.full(elements, float(rank))
step = 0
with CheckpointManager(os.path.join(directory, "ckpt"), async_save=False) as manager:
    while step < 2:
        x = jf.neighbor_allreduce(x)
        step += 1
    manager.save(step, {"x": x})
open(os.path.join(directory, f"ready.{rank}"), "w").close()
start = time.monotonic()
try:
    while time.monotonic() - start < 120:
        began = time.monotonic()
        x = jf.neighbor_allreduce(x)
        x.block_until_ready()
        step += 1
except Exception as error:  # noqa: BLE001 (the report is the point)
    report = (f"RANK {rank} FAILED after {time.monotonic() - began:.1f} s in step {step}: "
              f"{type(error).__name__}: {error}".replace("\n", " | "))
else:
    report = f"RANK {rank} NO ERROR after {step} steps"
with open(os.path.join(directory, f"report.{rank}"), "w") as f:
    f.write(report + "\n")
print(report, flush=True)
