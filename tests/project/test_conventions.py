"""One convention for bad arguments and failures, on every public entry point:
TypeError for a wrong type, ValueError for a wrong value (checked when a
transformation is made, where it can be), JaxfogError for runtime failures;
learning rates take optax schedules wherever they take a float."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfog as jf
import jaxfog.asynchrony as jfa
import jaxfog.compress as C
import jaxfog.optax as jfo
import jaxfog.topology as T
from jaxfog import timeline
from jaxfog.checkpoint import CheckpointManager, convert
from optax_cases import least_squares


@pytest.mark.parametrize("call, error, match", [
    (lambda: jf.broadcast(jnp.ones(2), root="a"), TypeError, "root must be an int"),
    (lambda: jf.broadcast(jnp.ones(2), root=3), ValueError, r"root must be a rank in \[0, 1\)"),
    (lambda: jf.set_comm_thread_min_bytes(1.5), TypeError, "min_bytes must be an int"),
    (lambda: jf.set_comm_thread_min_bytes(-1), ValueError, "min_bytes must be >= 0"),
    (lambda: C.low_rank(2.0), TypeError, "rank must be an int"),
    (lambda: C.low_rank(0), ValueError, "rank must be >= 1"),
    (lambda: C.qsgd("7"), TypeError, "levels must be an int"),
    (lambda: C.qsgd(7, bucket=0), ValueError, "bucket must be >= 1"),
    (lambda: jfo.choco(optax.sgd(0.1), compressor=C.sign(), gamma="1"), TypeError,
     "gamma must be a number"),
    (lambda: jfo.choco(optax.sgd(0.1), compressor=C.sign(), gamma=0.0), ValueError,
     r"gamma must be in \(0.0, 1.0\]"),
    (lambda: jfo.atc(optax.sgd(0.1), communication=1), TypeError, "communication must be a str"),
    (lambda: jfo.atc(optax.sgd(0.1), communication="gossip"), ValueError,
     r"jaxfog.optax.atc: communication must be one of \['neighbor'"),
    (lambda: jfo.awc(optax.sgd(0.1), global_every=0), ValueError, "global_every must be >= 1"),
    (lambda: jfo.atc(optax.sgd(0.1), global_every=2.0), TypeError, "global_every must be an int"),
    (lambda: jfo.gradient_tracking("0.1"), TypeError, "learning_rate must be a number or an optax"),
    (lambda: jfo.exact_diffusion(-0.1), ValueError, "learning_rate must be in"),
    (lambda: jfa.hop(optax.sgd(0.1), backups=1.5), TypeError, "backups must be an int"),
    (lambda: jfa.hop(optax.sgd(0.1), staleness=-1), ValueError, "staleness must be >= 0"),
    (lambda: convert("a", "b", processes="4", like=None), TypeError, "processes must be an int"),
    # Ops, windows and the runtime.
    (lambda: jf.allreduce(jnp.ones(2), op=1), TypeError, "allreduce: op must be 'mean' or 'sum'"),
    (lambda: jf.allreduce(jnp.ones(2), name=1), TypeError,
     "allreduce: name must be a str or None"),
    (lambda: jf.neighbor_allreduce(jnp.ones(2), check_topology="yes"), TypeError,
     "neighbor_allreduce: check_topology must be True or False"),
    (lambda: jf.neighbor_allreduce(jnp.ones(2), topology=T.one_peer_exponential(1),
                                   step="0"), TypeError,
     "neighbor_allreduce: step must be an integer scalar, got str"),
    (lambda: jf.allgather("abc"), TypeError,
     r"^jaxfog.allgather: x must be an array or a pytree of arrays"),
    (lambda: jf.win_create(jnp.ones(2), "w", src_ranks=[0.0]), TypeError,
     r"win_create: src_ranks: 0.0 is not a rank \(an int\)"),
    (lambda: jf.win_create(jnp.ones(2), ""), ValueError,
     "win_create: a window's name must be a non-empty string"),
    (lambda: jf.win_mutex("w", ranks="0"), TypeError, "win_mutex: ranks must be a list of ranks"),
    (lambda: jf.win_mutex("w", ranks=[1.0]), TypeError, r"win_mutex: ranks: 1.0 is not a rank"),
    (lambda: jf.win_mutex("w", ranks=[3]), ValueError, r"win_mutex: 3 is not a rank in \[0, 1\)"),
    (lambda: jf.init(topology="ring"), TypeError,
     r"^jaxfog.init: topology must be a jaxfog.topology.Topology or a networkx graph"),
    (lambda: jf.set_topology(np.eye(1)), TypeError, r"^jaxfog.set_topology: topology must be"),
    (lambda: jf.set_machine_topology("ring"), TypeError,
     r"^jaxfog.set_machine_topology: topology must be"),
    (lambda: jf.comm_stats(reset="yes"), TypeError,
     r"^jaxfog.comm_stats: reset must be True or False"),
    (lambda: jf.jit(1), TypeError, r"^jaxfog.jit: fn must be callable"),
    # Simulation.
    (lambda: jf.simulate(None, 4), TypeError, r"^jaxfog.simulate: fn must be callable"),
    (lambda: jf.simulate(lambda x: x, 0), ValueError,
     r"^jaxfog.simulate: the number of agents must be >= 1"),
    (lambda: jf.simulate(lambda x: x, 4, local_size=2.0), TypeError,
     r"^jaxfog.simulate: local_size must be an int"),
    (lambda: jf.simulate(lambda x: x, 4, machine_topology="ring"), TypeError,
     r"^jaxfog.simulate: machine_topology must be a Topology"),
    (lambda: jf.simulate(lambda x: x, 2, delays=jf.Delays(compute="fast")), TypeError,
     r"^jaxfog.Delays: compute must be a number or an array of numbers"),
    (lambda: jf.simulate(lambda x: x, 2, delays=jf.Delays(jitter="0.1")), TypeError,
     r"^jaxfog.Delays: jitter must be a number"),
    (lambda: jf.simulate(lambda x: x, 2, delays=jf.Delays(seed=0.5)), TypeError,
     r"^jaxfog.Delays: seed must be an int"),
    (lambda: jf.simulate(lambda x: x, 2, delays=jf.Delays(queue=0)), ValueError,
     r"^jaxfog.Delays: queue must be >= 1"),
    (lambda: jf.Agents(0), ValueError, r"^jaxfog.Agents: simulated must be >= 1"),
    (lambda: jf.Agents("4"), TypeError, r"^jaxfog.Agents: simulated must be an int"),
    (lambda: jf.Agents(4, topology="ring"), TypeError, r"^jaxfog.Agents: topology must be"),
    (lambda: jf.Agents(4, local_size=3), ValueError,
     r"^jaxfog.Agents: local_size=3 must be a positive divisor"),
    (lambda: jf.Agents(4, per_device=0), ValueError, r"^jaxfog.Agents: per_device must be >= 1"),
    # Checkpoints and timelines.
    (lambda: CheckpointManager(3), TypeError,
     r"^jaxfog.checkpoint.CheckpointManager: directory must be a path"),
    (lambda: CheckpointManager("unused", max_to_keep=0), ValueError,
     r"^jaxfog.checkpoint.CheckpointManager: max_to_keep must be >= 1"),
    (lambda: CheckpointManager("unused", async_save=1), TypeError,
     r"^jaxfog.checkpoint.CheckpointManager: async_save must be True or False"),
    (lambda: convert(None, "b", processes=2, like=None), TypeError,
     r"^jaxfog.checkpoint.convert: source must be a path"),
    (lambda: timeline.merge("rank0.json"), TypeError,
     r"^jaxfog.timeline.merge: paths must be a list of paths"),
    (lambda: timeline.expand([1]), TypeError,
     r"^jaxfog.timeline.expand: patterns must be a list of paths"),
    # jaxfog.optax: inner, topology, seed and groups are checked when it is made.
    (lambda: jfo.atc("sgd"), TypeError,
     r"^jaxfog.optax.atc: inner must be an optax GradientTransformation"),
    (lambda: jfo.awc(optax.sgd(0.1), topology="ring"), TypeError,
     r"^jaxfog.optax.awc: topology must be a Topology, a Schedule or None"),
    (lambda: jfo.gradient_allreduce(0.1), TypeError,
     r"^jaxfog.optax.gradient_allreduce: inner must be an optax"),
    (lambda: jfo.gradient_allreduce(optax.sgd(0.1), compressor=C.sign(), seed=1.5),
     TypeError, r"^jaxfog.optax.gradient_allreduce: seed must be an int"),
    (lambda: jfo.awc(optax.sgd(0.1), compressor=C.sign(), groups="search"), TypeError,
     r"^jaxfog.optax.awc: groups must be None, a number of groups"),
    (lambda: jfo.choco(optax.sgd(0.1), compressor=C.sign(), gamma=0.5, groups=0),
     ValueError, r"^jaxfog.optax.choco: groups must be >= 1"),
    (lambda: jfo.choco(None, compressor=C.sign(), gamma=0.5), TypeError,
     r"^jaxfog.optax.choco: inner must be an optax"),
    (lambda: jfo.beer(0.1, compressor=C.sign(), gamma=0.5, topology=4), TypeError,
     r"^jaxfog.optax.beer: topology must be"),
    (lambda: jfo.gradient_tracking(float("inf")), ValueError,
     r"^jaxfog.optax.gradient_tracking: learning_rate must be in \[0.0, inf\)"),
    (lambda: jfo.exact_diffusion(0.1, topology=np.eye(4)), TypeError,
     r"^jaxfog.optax.exact_diffusion: topology must be"),
    (lambda: jfo.push_diging(0.1, topology="exponential"), TypeError,
     r"^jaxfog.optax.push_diging: topology must be"),
    (lambda: jfo.push_sum(optax.sgd), TypeError, r"^jaxfog.optax.push_sum: inner must be"),
    (lambda: jfo.async_push_sum(optax.sgd(0.1), name=3), TypeError,
     r"^jaxfog.optax.async_push_sum: name must be a str"),
    (lambda: jfo.async_push_sum(optax.sgd(0.1), topology=T.one_peer_exponential(4)),
     TypeError, r"^jaxfog.optax.async_push_sum: topology must be a Topology or None"),
    (lambda: jfo.column_stochastic("ring"), TypeError,
     r"^jaxfog.optax.column_stochastic: topology must be a Topology"),
    (lambda: jfo.check_chain("sgd"), TypeError, r"^jaxfog.optax.check_chain: optimizer must"),
    # jaxfog.asynchrony: trainers name themselves, not the transformation they wrap.
    (lambda: jfa.from_optax(optax.sgd), TypeError,
     r"^jaxfog.asynchrony.from_optax: optimizer must be an optax"),
    (lambda: jfa.from_optax(optax.sgd(0.1), asynchronous=1), TypeError,
     r"^jaxfog.asynchrony.from_optax: asynchronous must be True or False"),
    (lambda: jfa.async_push_sum(optax.sgd(0.1), name=""), ValueError,
     r"^jaxfog.asynchrony.async_push_sum: name must not be empty"),
    (lambda: jfa.adpsgd("sgd"), TypeError, r"^jaxfog.asynchrony.adpsgd: inner must be"),
    (lambda: jfa.adpsgd(optax.sgd(0.1), seed="0"), TypeError,
     r"^jaxfog.asynchrony.adpsgd: seed must be an int"),
    (lambda: jfa.hop(optax.sgd(0.1), topology=T.one_peer_exponential(4)), TypeError,
     r"^jaxfog.asynchrony.hop: topology must be a Topology or None"),
    (lambda: jfa.hop(optax.sgd(0.1), skip="yes"), TypeError,
     r"^jaxfog.asynchrony.hop: skip must be True or False"),
    (lambda: jfa.pick("1", 0, 0, 3), TypeError, r"^jaxfog.asynchrony.pick: seed must be an int"),
    (lambda: jfa.pick(1, 0, 0, 0), ValueError, r"^jaxfog.asynchrony.pick: count must be >= 1"),
    (lambda: jfa.run("trainer", None, lambda p, k: p, 3), TypeError,
     r"^jaxfog.asynchrony.run: trainer must be a jaxfog.asynchrony.Trainer"),
    (lambda: jfa.run(jfa.from_optax(optax.sgd(0.1)), None, lambda p, k: p, -1), ValueError,
     r"^jaxfog.asynchrony.run: iterations must be >= 0"),
    (lambda: jfa.run(jfa.from_optax(optax.sgd(0.1)), None, lambda p, k: p, 2.0), TypeError,
     r"^jaxfog.asynchrony.run: iterations must be an int"),
    (lambda: jfa.run(jfa.from_optax(optax.sgd(0.1)), None, None, 2), TypeError,
     r"^jaxfog.asynchrony.run: grad_fn must be callable"),
    # jaxfog.compress: flags are bools, compressors are Compressors, counts are ints.
    (lambda: C.rand_k(0.1, unbiased="yes"), TypeError,
     r"^jaxfog.compress.rand_k: unbiased must be True or False"),
    (lambda: C.qsgd(7, unbiased=0), TypeError,
     r"^jaxfog.compress.qsgd: unbiased must be True or False"),
    (lambda: C.low_rank(2, vectors="identity"), TypeError,
     r"^jaxfog.compress.low_rank: vectors must be a jaxfog.compress Compressor"),
    (lambda: C.balanced([jnp.ones(2)] * 2, 1.0), TypeError,
     r"^jaxfog.compress.balanced: y must be an int"),
    (lambda: C.check_groups(C.sign(), [jnp.ones(2)] * 2, "all"), TypeError,
     r"^jaxfog.compress: groups must be a sequence of \(start, stop\) pairs"),
    (lambda: C.check_groups(C.sign(), [jnp.ones(2)] * 2, ((0, 2.0),)), TypeError,
     r"^jaxfog.compress: a group's stop must be an int"),
    (lambda: C.compress_tree("sign", [jnp.ones(2)], jax.random.PRNGKey(0)), TypeError,
     r"^jaxfog.compress.compress_tree: compressor must be a jaxfog.compress Compressor"),
    (lambda: C.tree_bytes(None, [jnp.ones(2)]), TypeError,
     r"^jaxfog.compress.tree_bytes: compressor must be"),
    (lambda: C.search(C.sign(), [jnp.ones(2)] * 2, timer=lambda g: 1.0, alpha="0.1"),
     TypeError, r"^jaxfog.compress.search: alpha must be a number"),
    (lambda: C.search(C.sign(), [jnp.ones(2)] * 2, timer=1.0), TypeError,
     r"^jaxfog.compress.search: timer must be callable"),
    (lambda: C.exchange_timer(C.sign(), [jnp.ones(2)], repeats=0), ValueError,
     r"^jaxfog.compress.exchange_timer: repeats must be >= 1"),
    (lambda: C.exchange_timer(C.sign(), [jnp.ones(2)], fused=None), TypeError,
     r"^jaxfog.compress.exchange_timer: fused must be True or False"),
    # jaxfog.topology: every message names the constructor.
    (lambda: T.exponential(0), ValueError, r"^jaxfog.topology.exponential: n must be >= 1"),
    (lambda: T.ring(4.0), TypeError, r"^jaxfog.topology.ring: n must be an integer"),
    (lambda: T.ring(4, style=3), ValueError, r"^jaxfog.topology.ring: style must be 0"),
    (lambda: T.star(4, center=4), ValueError, r"^jaxfog.topology.star: center 4 is out"),
    (lambda: T.mesh_grid_2d(4, 4), TypeError,
     r"^jaxfog.topology.mesh_grid_2d: shape must be a pair"),
    (lambda: T.inner_outer_ring(4, 0), ValueError,
     r"^jaxfog.topology.inner_outer_ring: local_size must be >= 1"),
    (lambda: T.one_peer(T.ring(4), max_period=2.0), TypeError,
     r"^jaxfog.topology.one_peer: max_period must be an integer"),
    (lambda: T.one_peer(T.ring(4), max_period=0), ValueError,
     r"^jaxfog.topology.one_peer: max_period must be >= 1"),
    (lambda: T.Schedule(1), TypeError, r"^jaxfog.topology.Schedule: topologies must be a"),
    (lambda: T.Schedule([]), ValueError, r"^jaxfog.topology.Schedule: a Schedule needs"),
    (lambda: T.Topology(np.ones((2, 3))), ValueError,
     r"^jaxfog.topology.Topology: weights must be square"),
    (lambda: T.from_networkx(1), TypeError,
     r"^jaxfog.topology.from_networkx: graph must be a networkx"),
    (lambda: T.metropolis_hastings(np.ones(3)), ValueError,
     r"^jaxfog.topology.metropolis_hastings: adjacency must be"),
    (lambda: T.send_recv_ranks(T.ring(4), 4), ValueError,
     r"^jaxfog.topology.send_recv_ranks: rank 4 is out of range"),
    (lambda: T.ring(4).in_neighbors("0"), TypeError,
     r"^Topology.in_neighbors: rank must be an integer"),
    (lambda: T.from_weights(np.eye(2), name=2), TypeError,
     r"^jaxfog.topology.Topology: name must be a str or None"),
    (lambda: T.Schedule([T.ring(2)], name=("a",)), TypeError,
     r"^jaxfog.topology.Schedule: name must be a str or None"),
])
def test_wrong_types_and_wrong_values(call, error, match):
    jf.init()
    with pytest.raises(error, match=match):
        call()


def test_runtime_failures_share_one_base():
    from jaxfog.ffi import FfiLibraryError

    assert issubclass(jf.JaxfogTimeoutError, jf.JaxfogError)
    assert issubclass(jf.JaxfogTimeoutError, TimeoutError)
    assert issubclass(FfiLibraryError, jf.JaxfogError) and issubclass(FfiLibraryError,
                                                                      ImportError)


@pytest.mark.parametrize("make", [
    lambda lr: jfo.gradient_tracking(lr), lambda lr: jfo.exact_diffusion(lr),
    lambda lr: jfo.push_diging(lr),
    lambda lr: jfo.beer(lr, compressor=C.identity(), gamma=1.0)],
    ids=["gradient_tracking", "exact_diffusion", "push_diging", "beer"])
def test_learning_rates_take_optax_schedules(make):
    """A schedule gives the iterates of the constant step it takes at each step:
    here a piecewise-constant one, against two runs stitched together."""
    problem, topo = least_squares(4), T.exponential(4)
    loss = problem.loss(4)
    a = 0.3 / problem.lipschitz
    schedule = optax.piecewise_constant_schedule(a, {5: 0.5})

    def run(lr, steps, state=None):
        tx = make(lr)

        def agent(x, state, A, B):
            state = tx.init(x) if state is None else state
            for _ in range(steps):
                updates, state = tx.update(jax.grad(loss)(x, A, B), state, x)
                x = optax.apply_updates(x, updates)
            return x, state

        x0 = jnp.zeros((4, problem.A.shape[-1])) if state is None else state[0]
        return jax.jit(jf.simulate(agent, topo, in_axes=(0, None if state is None else 0,
                                                         0, 0)))(
            x0, None if state is None else state[1], jnp.asarray(problem.A),
            jnp.asarray(problem.B))

    with jax.enable_x64(True):
        scheduled, _ = run(schedule, 8)
        first = run(a, 5)
        # The state carries the step count: continue with the halved constant step.
        second, _ = run(0.5 * a, 3, first)
        np.testing.assert_allclose(scheduled, second, rtol=1e-10, atol=1e-12)
