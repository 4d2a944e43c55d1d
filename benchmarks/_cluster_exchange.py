"""One rank of the cluster bandwidth measurement (bench_cluster.py, and
tests/runtime/test_cluster_netns.py's bandwidth case): times each exchange of an
``elements``-float32 model; rank 0 prints one JSON line of seconds per step.

Usage: python _cluster_exchange.py ELEMENTS STEPS METHOD[,METHOD...]
Methods: allreduce (gradient allreduce's exchange), exponential (atc/awc's on
the exponential graph), one-peer (the one-peer exponential schedule),
one-peer-nonblocking (started, then waited for: what overlaps compute).
"""

import json
import sys
import time

import jax.numpy as jnp
import numpy as np

import jaxfog as jf
import jaxfog.topology as T

elements, steps, methods = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
jf.init()
n = jf.size()
schedule, exponential = T.one_peer_exponential(n), T.exponential(n)
exchanges = {
    "allreduce": lambda x, t: jf.allreduce(x),
    "exponential": lambda x, t: jf.neighbor_allreduce(x, topology=exponential),
    "one-peer": lambda x, t: jf.neighbor_allreduce(x, topology=schedule, step=t),
    "one-peer-nonblocking": lambda x, t: jf.wait(
        jf.neighbor_allreduce_nonblocking(x, topology=schedule, step=t)),
}
x = jnp.full(elements, float(jf.rank()), jnp.float32)
seconds = {}
for method in methods:
    exchange = exchanges[method]
    exchange(x, 0).block_until_ready()  # compiled, connections made
    times = []
    for t in range(steps):
        jf.barrier()
        start = time.perf_counter()
        exchange(x, t + 1).block_until_ready()
        times.append(time.perf_counter() - start)
    # The slowest rank's time is the step's time.
    every = np.asarray(jf.allgather(jnp.asarray(times)[None])).max(axis=0)
    seconds[method] = float(np.median(every))
if jf.rank() == 0:
    print("EXCHANGE " + json.dumps({"elements": elements, "ranks": n, "seconds": seconds}),
          flush=True)
