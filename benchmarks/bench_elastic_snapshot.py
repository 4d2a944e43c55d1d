"""What ``jaxfog.elastic.State``'s snapshots cost a training step.

    jaxfog run -np 2 python benchmarks/bench_elastic_snapshot.py [--rounds 5]

Each rank trains an MLP (``--width``, 2 hidden layers) with ``atc`` around
Adam on random data, with ``jaxfog.jit``; the same loop runs plain (no
snapshots) and through ``State.steps`` with a snapshot every ``k`` steps (the
default, 50, and 10), rounds interleaved. A snapshot copies the parameters
and Adam's two moments to the host (the loop waits for that step) and a
background thread writes them. Rank 0 prints the table and writes
``benchmarks/results/elastic_snapshot_2ranks.md``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxfog as jf
import jaxfog.elastic as je
import jaxfog.optax as jfo
from jaxfog import _machine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    jf.init()
    sizes = [784, args.width, args.width, 10]
    key = jax.random.key(jf.rank())
    params = {f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (a, b), jnp.float32)
              / np.sqrt(a) for i, (a, b) in enumerate(zip(sizes, sizes[1:]))}
    optimizer = jfo.atc(optax.adam(1e-3))
    x = jax.random.normal(key, (64, 784), jnp.float32)
    y = jax.random.randint(key, (64,), 0, 10)

    def loss(p):
        h = x
        for i in range(len(sizes) - 1):
            h = h @ p[f"w{i}"]
            h = jax.nn.relu(h) if i < len(sizes) - 2 else h
        return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

    @jf.jit
    def step(p, s):
        updates, s = optimizer.update(jax.grad(loss)(p), s, p)
        return optax.apply_updates(p, updates), s

    p, s = step(params, optimizer.init(params))  # compile
    jax.block_until_ready(p)
    directory = Path(tempfile.mkdtemp(prefix="jaxfog-snap-"))
    if jf.size() > 1:
        directory = Path(jf.runtime.communicator().bcast(str(directory), root=0))

    def plain():
        q, t = p, s
        for _ in range(args.steps):
            q, t = step(q, t)
        jax.block_until_ready(q)

    def snapshots(every):
        def run():
            shutil.rmtree(directory / "run", ignore_errors=True)
            state = je.State(params=p, opt_state=s, every=every, directory=directory / "run")
            for _ in state.steps(args.steps):
                state.params, state.opt_state = step(state.params, state.opt_state)
            jax.block_until_ready(state.params)
        return run

    cases = {"plain loop": plain, "State, every=50 (default)": snapshots(50),
             "State, every=10": snapshots(10)}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, case in cases.items():
            jf.barrier()
            started = time.perf_counter()
            case()
            jf.barrier()
            times[name].append((time.perf_counter() - started) / args.steps * 1e3)
    if jf.rank() == 0:
        state_bytes = sum(a.nbytes for a in jax.tree.leaves((p, s)))
        base = statistics.median(times["plain loop"])
        lines = ["# Snapshots of jaxfog.elastic.State: cost per step", "",
                 f"Machine: {_machine.cpu()}; {time.strftime('%Y-%m-%d')}; {jf.size()} MPI "
                 f"ranks (MPICH), jax {jax.__version__}.", "",
                 f"MLP {sizes}, atc around Adam, batch 64, `jaxfog.jit`; a snapshot is "
                 f"{state_bytes / 2**20:.1f} MiB a rank (parameters and Adam's moments). "
                 f"{args.steps} steps a run, {args.rounds} rounds interleaved; ms per step.",
                 "", "| loop | median | min | overhead (median) |", "|---|---:|---:|---:|"]
        for name, values in times.items():
            median = statistics.median(values)
            lines.append(f"| {name} | {median:.2f} | {min(values):.2f} | "
                         f"{(median / base - 1) * 100:+.1f}% |")
        text = "\n".join(lines) + "\n"
        print(text)
        out = Path(__file__).resolve().parent / "results" / f"elastic_snapshot_{jf.size()}ranks.md"
        out.write_text(text)
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
