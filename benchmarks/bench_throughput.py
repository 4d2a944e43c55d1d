"""Steps per second of each training method, BlueFog's throughput table (issue 43.4).

Run with ``jaxfog run -np N python benchmarks/bench_throughput.py [--model digits|lm]``;
on the one-machine cluster (root), e.g. 4 hosts on 100 Mbit/s links::

    sudo python scripts/netns_cluster.py --hosts 4 --rate 100mbit -- jaxfog run -np 4 \\
        --hostfile {hostfile} python benchmarks/bench_throughput.py \\
        --label digits_cluster_100mbit \\
        --network "4 hosts (network namespaces), 100 Mbit/s links"

Every rank trains the same model on its own data with one method at a time:
gradient allreduce (the baseline), atc and awc on the exponential graph and
the one-peer schedule, their delayed forms (``delay=1``: the exchange waited
for a step later, BlueFog's nonblocking Listing 5), atc with one exchange per
layer (``fused=False``), DiLoCo and Streaming DiLoCo (H = 10). A method's
step is one jitted call; the time is the slowest rank's for ``--steps``
consecutive steps after ``--warmup`` (compilation excluded), interleaved over
``--rounds`` rounds (each round runs every method once), median over rounds.
Rank 0 prints the table (steps per second and the speed-up over allreduce)
and writes ``benchmarks/results/throughput_<model>_<N>ranks.{md,json}``.

Models: ``digits``, examples/train_digits.py's MLP (``--hidden``, default 512:
1.2 MB of parameters) on its label-split slices; ``lm``, examples/train_lm.py's
transformer at ``--size`` (default ``default``) on its byte windows.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from _examples import example  # beside this script
import jaxfog as jf

HERE = Path(__file__).resolve().parent

jf.init()
from mpi4py import MPI  # noqa: E402  (after init: jaxfog picks the MPI library)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import jaxfog.optax as jfo  # noqa: E402
import jaxfog.topology as T  # noqa: E402
from jaxfog._machine import cpu  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
RESULTS = HERE / "results"


def methods(inner) -> dict:
    """label -> optimizer; ``inner()`` makes a fresh local optimizer."""
    expo, peer = T.exponential(SIZE), T.one_peer_exponential(SIZE)
    return {
        "allreduce": jfo.gradient_allreduce(inner()),
        "atc exponential": jfo.atc(inner(), topology=expo),
        "awc exponential": jfo.awc(inner(), topology=expo),
        "atc one-peer": jfo.atc(inner(), topology=peer),
        "awc one-peer": jfo.awc(inner(), topology=peer),
        "atc one-peer delay=1": jfo.atc(inner(), topology=peer, delay=1),
        "awc one-peer delay=1": jfo.awc(inner(), topology=peer, delay=1),
        "atc one-peer per layer": jfo.atc(inner(), topology=peer, fused=False),
        "diloco H=10": jfo.diloco(inner(), every=10),
        "streaming diloco H=10": jfo.streaming_diloco(inner(), every=10, fragments=2, delay=1),
    }


def digits_problem(args):
    """(params, loss(params, k), inner()) for the digits MLP."""
    td = example("train_digits")

    shards, _ = td.load(SIZE)
    x, y = (jnp.asarray(a) for a in shards[RANK])
    model = td.MLP(args.hidden)
    params = model.init(jax.random.key(0), x[:1])

    def loss(params, k):
        take = jax.random.randint(jax.random.fold_in(jax.random.key(RANK), k), (args.batch,),
                                  0, x.shape[0])
        logits = model.apply(params, x[take])
        return optax.softmax_cross_entropy_with_integer_labels(logits, y[take]).mean()

    return params, loss, lambda: optax.sgd(0.05, momentum=0.9)


def lm_problem(args):
    """(params, loss(params, k), inner()) for the language model."""
    from flax import nnx

    lm = example("train_lm")

    size = lm.SIZES[args.size]
    data = lm.corpus(SIZE, size, data_mb=size.data_mb, iid=False, seed=0)
    stream = jnp.asarray(data.streams[RANK])
    graphdef, params = nnx.split(lm.make_model(size, 0), nnx.Param)

    def loss(params, k):
        windows = lm.sample(stream, lm.batch_key(0, RANK, k), size.batch, size.context)
        return lm.loss_nats(lm.computed_in(graphdef, params, jnp.float32), windows)

    return params, loss, lambda: optax.adamw(1e-3)


def steps_per_second(params, loss, optimizer, steps: int, warmup: int, rounds: int) -> list:
    """The slowest rank's steps per second over ``steps`` steps, per round."""
    @jax.jit
    def step(params, state, k):
        grads = jax.grad(loss)(params, k)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = optimizer.init(params)
    compiled = step.lower(params, state, 0).compile()
    for k in range(warmup):
        params, state = compiled(params, state, k)
    jax.block_until_ready(params)
    rates = []
    for r in range(rounds):
        COMM.Barrier()
        began = time.perf_counter()
        for k in range(steps):
            params, state = compiled(params, state, warmup + r * steps + k)
        jax.block_until_ready(params)
        slowest = COMM.allreduce(time.perf_counter() - began, op=MPI.MAX)
        rates.append(steps / slowest)
    if hasattr(optimizer, "finish"):  # the exchanges a delayed method keeps in flight
        jax.block_until_ready(jax.jit(optimizer.finish)(state, params))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("digits", "lm"), default="digits")
    parser.add_argument("--hidden", type=int, default=512, help="digits MLP width")
    parser.add_argument("--batch", type=int, default=32, help="digits minibatch")
    parser.add_argument("--size", default="default", help="language model size")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", default=None, help="comma-separated labels (default: all)")
    parser.add_argument("--label", default=None, help="results file suffix")
    parser.add_argument("--network", default=None,
                        help="where the ranks ran, for the table's text (e.g. the "
                             "one-machine cluster's hosts and link rate)")
    args = parser.parse_args()
    params, loss, inner = (digits_problem if args.model == "digits" else lm_problem)(args)
    table = methods(inner)
    if args.methods:
        table = {label: table[label] for label in args.methods.split(",")}
    megabytes = sum(v.nbytes for v in jax.tree.leaves(params)) / 1e6
    rates = {label: [] for label in table}
    for _ in range(args.rounds):  # interleaved: a round runs every method once
        for label, optimizer in table.items():
            rates[label] += steps_per_second(params, loss, optimizer, args.steps, args.warmup, 1)
    if RANK != 0:
        return
    median = {label: float(np.median(r)) for label, r in rates.items()}
    base = median.get("allreduce")
    model = (f"digits MLP, {args.hidden} hidden units" if args.model == "digits"
             else f"language model, size {args.size}")
    lines = [f"# Steps per second, {model} ({megabytes:.2f} MB of parameters), {SIZE} ranks",
             "", f"Machine: {cpu()}; jax {jax.__version__}."
             + (f" Ranks: {args.network}." if args.network else "")
             + " The slowest rank's steps per second "
             f"over {args.steps} consecutive jitted steps (compilation and {args.warmup} warm-up "
             f"steps excluded), median of {args.rounds} interleaved rounds.", "",
             "| method | steps/s | speed-up over allreduce |", "|---|---:|---:|"]
    for label, rate in median.items():
        speedup = f"{rate / base:.2f}x" if base else "-"
        lines.append(f"| {label} | {rate:.1f} | {speedup} |")
    text = "\n".join(lines)
    print(text)
    label = args.label or f"{args.model}_{SIZE}ranks"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"throughput_{label}.md").write_text(text + "\n")
    (RESULTS / f"throughput_{label}.json").write_text(json.dumps(
        {"ranks": SIZE, "model": model, "megabytes": megabytes, "machine": cpu(),
         "steps_per_second": rates}, indent=1))


if __name__ == "__main__":
    main()
