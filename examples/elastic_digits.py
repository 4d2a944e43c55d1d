"""Elastic training of a Flax MLP on scikit-learn's digits (docs/guide/elastic.rst).

    jaxfog run -np 4 --max-restarts 3 python examples/elastic_digits.py   # MPI processes
    jaxfog run -np 4 --mpi-args="--with-ft ulfm" python examples/elastic_digits.py  # in place
    python examples/elastic_digits.py                                       # 4 simulated agents

The training loop is the optax guide's, with two changes: the state lives in a
``jaxfog.elastic.State``, and the loop runs over ``state.steps``. If a rank or
a host dies, ``jaxfog run`` relaunches the job on the hosts still reachable
and every rank resumes from its latest snapshot (or, on a new host, from a
neighbour's live copy); under Open MPI with ULFM, ``jaxfog.elastic.run``
instead goes on with the survivors in place, from the state in memory.
Everything that depends on the number of ranks (the topology, the optimizer,
the data shards) is rebuilt below for the new size.

Options: ``--method`` (atc, gradient_allreduce, gradient_tracking,
exact_diffusion, push_sum, choco, diloco, streaming_diloco, noloco, awc_delay),
``--steps``, ``--every`` (steps between snapshots), ``--out FILE.npz`` (rank 0,
or the simulation, writes the final parameters of every agent and the test
accuracy), ``--kill RANK:STEP:LIFE,...`` (that rank kills itself at that step
in that life of the job, 0 the first, counting launches and recoveries in
place: the tests of lost ranks), ``--join STEP[:HOST]`` (in place, under ULFM:
rank 0 asks at that step for one more rank, on that host, which joins at the
next snapshot step), ``--pace SECONDS`` (each step lasts at least
that long: a slower model, to watch a run or kill a host in it), ``--log FILE``
(rank 0 appends ``time step life accuracy`` at every snapshot step and at the
first step done after a resume or a join, its own model's test accuracy:
benchmarks/bench_elastic.py times runs with it).
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import jaxfog as jf
import jaxfog.compress as C
import jaxfog.elastic as je
import jaxfog.optax as jfo
import jaxfog.topology as T

BATCH = 32


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(nn.relu(nn.Dense(32)(x)))


def optimizer_for(method: str, n: int) -> optax.GradientTransformation:
    """The method, built for ``n`` agents (rebuilt at every relaunch)."""
    sgd = optax.sgd(0.1, momentum=0.9)
    return {
        "atc": lambda: jfo.atc(sgd, topology=T.one_peer_exponential(n)),
        "awc_delay": lambda: jfo.awc(sgd, topology=T.exponential(n), delay=1),
        "gradient_allreduce": lambda: jfo.gradient_allreduce(sgd),
        "gradient_tracking": lambda: jfo.gradient_tracking(0.1, topology=T.exponential(n)),
        "exact_diffusion": lambda: jfo.exact_diffusion(0.1, topology=T.exponential(n)),
        "push_sum": lambda: jfo.push_sum(sgd, topology=T.exponential(n)),
        "choco": lambda: jfo.choco(sgd, compressor=C.top_k(0.25), gamma=0.5,
                                   topology=T.ring(n)),
        "diloco": lambda: jfo.diloco(optax.adam(3e-3), every=5),
        "streaming_diloco": lambda: jfo.streaming_diloco(optax.adam(3e-3), every=6,
                                                         fragments=2, delay=1),
        "noloco": lambda: jfo.noloco(optax.adam(3e-3), every=5),
    }[method]()


def data(n: int):
    """Train rows split among ``n`` agents by label (heterogeneous), and a test set."""
    images, labels = load_digits(return_X_y=True)
    images = (images / 16.0).astype(np.float32)
    test = np.arange(len(labels)) % 5 == 0
    train_x, train_y = images[~test], labels[~test].astype(np.int32)
    order = np.argsort(train_y, kind="stable")
    per_agent = len(order) // n
    # Each agent's labels in a random order (sorted rows would give it batches of
    # one label after another, and gradient averaging over ~n labels at a time).
    shards = [np.random.default_rng(r).permutation(order[r * per_agent:(r + 1) * per_agent])
              for r in range(n)]
    return [(train_x[s], train_y[s]) for s in shards], (images[test], labels[test])


def batch(shard, step: int):
    """An agent's batch at ``step``: the next ``BATCH`` rows of its shard, in
    turn. The step's shapes are the same for any number of ranks, so that after
    a recovery in place the step compiled for the old size is found in JAX's
    compilation cache (where its program is the same: gradient allreduce,
    DiLoCo) instead of compiled again."""
    rows = (np.arange(BATCH) + step * BATCH) % len(shard[0])
    return shard[0][rows], shard[1][rows]


def main(simulated: int = 4, method: str = "atc", steps: int = 60, every: int = 10,
         out: str | None = None, kill: str | None = None, directory: str | None = None,
         pace: float = 0.0, log: str | None = None, join: str | None = None):
    agents = jf.Agents(simulated=simulated)
    n = agents.size
    optimizer = optimizer_for(method, n)
    model = MLP()
    # Jitted: one program, where eager Flax is dozens (each loaded again after a
    # recovery in place, when JAX's in-memory caches are emptied).
    params0 = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 64), jnp.float32))
    shards, (test_x, test_y) = data(n)
    accuracy_of = jax.jit(lambda p: (model.apply(p, test_x).argmax(-1) == test_y).mean())

    def loss_fn(params, x, y):
        logits = model.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    train_step = agents.map(train_step)
    params, opt_state = agents.map(lambda _: (params0, optimizer.init(params0)))(
        agents.data(lambda r: np.int32(r)))

    # The two changes for elastic training: the state, and its steps.
    state = je.State(params=params, opt_state=opt_state, every=every, directory=directory)
    launch = int(os.environ.get(je.RESTART_ENV, "0"))   # set by jaxfog run --max-restarts
    life = launch + len(je.recoveries())
    kills = {tuple(map(int, k.split(":")[::2])): int(k.split(":")[1])
             for k in (kill.split(",") if kill else [])}   # (rank, life) -> step
    join_step, _, join_host = (join or "").partition(":")
    for step in state.steps(steps):
        if join and not agents.simulated and agents.is_root and step == int(join_step):
            je.request_join(1, [join_host] if join_host else None)  # joins at the next snapshot
        if not agents.simulated and kills.get((jf.rank(), life)) == step:
            # The last snapshot on disk and the steps before this one done: where
            # the run resumes is known (at the snapshot, or in place at this step).
            state.wait()
            jax.block_until_ready(state.values)
            os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
        x, y = agents.data(lambda r: batch(shards[r], step))
        state.params, state.opt_state, loss = train_step(state.params, state.opt_state, x, y)
        if pace:
            jax.block_until_ready(loss)
            time.sleep(pace)
        if log and agents.is_root and (state.step % every == 0
                                       or step == state.resumed.step and (
                                           life or je.joins())):
            mine = jax.tree.map(lambda p: p[0], state.params) if agents.simulated else state.params
            hits = float(accuracy_of(mine))
            with open(log, "a") as f:
                f.write(f"{time.time():.3f} {state.step} {life} {hits:.4f}\n")

    everyone = agents.gather(state.params)  # every agent's parameters, stacked
    mean = jax.tree.map(lambda p: p.mean(0), everyone)
    accuracy = float(accuracy_of(mean))
    if agents.is_root:
        print(f"{method}: {n} agents, resumed at step {state.resumed.step}, "
              f"test accuracy {accuracy:.3f}")
        if out:
            np.savez(out, accuracy=accuracy, agents=n,
                     **{f"p{i}": np.asarray(leaf)
                        for i, leaf in enumerate(jax.tree.leaves(everyone))})
    return everyone, accuracy


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="atc")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--out")
    parser.add_argument("--kill")
    parser.add_argument("--directory")
    parser.add_argument("--pace", type=float, default=0.0)
    parser.add_argument("--log")
    parser.add_argument("--join")
    args = parser.parse_args()
    # In place under ULFM (a failed rank's survivors run main again, resumed),
    # else main once.
    je.run(lambda n: main(args.agents, args.method, args.steps, args.every, args.out,
                          args.kill, args.directory, args.pace, args.log, args.join),
           max_failures=3)
