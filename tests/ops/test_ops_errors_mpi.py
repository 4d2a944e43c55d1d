"""Bad input: clear errors on every affected rank, never a hang or a wrong number."""

from __future__ import annotations

import pytest

from mpi_harness import mpi_test
from reference import rank_setup


@mpi_test(nprocs=(2, 3), x64=True)
def test_argument_errors_raise_at_trace_time():
    import jax.numpy as jnp
    import numpy as np

    import jaxfog.topology as T

    jf, r, n, _ = rank_setup()
    x = jnp.ones(4)
    other = (r + 1) % n
    cases = [
        (TypeError, "src_weights.* must be a real number",
         lambda: jf.neighbor_allreduce(x, self_weight=0.5, src_weights={other: "half"},
                                       dst_weights=[other])),
        (TypeError, "self_weight must be a real number",
         lambda: jf.neighbor_allreduce(x, self_weight=1 + 2j, src_weights={}, dst_weights=[])),
        (ValueError, f"rank {n} is out of range for {n} ranks",
         lambda: jf.neighbor_allreduce(x, self_weight=0.5, src_weights={n: 0.5},
                                       dst_weights=[])),
        (ValueError, "cannot be its own neighbor",
         lambda: jf.neighbor_allreduce(x, self_weight=0.5, src_weights={},
                                       dst_weights=[r])),
        (ValueError, "self_weight is required",
         lambda: jf.neighbor_allreduce(x, src_weights={other: 1.0}, dst_weights=[other])),
        (ValueError, "static topology's in-neighbours",
         lambda: jf.neighbor_allreduce(x, self_weight=0.5, src_weights={})),
        (ValueError, "a Schedule needs step=",
         lambda: jf.neighbor_allreduce(x, topology=T.one_peer_exponential(n))),
        (TypeError, "step must be an integer scalar",
         lambda: jf.neighbor_allreduce(x, topology=T.one_peer_exponential(n), step=0.5)),
        (ValueError, "weights come from it",
         lambda: jf.neighbor_allreduce(x, topology=T.one_peer_exponential(n), step=0,
                                       self_weight=0.5)),
        (ValueError, f"has {n + 1} nodes but there are {n} ranks",
         lambda: jf.neighbor_allreduce(x, topology=T.ring(n + 1))),
        (TypeError, "dtype bool is not supported",
         lambda: jf.neighbor_allreduce(jnp.ones(3, bool))),
        (TypeError, "dtype int8 is not supported", lambda: jf.allreduce(jnp.ones(3, jnp.int8))),
        (ValueError, "op must be 'mean' or 'sum'", lambda: jf.allreduce(x, op="max")),
        (ValueError, f"root must be a rank in \\[0, {n}\\)", lambda: jf.broadcast(x, root=n)),
        (ValueError, "lists a rank twice",
         lambda: jf.neighbor_allgather(x, src_ranks=[other, other], dst_ranks=[other])),
        (TypeError, "must be a list of ranks",
         lambda: jf.neighbor_allgather(x, src_ranks=3, dst_ranks=[other])),
    ]
    # A weight traced inside jit: the op and the argument named, and why MPI needs it static.
    import jax

    traced = "is a traced value.*C\\+\\+ op takes its weights when it is compiled"
    cases += [
        (TypeError, f"neighbor_allreduce: src_weights\\[{other}\\] {traced}",
         lambda: jax.jit(lambda w: jf.neighbor_allreduce(
             x, self_weight=0.5, src_weights={other: w}, dst_weights=[other]))(0.5)),
        (TypeError, f"neighbor_allreduce: dst_weights\\[{other}\\] {traced}",
         lambda: jax.jit(lambda w: jf.neighbor_allreduce(
             x, self_weight=0.5, src_weights={other: 1.0}, dst_weights={other: w}))(0.5)),
        (TypeError, "neighbor_allreduce: self_weight is a traced value",
         lambda: jax.jit(lambda w: jf.neighbor_allreduce(
             x, self_weight=w, src_weights={}, dst_weights=[]))(0.5)),
        (TypeError, "hierarchical_neighbor_allreduce: self_weight is a traced value",
         lambda: jax.jit(lambda w: jf.hierarchical_neighbor_allreduce(
             x, self_weight=w, src_machine_weights={}, dst_machine_weights=[]))(0.5)),
    ]
    for error, message, call in cases:
        with pytest.raises(error, match=message):
            call()
    # Nothing was sent: the ranks are still in step.
    np.testing.assert_allclose(jf.allreduce(jnp.asarray(float(r))), np.mean(np.arange(n)))


@mpi_test(nprocs=(2, 3), x64=True)
def test_check_topology_names_the_mismatched_ranks():
    import jax.numpy as jnp

    jf, r, n, _ = rank_setup()
    x = jnp.ones(4)
    # Rank 0 sends to rank 1, which does not expect it.
    dst = [1] if r == 0 else []
    with pytest.raises(ValueError, match="rank 0 sends to rank 1 but rank 1 does not "
                                         "receive from it"):
        jf.neighbor_allreduce(x, self_weight=1.0, src_weights={}, dst_weights=dst,
                              check_topology=True)
    # A matching dynamic graph passes the check and averages.
    ring_src = {(r - 1) % n: 0.5}
    y = jf.neighbor_allreduce(jnp.full(4, float(r)), self_weight=0.5, src_weights=ring_src,
                              dst_weights=[(r + 1) % n], check_topology=True)
    assert float(y[0]) == 0.5 * r + 0.5 * ((r - 1) % n)


@mpi_test(nprocs=(2, 3), env={"JAXFOG_TIMEOUT": "2"}, x64=True)
def test_missing_sender_times_out_naming_the_peer():
    import time

    import jax.numpy as jnp

    jf, r, n, _ = rank_setup()
    # Rank 1 waits for rank 0, which sends nothing: an error within the timeout.
    src = {0: 0.5} if r == 1 else {}
    start = time.monotonic()
    if r == 1:
        with pytest.raises(Exception, match="neighbor_allreduce .op #1 on rank 1. timed out "
                                            "after 2 s .JAXFOG_TIMEOUT. waiting for the "
                                            "header from rank 0"):
            jf.neighbor_allreduce(jnp.ones(4), self_weight=0.5, src_weights=src,
                                  dst_weights=[])
        assert time.monotonic() - start < 15
        # A peer that never answered may have died: nothing more is posted to it
        # (MPICH's ch4:ucx crashes sending to a dead process); the next op with
        # it fails at once, naming it and why.
        start = time.monotonic()
        with pytest.raises(Exception, match="neighbor_allreduce .op #2 on rank 1.: rank 0 has "
                                            "failed: it did not answer jaxfog neighbor_allreduce "
                                            ".op #1 on rank 1. within 2 s .JAXFOG_TIMEOUT.; "
                                            "jaxfog posts nothing more to it"):
            jf.neighbor_allreduce(jnp.ones(4), self_weight=0.5, src_weights=src,
                                  dst_weights=[])
        assert time.monotonic() - start < 1
    else:
        jf.neighbor_allreduce(jnp.ones(4), self_weight=0.5, src_weights=src, dst_weights=[])


@mpi_test(nprocs=(2,), x64=True)
def test_the_launchers_notice_that_a_process_died_does_not_kill_a_rank():
    import os
    import signal

    import jax.numpy as jnp

    # Hydra (with -disable-auto-cleanup) sends SIGUSR1 to every process of the
    # job when one dies; jaxfog catches it and asks MPI which died. Here none
    # did: the rank lives on and its ops go on.
    jf, r, n, _ = rank_setup()
    os.kill(os.getpid(), signal.SIGUSR1)
    y = jf.allreduce(jnp.full(3, float(r)), op="sum")
    assert float(y[0]) == sum(range(n))
    y = jf.neighbor_allreduce(jnp.full(3, float(r)), self_weight=0.5,
                              src_weights={(r + 1) % n: 0.5}, dst_weights=[(r - 1) % n])
    assert float(y[0]) == 0.5 * r + 0.5 * ((r + 1) % n)


@mpi_test(nprocs=(2, 3), env={"JAXFOG_TIMEOUT": "3"}, x64=True)
def test_shape_dtype_and_op_order_differences_are_reported():
    import jax.numpy as jnp

    jf, r, n, _ = rank_setup()
    # Shapes differ between ranks: every rank that receives a wrong size says so.
    x = jnp.ones(4 if r == 0 else 5)
    with pytest.raises(Exception, match="shapes or dtypes differ between ranks"):
        jf.neighbor_allreduce(x)
    # Collectives check agreement first, on every rank.
    with pytest.raises(Exception, match="shapes or dtypes differ between ranks"):
        jf.allreduce(jnp.ones(3, jnp.float32 if r == 0 else jnp.float64))
    with pytest.raises(Exception, match="ranks called different operations"):
        if r == 0:
            jf.allreduce(jnp.ones(3))
        else:
            jf.broadcast(jnp.ones(3))
    # A neighbor op facing a collective: both sides time out, naming what they waited for.
    with pytest.raises(Exception, match="timed out after 3 s"):
        if r == 0:
            jf.allreduce(jnp.ones(3))
        else:
            jf.neighbor_allreduce(jnp.ones(3), self_weight=1.0, src_weights={0: 1.0},
                                  dst_weights=[])


def test_layouts_in_headers_are_short_and_count_the_leaves():
    import jax.numpy as jnp
    from jax import core

    from jaxfog.ops._primitive_machinery import LAYOUT_CHARS, layout

    def avals(*specs):
        return [core.ShapedArray(shape, dtype) for shape, dtype in specs]

    assert layout(avals(((3, 4), jnp.float32), ((), jnp.int32), ((2,), jnp.bfloat16),
                        ((5,), jnp.bool_), ((1,), jnp.complex64), ((1,), jnp.uint8))) == \
        "f32[3,4], i32[], bf16[2], bool[5], c64[1], u8[1]"
    big = layout(avals(*[((1024, 1024), jnp.float32)] * 300))
    assert big == "f32[1024,1024], " * 4 + "... (300 leaves)"
    assert len(big) <= LAYOUT_CHARS


def _ranks(ranks) -> str:
    """The C++ errors' words for ranks: "rank 2", "ranks 0 and 2", "ranks 0, 2 and 3"."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


@mpi_test(nprocs=(3, 4), env={"JAXFOG_TIMEOUT": "10"}, x64=True)
def test_layout_mismatches_name_the_odd_rank_and_show_both_layouts():
    import re

    import jax.numpy as jnp

    import jaxfog.topology as T

    jf, r, n, _ = rank_setup()
    jf.set_topology(T.ring(n))  # rank i hears from i - 1 and i + 1
    odd = 1

    def expect(call, common, different, *, neighbours):
        """On each rank that sees rank 1: who differs, then both layouts."""
        seen = sorted(jf.in_neighbor_ranks()) if neighbours else [q for q in range(n) if q != r]
        if odd not in seen and r != odd:
            call()  # rank 3 of 4 neither hears from rank 1 nor sends to it
            return
        if r == odd:
            peers = ("its neighbours " + _ranks(seen)[6:]) if neighbours else _ranks(seen)
            text = (f"this rank differs from {peers}: this rank ({r}) has {different}; "
                    f"{_ranks(seen)} have {common}")
        else:
            rest = _ranks(set(seen) - {odd})
            text = (f"rank {odd} differs from this rank and {rest}: rank {odd} has "
                    f"{different}; this rank ({r}) and {rest} have {common}")
        with pytest.raises(Exception, match="shapes or dtypes differ between ranks: "
                                            + re.escape(text)):
            call()

    def pick(common, different):
        return different if r == odd else common

    # Different byte counts; the same byte count with other shapes (a pytree);
    # the same shape with another dtype.
    for common, different, text in [
            (jnp.ones(3, jnp.float32), jnp.ones(4, jnp.float32), ("f32[3]", "f32[4]")),
            ((jnp.ones((2, 3), jnp.float32), jnp.ones((), jnp.int32)),
             (jnp.ones((3, 2), jnp.float32), jnp.ones((), jnp.int32)),
             ("f32[2,3], i32[]", "f32[3,2], i32[]")),
            (jnp.ones(4, jnp.float32), jnp.ones(4, jnp.int32), ("f32[4]", "i32[4]"))]:
        x = pick(common, different)
        expect(lambda: jf.neighbor_allreduce(x), *text, neighbours=True)
    # Collectives compare every rank's layout.
    expect(lambda: jf.allreduce(pick(jnp.ones(3, jnp.float32), jnp.ones(4, jnp.float32))),
           "f32[3]", "f32[4]", neighbours=False)
    expect(lambda: jf.allreduce(pick(jnp.ones(4, jnp.float32), jnp.ones(4, jnp.int32))),
           "f32[4]", "i32[4]", neighbours=False)
    expect(lambda: jf.allgather(pick(jnp.ones((2, 3), jnp.float32),
                                     jnp.ones((3, 2), jnp.float32))),
           "f32[2,3]", "f32[3,2]", neighbours=False)


@mpi_test(nprocs=(2, 3), env={"JAXFOG_MAX_MESSAGE_BYTES": "1000"}, x64=True)
def test_messages_larger_than_one_mpi_message_travel_in_pieces():
    """The chunked path (what carries counts past 2**31 elements) on small sizes."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from reference import global_values

    jf, r, n, _ = rank_setup()
    X = global_values(n, (1001,))  # 8008 bytes: 9 pieces of <= 1000 bytes
    W = jf.load_topology().weights
    np.testing.assert_allclose(jf.neighbor_allreduce(X[r]), (W @ X)[r], rtol=1e-13,
                               atol=1e-15)
    tree = [jnp.asarray(X[r][:333], jnp.float32), jnp.asarray(X[r][:7]),
            jnp.asarray(X[r][:250], jnp.float16), jnp.asarray(X[r])]
    out = jax.jit(jf.neighbor_allreduce)(tree)
    np.testing.assert_allclose(out[0], (W @ X[:, :333])[r], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out[2].astype(float), (W @ X[:, :250])[r], atol=5e-3)
    np.testing.assert_allclose(out[3], (W @ X)[r], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(jf.allreduce(X[r]), X.mean(0), rtol=1e-13, atol=1e-15)
    np.testing.assert_array_equal(jf.broadcast(X[r], root=n - 1), X[n - 1])
    np.testing.assert_array_equal(jf.neighbor_allgather(X[r]),
                                  np.concatenate([X[j] for j in jf.in_neighbor_ranks()]))
    with pytest.raises(Exception, match="8008 bytes per rank is more than one MPI message"):
        jf.allgather(X[r])
