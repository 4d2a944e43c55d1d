"""Nonblocking ops on real MPI processes: start/wait gives the blocking op's
values (numpy on the global X), across jit calls and scan carries, with
inputs donated at once, waits in any order, and gradients through start/wait
equal to the blocking op's."""

from __future__ import annotations

import pytest
from mpi_harness import mpi_test
from reference import rank_setup

pytestmark = pytest.mark.jax_internals


@mpi_test((2, 5), x64=True)
def test_every_nonblocking_op_gives_the_blocking_value():
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxfog.topology as T

    jf, r, n, X = rank_setup(shape=(6,))
    topo = T.exponential(n)
    jf.set_topology(topo)
    W = topo.weights
    schedule = T.one_peer_exponential(n) if n > 2 else T.Schedule([T.ring(n)])
    ints = np.arange(n * 3).reshape(n, 3).astype(np.int32) * 7
    x = {"f": jnp.asarray(X[r]), "i": jnp.asarray(ints[r])}
    table = np.array([[(i - 1) % n, i] for i in range(n)])  # each row: left neighbour, self
    cases = {
        "neighbor_allreduce": (lambda x: jf.neighbor_allreduce_nonblocking(x),
                               {"f": (W @ X)[r], "i": np.rint(W @ ints)[r]}),
        "schedule": (lambda x, s: jf.neighbor_allreduce_nonblocking(x, topology=schedule,
                                                                     step=s),
                     None),
        "allreduce": (lambda x: jf.allreduce_nonblocking(x, "sum"),
                      {"f": X.sum(0), "i": ints.sum(0)}),
        "broadcast": (lambda x: jf.broadcast_nonblocking(x, root=n - 1),
                      {"f": X[n - 1], "i": ints[n - 1]}),
        "allgather": (lambda x: jf.allgather_nonblocking(x),
                      {"f": X.reshape(-1), "i": ints.reshape(-1)}),
        "neighbor_allgather": (lambda x: jf.neighbor_allgather_nonblocking(x),
                               {"f": X[topo.in_neighbors(r)].reshape(-1),
                                "i": ints[topo.in_neighbors(r)].reshape(-1)}),
        "neighbor_allgather_table": (
            lambda x: jf.neighbor_allgather_nonblocking(x, src_ranks=table),
            {"f": X[table[r]].reshape(-1), "i": ints[table[r]].reshape(-1)}),
        "pair_gossip": (lambda x: jf.pair_gossip_nonblocking(x, r ^ 1 if (r ^ 1) < n else r),
                        None),
    }
    for name, (start, expected) in cases.items():
        if name == "schedule":
            for step in range(3):
                want = (schedule.at(step).weights @ X)[r]
                for got in (jf.wait(start(x, step)),
                            jax.jit(lambda x, s: jf.wait(start(x, s)))(x, jnp.int32(step))):
                    np.testing.assert_allclose(got["f"], want, rtol=1e-13, err_msg=name)
            continue
        if name == "pair_gossip":
            peer = r ^ 1 if (r ^ 1) < n else r
            expected = {"f": (X[r] + X[peer]) / 2, "i": np.rint((ints[r] + ints[peer]) / 2)}
        eager = jf.wait(start(x))
        jitted = jax.jit(lambda x: jf.wait(start(x)))(x)
        for got in (eager, jitted):
            np.testing.assert_allclose(got["f"], expected["f"], rtol=1e-13, err_msg=name)
            np.testing.assert_array_equal(got["i"], expected["i"], err_msg=name)
            assert got["i"].dtype == jnp.int32, name


@mpi_test((2, 4), x64=True)
def test_handles_cross_jit_calls_and_scan_carries():
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxfog.topology as T

    jf, r, n, X = rank_setup(seed=1, shape=(6,))
    topo = T.ring(n)
    jf.set_topology(topo)
    W = topo.weights

    # Started in one compiled call, waited for in another, with a blocking op between.
    start = jax.jit(lambda x: jf.neighbor_allreduce_nonblocking(x))
    finish = jax.jit(lambda h, y: jf.wait(h) + y)
    handle = start(jnp.asarray(X[r]))
    total = jf.allreduce(jnp.asarray(X[r]), "sum")
    np.testing.assert_allclose(finish(handle, total), (W @ X)[r] + X.sum(0), rtol=1e-13)

    # Delayed averaging in a scan: x_{t+1} = x_t - lr * g(x_t) mixed with the
    # neighbours' values of the previous step, x_{t+1} = (W x_{t-1}) ...
    steps, lr = 6, 0.1

    def body(carry, _):
        x, handle = carry
        nxt = jf.neighbor_allreduce_nonblocking(x)
        x = 0.5 * x + 0.5 * jf.wait(handle) - lr * x
        return (x, nxt), x

    @jax.jit
    def run(x):
        (x, handle), xs = jax.lax.scan(body, (x, jf.neighbor_allreduce_nonblocking(x)), None,
                                       length=steps)
        return xs, jf.wait(handle)

    xs, last = run(jnp.asarray(X[r]))
    Xs, prev, cur = [], X, X
    for _ in range(steps):
        nxt = 0.5 * cur + 0.5 * (W @ prev) - lr * cur
        prev, cur = cur, nxt
        Xs.append(cur[r])
    np.testing.assert_allclose(xs, np.stack(Xs), rtol=1e-12)
    np.testing.assert_allclose(last, (W @ prev)[r], rtol=1e-12)


@mpi_test((2, 4), x64=True)
def test_inputs_donated_at_start_and_waits_in_any_order():
    import jax
    import jax.numpy as jnp
    import numpy as np

    jf, r, n, X = rank_setup(seed=2, shape=(1 << 16,))  # 512 KiB: the thread moves it
    x = jnp.asarray(X[r])
    first = jax.jit(lambda x: jf.allreduce_nonblocking(x, "sum"))(x)
    # The next computation takes x's buffer over and overwrites it at once:
    # the start copied what it sends.
    y = jax.jit(lambda x: x * 3 + 1, donate_argnums=0)(x)
    assert x.is_deleted()
    np.testing.assert_allclose(y, X[r] * 3 + 1, rtol=1e-12, atol=1e-12)
    second = jf.broadcast_nonblocking(jnp.asarray(X[r]) * 2, root=0)
    third = jf.allgather_nonblocking(jnp.asarray(X[r][:5]))
    import time
    for _ in range(2000):  # poll until done (never forever: the test's timeout)
        if jf.poll(first):
            break
        time.sleep(0.005)
    assert jf.poll(first) is True
    order = [first, second, third] if r % 2 else [third, second, first]
    got = {id(h): jf.wait(h) for h in order}
    np.testing.assert_allclose(got[id(first)], X.sum(0), rtol=1e-12)
    np.testing.assert_allclose(got[id(second)], 2 * X[0], rtol=1e-13)
    np.testing.assert_allclose(got[id(third)], X[:, :5].reshape(-1), rtol=1e-13)


@mpi_test((2, 4), x64=True)
def test_gradients_through_start_and_wait_equal_the_blocking_ops():
    import jax
    import jax.numpy as jnp
    import numpy as np

    jf, r, n, X = rank_setup(seed=3, shape=(6,))
    x = jnp.asarray(X[r])
    push = dict(self_weight=0.4, src_weights={(r - 1) % n: 0.6}, dst_weights={(r + 1) % n: 0.5})
    pairs = [
        (lambda x: jf.neighbor_allreduce(x, **push),
         lambda x: jf.neighbor_allreduce_nonblocking(x, **push)),
        (lambda x: jf.allreduce(x), lambda x: jf.allreduce_nonblocking(x)),
        (lambda x: jf.broadcast(x, root=1), lambda x: jf.broadcast_nonblocking(x, root=1)),
        (lambda x: jf.allgather(x), lambda x: jf.allgather_nonblocking(x)),
        (lambda x: jf.neighbor_allgather(x), lambda x: jf.neighbor_allgather_nonblocking(x)),
    ]
    for blocking, start in pairs:
        def loss_blocking(x):
            y = blocking(x)
            return jnp.sum(jnp.sin(x).sum() * y ** 2)

        def loss_nonblocking(x):
            handle = start(x)
            between = jnp.sin(x).sum()  # computed while the messages move
            return jnp.sum(between * jf.wait(handle) ** 2)

        want = jax.grad(loss_blocking)(x)
        np.testing.assert_allclose(jax.grad(loss_nonblocking)(x), want, rtol=1e-12)
        np.testing.assert_allclose(jax.jit(jax.grad(loss_nonblocking))(x), want, rtol=1e-12)
        tangent = jnp.cos(x)
        _, jvp_want = jax.jvp(loss_blocking, (x,), (tangent,))
        _, jvp_got = jax.jvp(loss_nonblocking, (x,), (tangent,))
        np.testing.assert_allclose(jvp_got, jvp_want, rtol=1e-12)

    # Through a scan whose carry holds the handle (the last one never waited
    # for in the loss: its cotangent is zero).
    def unrolled(x, nonblocking):
        def body(carry, _):
            x, h = carry
            if nonblocking:
                nxt = jf.neighbor_allreduce_nonblocking(x)
                return (jnp.tanh(x) + jf.wait(h), nxt), None
            return (jnp.tanh(x) + jf.neighbor_allreduce(h), x), None

        init = jf.neighbor_allreduce_nonblocking(x) if nonblocking else x
        (x, h), _ = jax.lax.scan(body, (x, init), None, length=3)
        if nonblocking:
            jf.wait(h)  # waited for, unused
        return jnp.sum(x ** 2)

    np.testing.assert_allclose(jax.jit(jax.grad(lambda x: unrolled(x, True)))(x),
                               jax.grad(lambda x: unrolled(x, False))(x), rtol=1e-12)


@mpi_test((2,), alone=True, x64=True)
def test_misuse_gets_a_clear_error():
    import warnings

    import jax
    import jax.numpy as jnp
    import pytest

    from jaxfog.errors import HandleError

    jf, r, n, X = rank_setup(seed=4, shape=(6,))
    x = jnp.asarray(X[r])
    handle = jf.allreduce_nonblocking(x)
    jf.wait(handle)
    with pytest.raises(HandleError, match="already waited"):
        jf.wait(handle)
    copy = jax.tree.map(lambda a: a, jf.allreduce_nonblocking(x))
    jf.wait(copy)
    again = jax.tree.unflatten(jax.tree.structure(copy), jax.tree.leaves(copy))
    with pytest.raises(HandleError, match="handle 2 is not pending on this process"):
        jf.wait(again)  # refused at the call (on CUDA the handler's error would come later)
    with pytest.raises(jax.errors.JaxRuntimeError, match="not pending on this process"):
        jax.block_until_ready(jax.jit(jf.wait)(again))  # inside jit: by the next block
    with pytest.raises(HandleError, match="expected a Handle"):
        jf.wait(x)
    with pytest.raises(HandleError, match="already waited"):
        jf.poll(handle)
    with pytest.raises(HandleError, match="not pending"):
        jf.poll(jax.tree.unflatten(jax.tree.structure(copy), jax.tree.leaves(copy)))
    with pytest.raises(NotImplementedError, match="cannot be vmapped"):
        jax.vmap(lambda v: jf.wait(jf.allreduce_nonblocking(v)))(jnp.stack([x, x]))
    jf.barrier()
    jf.neighbor_allreduce_nonblocking(x)  # never waited for
    jf.allreduce_nonblocking(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jf.shutdown()
    messages = [str(w.message) for w in caught]
    assert any("2 nonblocking op(s) never waited for" in m and "neighbor_allreduce" in m
               for m in messages), messages


@mpi_test((2, 4), x64=True)
def test_window_ops_nonblocking():
    import jax
    import jax.numpy as jnp
    import numpy as np
    import pytest

    import jaxfog.topology as T

    jf, r, n, X = rank_setup(seed=5, shape=(4,))
    jf.set_topology(T.ring(n, style=2))  # r sends to r + 1
    left, right = (r - 1) % n, (r + 1) % n
    x = jnp.asarray(X[r])
    jf.win_create(x, "w", zero_init=True)
    handle = jf.win_accumulate_nonblocking(x, "w", self_weight=0.5, dst_weights={right: 0.5})
    np.testing.assert_allclose(jf.wait(handle), 0.5 * X[r], rtol=1e-13)
    handle = jax.jit(lambda x: jf.win_put_nonblocking(x, "w", dst_weights={right: 2.0}))(x)
    np.testing.assert_allclose(jf.wait(handle), X[r], rtol=1e-13)
    jf.barrier()  # every put has landed
    # My slot for the left neighbour: 2 x_left (the put replaced the accumulate).
    np.testing.assert_allclose(jf.win_update(jnp.zeros(4), "w", self_weight=0.0,
                                             src_weights={left: 1.0}),
                               2 * X[left], rtol=1e-13)
    jf.barrier()
    assert jf.wait(jf.win_get_nonblocking("w", src_weights={left: 0.25})) is True
    jf.barrier()  # every get has read before the update below publishes anew
    np.testing.assert_allclose(jf.win_update(jnp.zeros(4), "w", self_weight=0.0,
                                             src_weights={left: 1.0}),
                               # left's update published 2 x_{left - 1}
                               0.25 * 2 * X[(r - 2) % n], rtol=1e-13)
    with pytest.raises(TypeError, match="not differentiable"):
        jax.grad(lambda x: jnp.sum(jf.wait(jf.win_put_nonblocking(x, "w"))))(x)
    jf.barrier()
    jf.win_free("w")


@mpi_test((2,), x64=True)
def test_a_start_returns_before_its_peer_arrives():
    """Even a small message (which a blocking op runs inline): rank 1 starts
    its side 3 s late, and rank 0's start returns long before."""
    import time

    import jax.numpy as jnp
    import numpy as np

    jf, r, n, X = rank_setup(seed=6, shape=(3,))
    jf.set_comm_thread_min_bytes(1 << 20)  # 24 bytes would run inline if blocking
    x = jnp.asarray(X[r])
    jf.wait(jf.allreduce_nonblocking(x))  # compiled and warm on both ranks
    jf.barrier()
    if r == 1:
        time.sleep(3.0)
    began = time.monotonic()
    handle = jf.allreduce_nonblocking(x, "sum")
    started = time.monotonic() - began
    np.testing.assert_allclose(jf.wait(handle), X.sum(0), rtol=1e-13)
    if r == 0:
        assert started < 1.5, started  # returned without waiting for rank 1


@mpi_test((2,), timeout=180, x64=True)
def test_a_late_peer_hides_behind_compute():
    """Overlap that timing luck cannot fake: rank 1 sleeps LATE s (no CPU)
    before its side of a 4 MB exchange while rank 0 computes for C s (about
    0.4 LATE). One after the other the two add up; start/wait across calls,
    and one jitted step holding both, take about max(LATE, C): at least half
    of min(LATE, C) must be hidden. C is measured inside each run (a busy
    machine slows the compute of one run, not of another), and each variant
    keeps its best of 3 interleaved runs."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    jf, r, n, X = rank_setup(seed=8, shape=(1 << 19,))  # float64: 4 MB
    jf.set_comm_thread_min_bytes(0)  # the blocking op in one step on the communication thread too
    late = 1.0
    x = jnp.asarray(X[r])
    want = X.mean(0)  # 2 ranks: the exponential graph averages both

    def body(i, a):
        return jnp.tanh(a @ a) * 0.5

    def chunks(a, iterations):
        # 12 loops, not one: XLA:CPU runs a program of 8 thunks or fewer one thunk
        # after the other, waiting for an asynchronous custom call before the next.
        for k in range(12):
            a = jax.lax.fori_loop(0, iterations, body, a) + k
        return a

    a = jnp.ones((256, 256)) / 256
    probe = jax.jit(lambda a: chunks(a, 2))
    jax.block_until_ready(probe(a))
    began = time.perf_counter()
    jax.block_until_ready(probe(a))
    per_iteration = (time.perf_counter() - began) / 24
    iterations = int(np.clip(0.4 * late / 12 / per_iteration, 1, 10_000))
    iterations = jf.allgather(jnp.asarray([iterations]))[0]  # the same program on both ranks
    compute = jax.jit(lambda a: chunks(a, int(iterations)))
    blocking = jax.jit(jf.neighbor_allreduce)
    start, finish = jax.jit(jf.neighbor_allreduce_nonblocking), jax.jit(jf.wait)
    one_step = jax.jit(lambda x, a: (jf.neighbor_allreduce(x), compute(a)))
    results = [compute(a), blocking(x), finish(start(x)), *one_step(x, a)]  # compiled
    jax.block_until_ready(results)

    def timed_compute():
        began = time.perf_counter()
        jax.block_until_ready(compute(a))
        return time.perf_counter() - began

    def sequential():
        y = jax.block_until_ready(blocking(x))
        return y, timed_compute()

    def start_wait():
        handle = start(x)
        c = timed_compute()
        return jax.block_until_ready(finish(handle)), c

    def in_one_step():
        c = timed_compute()  # its compute alone, just before (same program, same load)
        jf.barrier()
        began = time.perf_counter()
        if r == 1:
            time.sleep(late)
            y = jax.block_until_ready(blocking(x))
        else:
            y = jax.block_until_ready(one_step(x, a))[0]
        return y, c, time.perf_counter() - began

    runs = {"sequential": [], "start/wait": [], "one step": []}
    for _ in range(3):
        for name, variant in (("sequential", sequential), ("start/wait", start_wait)):
            jf.barrier()
            began = time.perf_counter()
            if r == 1:
                time.sleep(late)  # late, without using a core
                y, c = jax.block_until_ready(blocking(x)), 0.0
            else:
                y, c = variant()
            runs[name].append((time.perf_counter() - began, c))
            np.testing.assert_allclose(y, want, rtol=1e-13)
        y, c, t = in_one_step()
        runs["one step"].append((t, c))
        np.testing.assert_allclose(y, want, rtol=1e-13)
    if r == 0:
        best = {name: min(times) for name, times in runs.items()}  # (step, its compute)
        report = f"peer late {late} s; best (step s, compute s): {best}"
        t, c = best["sequential"]
        assert t > late + 0.8 * c, report  # the peer was late, and both ran in turn
        for name in ("start/wait", "one step"):
            t, c = best[name]
            assert t < max(late, c) + 0.5 * min(late, c), (name, report)
