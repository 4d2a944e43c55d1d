"""One-sided windows under MPI: values against numpy models of the windows."""

from __future__ import annotations

import pytest

from mpi_harness import mpi_test


def _graphs(n):
    import numpy as np

    import jaxfog.topology as T

    rng = np.random.default_rng(n)
    directed = (rng.random((n, n)) < 0.5).astype(float)
    np.fill_diagonal(directed, 0)
    for i in range(n):  # keep it connected: a ring underneath
        directed[i, (i - 1) % n] = 1.0
    directed += np.eye(n)
    directed /= directed.sum(axis=1, keepdims=True)
    return [T.exponential(n), T.ring(n), T.star(n), T.from_weights(directed)]


@mpi_test(nprocs=(2, 4, 5))
def test_put_accumulate_update_against_numpy():
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxfog as jf
    from jaxfog.ops import window as W

    jax.config.update("jax_enable_x64", True)
    jf.init()
    r, n = jf.rank(), jf.size()
    X = np.random.default_rng(0).standard_normal((n, 2, 3))
    for k, topo in enumerate(_graphs(n)):
        jf.set_topology(topo)
        ins, outs = topo.in_neighbors(r), topo.out_neighbors(r)
        name = f"w{k}"
        W.win_create({"a": jnp.asarray(X[r]), "b": jnp.asarray(X[r, 0])}, name)
        # Slots hold copies of the rank's own value: update returns x.
        y = W.win_update({"a": jnp.asarray(X[r]), "b": jnp.asarray(X[r, 0])}, name)
        np.testing.assert_allclose(y["a"], X[r], rtol=1e-12)
        jf.barrier()
        W.win_put({"a": jnp.asarray(2 * X[r]), "b": jnp.asarray(X[r, 0])}, name)
        jf.barrier()
        y = W.win_update({"a": jnp.asarray(X[r]), "b": jnp.asarray(X[r, 0])}, name)
        expected = topo.weights[r, r] * X[r] + sum(topo.weights[r, j] * 2 * X[j] for j in ins)
        np.testing.assert_allclose(y["a"], expected, rtol=1e-12, err_msg=topo.name)
        jf.barrier()
        # Accumulate with weights, jitted, then a reset update drains the slots.
        weights = {d: 0.5 + d for d in outs}
        put = jf.jit(lambda x: W.win_accumulate(x, name, self_weight=0.25,
                                                dst_weights=weights))
        out = put({"a": jnp.asarray(X[r]), "b": jnp.asarray(X[r, 0])})
        np.testing.assert_allclose(out["a"], 0.25 * X[r], rtol=1e-12)
        jf.barrier()
        ones = {j: 1.0 for j in ins}
        zero = {"a": jnp.zeros((2, 3)), "b": jnp.zeros(3)}
        y = jax.jit(lambda x: W.win_update(x, name, self_weight=0.0, src_weights=ones,
                                           reset=True))(zero)
        np.testing.assert_allclose(y["a"], sum((2 + 0.5 + r) * X[j] for j in ins),
                                   rtol=1e-12, err_msg=topo.name)
        y = W.win_update(zero, name, self_weight=0.0, src_weights=ones)
        np.testing.assert_allclose(y["a"], 0.0)
        jf.barrier()
        W.win_free(name)


@mpi_test(nprocs=(3,))
def test_window_errors():
    import jax.numpy as jnp
    import numpy as np

    import jaxfog as jf
    import jaxfog.topology as T
    from jaxfog.ops import window as W

    jf.init(topology=T.ring(3))
    r = jf.rank()
    x = jnp.ones(4)
    W.win_create(x, "w")
    W.win_create(x, "u", src_ranks=[(r - 1) % 3])  # only the left neighbour writes here
    cases = [
        (ValueError, "no window named 'nope'", lambda: W.win_put(x, "nope")),
        (ValueError, "does not match window 'w'", lambda: W.win_put(jnp.ones(5), "w")),
        (ValueError, "does not match window 'w'", lambda: W.win_update(x.astype(int), "w")),
        (ValueError, "out of range", lambda: W.win_put(x, "w", dst_weights=[7])),
        (ValueError, "holds no slot for ranks", lambda: W.win_update(
            x, "u", src_weights={(r + 1) % 3: 1.0})),
        (ValueError, "hold no slot for rank", lambda: W.win_put(
            x, "u", dst_weights=[(r - 1) % 3])),
        (ValueError, "exists already", lambda: W.win_create(x, "w")),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
    with pytest.raises(TypeError, match="not differentiable"):
        import jax

        jax.grad(lambda v: W.win_put(v, "w").sum())(x)
    # Differing shapes at creation: a clear error on every rank.
    with pytest.raises(ValueError, match="every rank must create the same window"):
        W.win_create(jnp.ones(3 + (r == 1)), "v")
    W.win_free()
    with pytest.raises(ValueError, match="no window named 'w'"):
        W.win_update(x, "w")
    np.testing.assert_allclose(jf.allreduce(jnp.ones(1)), 1.0)  # still in step
