"""Communication runs off XLA's executor thread, so a train step overlaps it.

In ``awc`` the exchange of x does not need the gradient. Rank 1 comes late to
the exchange by as long as rank 0's backward pass takes: if the exchange holds
rank 0's executor thread, the step takes wait + compute; if it runs on the
communication thread, the backward pass fills the wait.
"""

from __future__ import annotations

import json

import pytest

from jaxfog.testing import run_mpi


def late_peer_body():
    import os
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from mpi4py import MPI

    import jaxfog as jf
    import jaxfog.optax as jfo

    jf.init()
    r = jf.rank()
    width, depth, batch = 512, 4, 2048  # 4 MiB of parameters: above the threshold
    keys = jax.random.split(jax.random.key(0), depth)
    params = [jax.random.normal(k, (width, width), jnp.float32) / np.sqrt(width)
              for k in keys]
    x = jax.random.normal(jax.random.key(r + 1), (batch, width), jnp.float32)

    def loss(params):
        h = x
        for w in params:
            h = jnp.tanh(h @ w)
        return jnp.mean(h ** 2)

    def compiled_step(optimizer):
        state = optimizer.init(params)

        def step(params, state):
            updates, state = optimizer.update(jax.grad(loss)(params), state, params)
            return optax.apply_updates(params, updates), state

        return jax.jit(step).lower(params, state).compile(), state

    def seconds(fn):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        return time.perf_counter() - start

    compute, compute_state = compiled_step(jfo.awc(optax.sgd(1e-3), communication="none"))
    awc, awc_state = compiled_step(jfo.awc(optax.sgd(1e-3)))
    jax.block_until_ready(awc(params, awc_state))
    work = MPI.COMM_WORLD.bcast(
        float(np.median([seconds(lambda: compute(params, compute_state)) for _ in range(5)])))
    elapsed = []
    for _ in range(5):
        jf.barrier()
        if r == 1:
            time.sleep(work)
        elapsed.append(seconds(lambda: awc(params, awc_state)))
    # The result is the same either way: W x - lr * g, with W the exponential graph.
    new_params, _ = awc(params, awc_state)
    grads = jax.grad(loss)(params)
    mixed = jax.jit(jf.neighbor_allreduce)(params)
    for p, m, g in zip(new_params, mixed, grads):
        np.testing.assert_allclose(np.asarray(p), np.asarray(m - 1e-3 * g), atol=1e-6)
    if r == 0:
        with open(os.environ["RESULT_FILE"], "w") as f:
            json.dump({"work": work, "elapsed": float(np.median(elapsed))}, f)


@pytest.mark.parametrize("mode", ["async", "inline"])
def test_backward_pass_fills_the_wait_for_a_late_peer(tmp_path, mode):
    result_file = tmp_path / "result.json"
    env = {"RESULT_FILE": str(result_file),
           "JAXFOG_COMM_THREAD_MIN_BYTES": "0" if mode == "async" else "off"}
    result = run_mpi(2, __file__, "late_peer_body", timeout=180, env=env)
    assert result.ok, result.report()
    timing = json.loads(result_file.read_text())
    ratio = timing["elapsed"] / timing["work"]
    # Measured: async 1.11-1.18, inline 1.64-2.11 (2 cores, shared with the suite).
    if mode == "async":  # about max(wait, compute) = compute
        assert ratio < 1.45, timing
    else:  # the exchange holds the executor thread: wait + compute
        assert ratio > 1.5, timing
