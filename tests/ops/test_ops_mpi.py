"""The communication ops on real MPI processes, against numpy on the global X.

Every body runs on 2, 4 and 5 ranks (unless it says otherwise); X[r] is rank
r's value and the reference is plain numpy (``W @ X``, sums, slices).
"""

from __future__ import annotations

import pytest
from mpi_harness import mpi_test
from reference import rank_setup

pytestmark = pytest.mark.jax_internals


@mpi_test(x64=True)
def test_static_topologies_match_w_at_x():
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxfog.topology as T

    jf, r, n, X = rank_setup()
    graphs = [T.exponential(n), T.ring(n), T.ring(n, style=1), T.star(n, center=n - 1),
              T.mesh_grid_2d(n), T.fully_connected(n), T.symmetric_exponential(n),
              T.from_weights(np.random.default_rng(5).uniform(0, 1, (n, n)))]
    avg = jax.jit(jf.neighbor_allreduce, static_argnames="topology")
    for topo in graphs:
        expected = topo.weights @ X
        np.testing.assert_allclose(jf.neighbor_allreduce(X[r], topology=topo), expected[r],
                                   rtol=1e-13, err_msg=topo.name)
        np.testing.assert_allclose(avg(jnp.asarray(X[r]), topology=topo), expected[r],
                                   rtol=1e-13, err_msg=topo.name)
    # The default is the runtime's topology.
    jf.set_topology(T.ring(n))
    np.testing.assert_allclose(jf.neighbor_allreduce(X[r]), (T.ring(n).weights @ X)[r],
                               rtol=1e-13)


@mpi_test(x64=True)
def test_local_view_forms():
    import jax
    import numpy as np

    import jaxfog.topology as T
    from reference import local_view_matrix, random_push_pull

    jf, r, n, X = rank_setup()
    topo = T.exponential(n)
    jf.set_topology(topo)
    ins, outs = topo.in_neighbors(r), topo.out_neighbors(r)
    rng = np.random.default_rng(1)
    self_w = rng.uniform(0.1, 1, n)
    src_w = [{j: float(rng.uniform(0.1, 1)) for j in topo.in_neighbors(i)} for i in range(n)]
    dst_w = [{i: float(rng.uniform(0.5, 2)) for i in topo.out_neighbors(j)} for j in range(n)]
    none = [{} for _ in range(n)]
    # pull: self + src; senders are the static out-neighbours (weight 1).
    pull = local_view_matrix(n, self_w, src_w, none)
    y = jf.neighbor_allreduce(X[r], self_weight=self_w[r], src_weights=src_w[r])
    np.testing.assert_allclose(y, (pull @ X)[r], rtol=1e-13)
    # push: self + dst; receive from the static in-neighbours with weight 1.
    push = local_view_matrix(n, self_w, [{j: 1.0 for j in topo.in_neighbors(i)}
                                         for i in range(n)], dst_w)
    y = jax.jit(lambda x: jf.neighbor_allreduce(x, self_weight=self_w[r],
                                                dst_weights=dst_w[r]))(X[r])
    np.testing.assert_allclose(y, (push @ X)[r], rtol=1e-13)
    # push with a list of ranks: weight 1 each.
    y = jf.neighbor_allreduce(X[r], self_weight=0.5, dst_weights=outs)
    expected = 0.5 * X[r] + sum(X[j] for j in ins)
    np.testing.assert_allclose(y, expected, rtol=1e-13)
    # push-pull: any graph, edges outside the static one, empty lists.
    for seed in range(4):
        sw, src, dst = random_push_pull(n, seed)
        w = local_view_matrix(n, sw, src, dst)
        y = jf.neighbor_allreduce(X[r], self_weight=sw[r], src_weights=src[r],
                                  dst_weights=dst[r])
        np.testing.assert_allclose(y, (w @ X)[r], rtol=1e-13, err_msg=f"seed {seed}")
    # Nobody sends or receives.
    y = jf.neighbor_allreduce(X[r], self_weight=2.0, src_weights={}, dst_weights=[])
    np.testing.assert_allclose(y, 2 * X[r])


@mpi_test(x64=True)
def test_scheduled_under_control_flow_compiles_once():
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxfog.topology as T

    jf, r, n, X = rank_setup()
    for schedule in (T.one_peer_exponential(n), T.one_peer(T.ring(n)),
                     T.inner_outer_ring(n, 1 if n % 2 else 2)):
        def product(steps, start=0):
            out = X.copy()
            for t in range(start, start + steps):
                out = schedule.at(t).weights @ out
            return out

        @jax.jit
        def scan(x, steps):
            return jax.lax.scan(lambda c, t: (jf.neighbor_allreduce(
                c, topology=schedule, step=t), None), x, steps)[0]

        np.testing.assert_allclose(scan(X[r], jnp.arange(7)), product(7)[r], rtol=1e-12)
        np.testing.assert_allclose(scan(X[r], jnp.arange(3, 8)), product(5, 3)[r],
                                   rtol=1e-12)

        fori = jax.jit(lambda x, k: jax.lax.fori_loop(
            0, k, lambda t, c: jf.neighbor_allreduce(c, topology=schedule, step=t), x))
        np.testing.assert_allclose(fori(X[r], 6), product(6)[r], rtol=1e-12)

        def cond(state):
            return state[0] < 4

        def body(state):
            t, x = state
            return t + 1, jf.neighbor_allreduce(x, topology=schedule, step=t)

        whiled = jax.jit(lambda x: jax.lax.while_loop(cond, body, (0, x))[1])
        np.testing.assert_allclose(whiled(X[r]), product(4)[r], rtol=1e-12)

        one = jax.jit(lambda x, t: jf.neighbor_allreduce(x, topology=schedule, step=t))
        for t in range(2 * schedule.period):
            np.testing.assert_allclose(one(X[r], t), (schedule.at(t).weights @ X)[r],
                                       rtol=1e-13)
        assert one._cache_size() == 1  # a time-varying graph never retraces

    # cond: both branches communicate, or neither does.
    picked = jax.jit(lambda x, p: jax.lax.cond(
        p, lambda v: jf.neighbor_allreduce(v), lambda v: jf.allreduce(v), x))
    np.testing.assert_allclose(picked(X[r], True),
                               (jf.load_topology().weights @ X)[r], rtol=1e-13)
    np.testing.assert_allclose(picked(X[r], False), X.mean(0), rtol=1e-13)
    # The product of log2(n) one-peer steps is the exact average for n = 2^k.
    if n & (n - 1) == 0:
        S = T.one_peer_exponential(n)
        z = jax.jit(lambda x: jax.lax.fori_loop(
            0, S.period, lambda t, c: jf.neighbor_allreduce(c, topology=S, step=t), x))(X[r])
        np.testing.assert_allclose(z, X.mean(0), rtol=1e-14)


@mpi_test(x64=True)
def test_pytrees_dtypes_scalars_and_empty():
    import jax
    import jax.numpy as jnp
    import numpy as np

    jf, r, n, X = rank_setup(shape=(5,))
    W = jf.load_topology().weights
    Y = W @ X
    tree = {
        "f16": jnp.asarray(X[r], jnp.float16), "bf16": jnp.asarray(X[r], jnp.bfloat16),
        "f32": jnp.asarray(X[r], jnp.float32), "f64": jnp.asarray(X[r]),
        "c64": jnp.asarray(X[r] + 1j * X[r][::-1], jnp.complex64),
        "scalar": jnp.asarray(X[r][0]), "empty": jnp.zeros((0, 3), jnp.float32),
        "nested": [jnp.asarray(X[r].reshape(5, 1))],
    }
    for fn in (jf.neighbor_allreduce, jax.jit(jf.neighbor_allreduce)):
        out = fn(tree)
        assert jax.tree.structure(out) == jax.tree.structure(tree)
        for key in ("f16", "bf16", "f32", "f64", "c64", "empty"):
            assert out[key].dtype == tree[key].dtype and out[key].shape == tree[key].shape
        np.testing.assert_allclose(out["f16"].astype(np.float64), Y[r], rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(out["bf16"].astype(np.float64), Y[r], rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(out["f32"], Y[r], rtol=1e-6)
        np.testing.assert_allclose(out["f64"], Y[r], rtol=1e-13)
        np.testing.assert_allclose(out["c64"], (W @ (X + 1j * X[:, ::-1]))[r], rtol=1e-5)
        np.testing.assert_allclose(out["scalar"], Y[r][0], rtol=1e-13)
        np.testing.assert_allclose(out["nested"][0][:, 0], Y[r], rtol=1e-13)
    # Integers: averaged in float64, rounded to nearest (ties to even).
    ints = (X * 1000).astype(np.int64)
    for dtype in (np.int32, np.int64):
        out = jf.neighbor_allreduce(jnp.asarray(ints[r], dtype))
        assert out.dtype == dtype
        np.testing.assert_array_equal(out, np.rint(W @ ints.astype(np.float64))[r])
    big = (np.arange(n) + 2**40).astype(np.int64)  # beyond int32, within float64
    out = jf.allreduce(jnp.asarray(big[r]), op="sum")
    assert int(out) == int(big.sum())


@mpi_test(nprocs=(2, 3), x64=True)
def test_large_messages_are_summed_piece_by_piece():
    """Messages of 4 MB and more are summed as their pieces arrive; piece
    boundaries fall inside elements of every width, and senders scale."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxfog.topology as T
    from reference import global_values

    jf, r, n, _ = rank_setup()
    X = global_values(n, (300_007,), seed=11)
    W = np.random.default_rng(3).uniform(0.1, 1.0, (n, n))
    ints = (X * 1000).astype(np.int64)
    tree = {"a_i32": jnp.asarray(ints[r][:3], jnp.int32),  # offsets every later leaf by 12
            "b_f64": jnp.asarray(X[r]), "c_f16": jnp.asarray(X[r][:-2], jnp.float16),
            "d_c64": jnp.asarray(X[r] + 1j, jnp.complex64),
            "e_i64": jnp.asarray(ints[r]), "f_bf16": jnp.asarray(X[r][:77_777], jnp.bfloat16)}
    assert sum(v.nbytes for v in jax.tree.leaves(tree)) > 4 << 20
    # Pull with a scaled send: rank j sends 2 * x_j to every out-neighbour.
    topo = T.from_weights(W)
    src = {j: float(W[r, j]) / 2 for j in topo.in_neighbors(r)}
    dst = {i: 2.0 for i in topo.out_neighbors(r)}
    def mix(tree):
        return jf.neighbor_allreduce(tree, self_weight=float(W[r, r]), src_weights=src,
                                     dst_weights=dst)

    for fn in (mix, jf.jit(mix)):
        out = fn(tree)
        np.testing.assert_array_equal(out["a_i32"], np.rint(W @ ints[:, :3])[r])
        np.testing.assert_allclose(out["b_f64"], (W @ X)[r], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(out["c_f16"].astype(np.float64), (W @ X[:, :-2])[r],
                                   rtol=5e-3, atol=5e-3)
        np.testing.assert_allclose(out["d_c64"], (W @ (X + 1j))[r], rtol=1e-5)
        np.testing.assert_array_equal(out["e_i64"], np.rint(W @ ints.astype(np.float64))[r])
        np.testing.assert_allclose(out["f_bf16"].astype(np.float64), (W @ X[:, :77_777])[r],
                                   rtol=3e-2, atol=3e-2)
    # Rank 0 only sends, the others only receive (a sender that receives
    # nothing cuts its message into the same pieces as its receivers).
    star = jf.jit(lambda x: jf.neighbor_allreduce(
        x, self_weight=1.0 if r == 0 else 0.5, src_weights={} if r == 0 else {0: 0.5},
        dst_weights=list(range(1, n)) if r == 0 else []))
    Z = np.concatenate([X, X], axis=1)  # 4.8 MB
    want = Z[0] if r == 0 else (Z[r] + Z[0]) / 2
    np.testing.assert_allclose(star(jnp.asarray(Z[r])), want, rtol=1e-12, atol=1e-14)


@mpi_test(x64=True)
def test_collectives():
    import jax
    import jax.numpy as jnp
    import numpy as np

    jf, r, n, X = rank_setup(shape=(3, 4))
    x = jnp.asarray(X[r])
    for fn in (lambda f: f, jax.jit):
        np.testing.assert_allclose(fn(jf.allreduce)(x), X.mean(0), rtol=1e-13)
        np.testing.assert_allclose(fn(lambda v: jf.allreduce(v, op="sum"))(x), X.sum(0),
                                   rtol=1e-13)
        for root in range(n):
            np.testing.assert_array_equal(fn(lambda v: jf.broadcast(v, root=root))(x),
                                          X[root])
        np.testing.assert_array_equal(fn(jf.allgather)(x), X.reshape(n * 3, 4))
        np.testing.assert_array_equal(fn(jf.neighbor_allgather)(x),
                                      np.concatenate([X[j] for j in jf.in_neighbor_ranks()]))
    # Pytrees of mixed dtypes: one call.
    tree = (x, jnp.asarray(X[r][0], jnp.float32), jnp.asarray(r, jnp.int32))
    mean = jf.allreduce(tree)
    np.testing.assert_allclose(mean[0], X.mean(0), rtol=1e-13)
    np.testing.assert_allclose(mean[1], X[:, 0].mean(0), rtol=1e-6, atol=1e-6)
    assert int(mean[2]) == int(np.rint(np.mean(np.arange(n))))
    gathered = jf.allgather(tree)
    np.testing.assert_array_equal(gathered[2], np.arange(n))
    np.testing.assert_array_equal(jf.broadcast(tree, root=1)[1], X[1][0].astype(np.float32))
    # neighbor_allgather with explicit ranks, in the order given.
    src = [(r - 1) % n, (r + 1) % n] if n > 2 else [(r + 1) % n]
    dst = sorted({(r + 1) % n, (r - 1) % n})
    got = jf.neighbor_allgather(tree, src_ranks=src, dst_ranks=dst)
    np.testing.assert_array_equal(got[0], np.concatenate([X[j] for j in src]))
    np.testing.assert_array_equal(got[2], np.array(src, np.int32))
    # Half precision sums.
    h = jf.allreduce(jnp.asarray(X[r], jnp.bfloat16), op="sum")
    np.testing.assert_allclose(h.astype(np.float64), X.sum(0), rtol=3e-2, atol=3e-2)


@mpi_test(x64=True)
def test_differentiation_matches_w_transpose():
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxfog.topology as T
    from reference import local_view_matrix, random_push_pull

    jf, r, n, X = rank_setup()
    C = np.cos(np.arange(n * 7).reshape(n, 7))  # rank r's loss: sum(c_r * y_r**2)

    def check(avg, W, what):
        """grad of sum_r f_r(y_r), y = W X, is W^T f'(Y); jvp/linearize give W T."""
        Y = W @ X
        g = jax.grad(lambda x: jnp.sum(C[r] * avg(x) ** 2))(X[r])
        np.testing.assert_allclose(g, (W.T @ (2 * C * Y))[r], rtol=1e-12, err_msg=what)
        T_ = np.sin(np.arange(n * 7).reshape(n, 7))
        y, t = jax.jvp(avg, (X[r],), (T_[r],))
        np.testing.assert_allclose(y, Y[r], rtol=1e-13, err_msg=what)
        np.testing.assert_allclose(t, (W @ T_)[r], rtol=1e-13, err_msg=what)
        y, lin = jax.linearize(avg, X[r])
        np.testing.assert_allclose(lin(T_[r]), (W @ T_)[r], rtol=1e-13, err_msg=what)
        _, vjp = jax.vjp(avg, X[r])
        np.testing.assert_allclose(vjp(C[r])[0], (W.T @ C)[r], rtol=1e-13, err_msg=what)
        jitted = jax.jit(jax.grad(lambda x: jnp.sum(C[r] * avg(x) ** 2)))
        np.testing.assert_allclose(jitted(X[r]), g, rtol=1e-13, err_msg=what)

    topo = T.exponential(n)
    check(jf.neighbor_allreduce, topo.weights, "static")
    sw, src, dst = random_push_pull(n, 3)
    check(lambda x: jf.neighbor_allreduce(x, self_weight=sw[r], src_weights=src[r],
                                          dst_weights=dst[r]),
          local_view_matrix(n, sw, src, dst), "push-pull")
    S = T.one_peer_exponential(n)
    check(lambda x: jf.neighbor_allreduce(x, topology=S, step=1), S.at(1).weights,
          "scheduled")
    check(lambda x: jf.allreduce(x, op="sum"), np.ones((n, n)), "allreduce sum")
    check(jf.allreduce, np.full((n, n), 1 / n), "allreduce mean")
    root = n - 1
    check(lambda x: jf.broadcast(x, root=root), np.eye(n)[[root] * n], "broadcast")
    # Gathers: linear maps from x_r to a stacked output, checked with vjp.
    ins = jf.in_neighbor_ranks()
    ct = np.cos(np.arange(len(ins) * 7)).reshape(len(ins), 7)
    _, vjp = jax.vjp(jf.neighbor_allgather, X[r])
    cts = jf.allgather(jnp.asarray(ct))  # everybody's cotangent blocks, (sum k) x 7
    k = len(ins)
    expected = sum(np.asarray(cts[i * k:(i + 1) * k])[T.exponential(n).in_neighbors(i)
                                                        .index(r)]
                   for i in range(n) if r in T.exponential(n).in_neighbors(i))
    np.testing.assert_allclose(vjp(jnp.asarray(ct).reshape(-1))[0], expected, rtol=1e-13)
    _, vjp = jax.vjp(jf.allgather, X[r])
    full = np.cos(np.arange(n * 7)).reshape(n * 7)
    np.testing.assert_allclose(vjp(jnp.asarray(full))[0], n * full[r * 7:(r + 1) * 7],
                               rtol=1e-13)


@mpi_test(x64=True)
def test_vmap_batches_in_one_call():
    import jax
    import jax.numpy as jnp
    import numpy as np

    jf, r, n, X = rank_setup(shape=(3, 5))
    W = jf.load_topology().weights
    batch = jnp.asarray(X[r])  # batch of 3 vectors of 5
    out = jax.vmap(jf.neighbor_allreduce)(batch)
    np.testing.assert_allclose(out, np.einsum("ij,jbk->ibk", W, X)[r], rtol=1e-13)
    out = jax.vmap(jf.neighbor_allreduce, in_axes=1, out_axes=1)(batch)
    np.testing.assert_allclose(out, np.einsum("ij,jbk->ibk", W, X)[r], rtol=1e-13)
    jaxpr = jax.make_jaxpr(jax.vmap(jf.neighbor_allreduce))(batch)
    assert str(jaxpr).count("jaxfog_neighbor_allreduce") == 1
    ins = jf.in_neighbor_ranks()
    g = jax.vmap(jf.neighbor_allgather)(batch)  # (3, k*5)
    np.testing.assert_array_equal(g, np.concatenate([X[j] for j in ins], axis=1))
    s = jax.vmap(jf.neighbor_allgather)(batch[:, 0])  # scalars per example -> (3, k)
    np.testing.assert_array_equal(s, np.stack([X[j][:, 0] for j in ins], axis=1))
    a = jax.vmap(jf.allgather)(batch)
    np.testing.assert_array_equal(a, np.concatenate(list(X), axis=1))
    m = jax.vmap(jf.allreduce)(batch)
    np.testing.assert_allclose(m, X.mean(0), rtol=1e-13)
    # Gradient through vmap (per-example losses).
    grads = jax.vmap(jax.grad(lambda x: jnp.sum(jf.neighbor_allreduce(x) ** 2)))(batch)
    Y = np.einsum("ij,jbk->ibk", W, X)
    np.testing.assert_allclose(grads, np.einsum("ji,jbk->ibk", W, 2 * Y)[r], rtol=1e-12)


@mpi_test(nprocs=(4, 6), env={"JAXFOG_NODES_PER_MACHINE": "2"}, x64=True)
def test_hierarchical_with_faked_machines():
    import jax
    import numpy as np

    import jaxfog.topology as T

    jf, r, n, X = rank_setup()
    machines = n // 2
    means = X.reshape(machines, 2, -1).mean(1)
    for machine_topo in (T.exponential(machines), T.ring(machines, style=1)):
        jf.set_machine_topology(machine_topo)
        expected = (machine_topo.weights @ means)[r // 2]
        np.testing.assert_allclose(jf.hierarchical_neighbor_allreduce(X[r]), expected,
                                   rtol=1e-13)
        np.testing.assert_allclose(jax.jit(jf.hierarchical_neighbor_allreduce)(X[r]),
                                   expected, rtol=1e-13)
    m = r // 2
    y = jf.hierarchical_neighbor_allreduce(
        X[r], self_weight=0.5, src_machine_weights={(m - 1) % machines: 0.5},
        dst_machine_weights=[(m + 1) % machines])
    np.testing.assert_allclose(y, 0.5 * means[m] + 0.5 * means[(m - 1) % machines],
                               rtol=1e-13)


@mpi_test(nprocs=(3,), x64=True)
def test_jitted_functions_follow_set_topology():
    import jax
    import numpy as np

    import jaxfog.topology as T

    jf, r, n, X = rank_setup()
    avg = jax.jit(jf.neighbor_allreduce)
    for topo in (T.ring(n), T.star(n), T.ring(n)):
        jf.set_topology(topo)
        np.testing.assert_allclose(avg(X[r]), (topo.weights @ X)[r], rtol=1e-13)


@mpi_test(nprocs=(2, 3))
def test_ahead_of_time_compiled_calls_repeat():
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxfog as jf

    jf.init()
    r, n = jf.rank(), jf.size()
    x = {"a": jnp.full(3, float(r)), "b": jnp.arange(2.0) + r}

    def step(x, scale):
        return jax.tree.map(lambda v: v * scale, jf.allreduce(jf.neighbor_allreduce(x)))

    compiled = jax.jit(step).lower(x, 1.0).compile()
    mean = (n - 1) / 2
    for k in range(3):  # interleaved with a jitted op on the same token chain
        out = compiled(x, float(k))
        np.testing.assert_allclose(out["a"], np.full(3, k * mean), rtol=1e-6)
        np.testing.assert_allclose(out["b"], k * (np.arange(2.0) + mean), rtol=1e-6)
        np.testing.assert_allclose(jax.jit(jf.allreduce)(jnp.float32(r)), mean)


@mpi_test(nprocs=(2, 4), timeout=180, env={"JAXFOG_SEND_RECEIPTS": "1"})
def test_exchanges_with_send_receipts_equal_numpy():
    """JAXFOG_SEND_RECEIPTS=1: every exchange also waits for an empty receipt
    from each peer it sent to. A one-peer schedule (the peer changes every
    step), a pytree of two leaves, large enough to be streamed, its gradient
    (receipts both ways) and a neighbour allgather, jitted, against numpy; the
    op timeline shows one receipts phase per exchange."""
    import json
    import os
    import tempfile

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxfog as jf
    import jaxfog.topology as T

    folder = tempfile.mkdtemp()
    os.environ["JAXFOG_TIMELINE"] = os.path.join(folder, "trace.json")
    jf.init()
    del os.environ["JAXFOG_TIMELINE"]
    r, n = jf.rank(), jf.size()
    schedule = T.one_peer_exponential(n)
    rng = np.random.default_rng(0)
    X = rng.standard_normal((n, 1 << 20)).astype(np.float32)  # 4 MiB: streamed
    Y = rng.standard_normal((n, 3, 4)).astype(np.float32)

    @jax.jit
    def step(x, y, t):
        mixed = jf.neighbor_allreduce({"x": x, "y": y}, topology=schedule, step=t)
        grad = jax.grad(lambda x: jnp.sum(jf.neighbor_allreduce(
            x, topology=schedule, step=t) ** 2))(x)
        return mixed, grad, jf.neighbor_allgather(y[:2])

    for t in range(4):
        mixed, grad, gathered = step(X[r], Y[r], t)
        W = schedule.at(t).weights
        np.testing.assert_allclose(mixed["x"], (W @ X)[r], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(mixed["y"], np.einsum("j,jab->ab", W[r], Y), rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(grad, (W.T @ (2 * W @ X))[r], rtol=1e-4, atol=1e-5)
        senders = T.exponential(n).in_neighbors(r)
        np.testing.assert_array_equal(gathered, Y[senders, :2].reshape(-1, 4))
    jf.shutdown()  # writes the timeline
    with open(os.path.join(folder, f"trace.rank{r}.json")) as f:
        events = json.load(f)["traceEvents"]
    receipts = [e for e in events if e["ph"] == "X" and e["name"] == "receipts"]
    assert len(receipts) == 4 * 4, len(receipts)  # 4 steps: mix, grad (forward, back), gather


@mpi_test(nprocs=(2,), timeout=120)
def test_send_receipts_set_on_some_ranks_only_is_refused_at_init():
    import os

    import pytest
    from mpi4py import MPI

    import jaxfog as jf

    jf.shutdown()  # a body run before this one in the same launch initialised it
    os.environ["JAXFOG_SEND_RECEIPTS"] = "1" if MPI.COMM_WORLD.Get_rank() == 0 else "0"
    try:
        with pytest.raises(ValueError, match=r"the same on every rank: it is 1 on ranks \[0\]"):
            jf.init()
        os.environ["JAXFOG_SEND_RECEIPTS"] = "yes"
        with pytest.raises(ValueError, match="must be 1 .on. or 0 .off."):
            jf.init()
    finally:
        del os.environ["JAXFOG_SEND_RECEIPTS"]
    jf.init()
    jf.barrier()
    jf.shutdown()
