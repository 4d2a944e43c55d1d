"""The per-agent functions that "one program, any scale" runs on every backend.

Every op with every form of its arguments (numbers, ``{rank: w}`` dicts, lists
of ranks, rows of n weights, rank-indexed (n,) and (n, n) tables, (n, k)
tables of ranks, tables of peers), the window ops, every optax transformation
and the asynchronous trainers, as per-agent functions of stacked arguments.
``tests/runtime/test_one_program_mpi.py`` runs them on MPI processes and
``tests/mesh/test_mesh_mpi.py`` on a device mesh, each against the vmapped
simulation, to 1e-12 in float64 (x64 must be on).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxfog as jf
import jaxfog.asynchrony as jfa
import jaxfog.optax as jfo
import jaxfog.topology as T
from optax_cases import Problem, all_cases, compressed_cases, train
from window_cases import random_sequence


class Case(NamedTuple):
    name: str
    fn: Callable  # per agent
    args: tuple  # stacked over the agents
    jit: bool = True  # jit it where it runs for one agent (MPI)
    delays: Any = None  # simulate(delays=)
    #: Asynchronous trainers: (make, loss, compute, iterations), for a backend
    #: that replays the simulated order of events itself (MPI).
    trainer: Any = None


def cases(n: int) -> list[Case]:
    """The cases for n agents (n = 4: the ranks pair up, two per machine)."""
    expo = T.exponential(n)
    rng = np.random.default_rng(23)
    X = rng.standard_normal((n, 6))

    # -- ops, every argument form -----------------------------------------------------------
    edges = (expo.weights != 0) & ~np.eye(n, dtype=bool)
    dyn = ~np.eye(n, dtype=bool) & (rng.random((n, n)) < 0.5)  # off the topology
    dyn[0] = False  # rank 0 hears nobody, and
    dyn[1, 0] = dyn[2, 0] = True  # talks to 1 and 2
    S = np.where(edges, rng.uniform(0.1, 1.0, (n, n)), 0.0)  # src[i, j]
    S2 = np.where(dyn, rng.uniform(0.1, 1.0, (n, n)), 0.0)
    D2 = np.where(dyn.T, rng.uniform(0.5, 2.0, (n, n)), 0.0)  # dst[j, i]
    SW = rng.uniform(0.1, 1.0, n)
    # (n, k) tables of sources: irregular, padded with the agent itself, any order.
    k = max(1, dyn.sum(1).max())
    sources = np.array([list(np.flatnonzero(dyn[i]))[::-1] + [i] * (k - dyn[i].sum())
                        for i in range(n)], np.int32)
    schedule = T.one_peer_exponential(n)
    nar, hier = jf.neighbor_allreduce, jf.hierarchical_neighbor_allreduce
    ops = [
        ("static", nar),
        ("self number, src table (pull)", lambda x: nar(x, self_weight=0.3, src_weights=S)),
        ("self table, src table off the graph",
         lambda x: nar(x, self_weight=SW, src_weights=S2)),
        ("self table, dst table (push)", lambda x: nar(x, self_weight=SW, dst_weights=D2)),
        ("push-pull tables",
         lambda x: nar(x, self_weight=SW, src_weights=S2, dst_weights=D2)),
        ("empty dict and list", lambda x: nar(x, self_weight=0.7, src_weights={},
                                              dst_weights=[])),
        ("schedule, traced step", lambda x: jax.lax.fori_loop(
            0, 3, lambda t, c: nar(c, topology=schedule, step=t), x)),
        ("neighbor_allgather default", jf.neighbor_allgather),
        ("neighbor_allgather (n, k) table", lambda x: jf.neighbor_allgather(
            x, src_ranks=sources)),
        ("pair_gossip table of peers",
         lambda x: jf.pair_gossip(x, np.array([1, 0, 3, 2]))),
        ("pair_gossip peer from the rank", lambda x: jf.pair_gossip(x, jf.rank() ^ 1)),
        ("hierarchical", hier),
        ("hierarchical machine tables", lambda x: hier(
            x, self_weight=np.array([0.6, 0.3]),
            src_machine_weights=np.array([[0.0, 0.4], [0.7, 0.0]]))),
        ("hierarchical empty dict and list", lambda x: hier(
            x, self_weight=1.0, src_machine_weights={}, dst_machine_weights=[])),
        ("allreduce", jf.allreduce),
        ("allreduce sum", lambda x: jf.allreduce(x, op="sum")),
        ("broadcast", lambda x: jf.broadcast(x, root=n - 1)),
        ("allgather", jf.allgather),
    ]
    cases = [Case(name, fn, (X,)) for name, fn in ops]
    # Rows of n weights picked with the rank: traced on simulated agents and on
    # a mesh, concrete on MPI when run eagerly (not jitted).
    cases.append(Case("rows of n weights", lambda x: nar(
        x, self_weight=jnp.asarray(SW)[jf.rank()], src_weights=jnp.asarray(S2)[jf.rank()],
        dst_weights=jnp.asarray(D2)[jf.rank()]), (X,), jit=False))
    # -- windows: tables of weights and of sources --------------------------------------------
    full = ~np.eye(n, dtype=bool)
    sequence = random_sequence(5, full, 8)
    window_sources = np.array([[j for j in range(n) if j != i] for i in range(n)])

    def windows(x):
        jf.win_create(x, "one", with_weight=True, src_ranks=window_sources)
        outs = []
        for op, M, a, reset in sequence:
            if op == "get":
                jf.win_get("one", src_weights=M)
            elif op == "update":
                x = jf.win_update(x, "one", self_weight=a, src_weights=M, reset=reset)
            else:
                put = jf.win_accumulate if op == "accumulate" else jf.win_put
                x = put(x, "one", self_weight=a, dst_weights=M)
            jf.barrier()  # every op has landed before anyone reads
            versions = jf.win_version("one")
            jf.barrier()
            outs.append(jnp.concatenate([
                x, jnp.asarray([versions.get(j, 0) for j in range(n)], x.dtype),
                jnp.reshape(jf.win_weight("one"), (1,)).astype(x.dtype)]))
        jf.win_free("one")
        return jnp.stack(outs)

    cases.append(Case("windows", windows, (X,), jit=False))

    # -- every optax transformation --------------------------------------------------------------
    A, B = rng.standard_normal((n, 5, 3)), rng.standard_normal((n, 5))
    problem = Problem("least squares", A, B, 0.1, np.zeros(3),
                      float(max(np.linalg.eigvalsh(a.T @ a)[-1] for a in A)) + 0.1)
    optimizers = [(name, opt) for name, opt, _ in all_cases(n, problem)]
    optimizers += [(name, opt) for name, opt, _, _ in compressed_cases(n, problem)
                   if "top_k" in name or "sign" in name]
    cases += [Case(name, train(optimizer, problem, n, 2), (A, B))
              for name, optimizer in optimizers]

    # -- the trainers of jaxfog.asynchrony ---------------------------------------------------
    loss = problem.loss(n)
    lr = 0.5 / problem.lipschitz
    iterations = 3
    # Distinct compute times whose sums over a few steps never tie, so that one
    # step ends at a time and MPI can replay the simulated order exactly.
    compute = 1.0 + np.array([0.0, 0.0137, 0.0291, 0.0419])[:n]
    trainers = [
        ("from_optax(atc)", lambda: jfa.from_optax(jfo.atc(optax.sgd(lr)))),
        ("push_sum", lambda: jfa.async_push_sum(optax.sgd(lr))),
        ("adpsgd", lambda: jfa.adpsgd(optax.sgd(lr))),
        ("hop", lambda: jfa.hop(optax.sgd(lr))),
        ("hop, no staleness bound, one backup, no skips",
         lambda: jfa.hop(optax.sgd(lr), staleness=None, backups=1, skip=False)),
    ]
    for name, make in trainers:
        def simulated(a, b, make=make):
            trainer = make()
            state = trainer.init(jnp.zeros(3))
            state = jfa.run(trainer, state, lambda x, k: jax.grad(loss)(x, a, b), iterations)
            out = trainer.params(state), state.iteration
            trainer.free()
            return out

        asynchronous = name != "from_optax(atc)"
        cases.append(Case(name, simulated, (A, B), jit=False,
                          delays=jf.Delays(compute=compute) if asynchronous else None,
                          trainer=(make, loss, compute, iterations) if asynchronous else None))
    return cases
