"""A Flax NNX train step with jaxfog.optax.atc: three ways to compile it.

Run with ``jaxfog run -np 2 python benchmarks/bench_nnx.py``. The step is the
one of ``examples/train_digits_nnx.py`` (the CNN on a minibatch of 32 digits,
``nnx.Optimizer(model, jfo.atc(optax.sgd(0.05, momentum=0.9)))`` on the ring),
compiled as

* ``nnx.jit``: the in-place step on ``(model, optimizer)``; NNX splits the
  objects and writes the results back around every call, in Python;
* ``split/merge + jax.jit``: the state (``nnx.split`` once) in and out of a
  plain ``jax.jit`` (jaxfog's ordered effect: JAX's Python dispatch path);
* ``split/merge + jaxfog.jit``: the same function under ``jaxfog.jit`` (C++
  dispatch), the pattern docs/guide/flax.rst recommends.

Each column is the median over interleaved rounds of the slowest rank's time
for one blocking step. Rank 0 prints the table and writes
``benchmarks/results/nnx_step_{n}ranks.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jaxfog as jf
import jaxfog.topology as T

jf.init()
import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from _examples import example  # noqa: E402  (beside this script)
from bench_neighbor_allreduce import SIZE, machine, rounds  # noqa: E402
import jaxfog.optax as jfo  # noqa: E402

train_digits = example("train_digits")
CNN = example("train_digits_nnx").CNN

RESULTS = Path(__file__).resolve().parent / "results"
BATCH = 32


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    jf.set_topology(T.ring(SIZE))
    shards, _ = train_digits.load(SIZE)
    x, y = (jax.numpy.asarray(v[:BATCH]) for v in shards[jf.rank()])

    def loss_fn(model):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    def make():
        model = CNN(nnx.Rngs(0))
        return model, nnx.Optimizer(model, jfo.atc(optax.sgd(0.05, momentum=0.9)),
                                    wrt=nnx.Param)

    def in_place(model, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    model, optimizer = make()
    nnx_step = nnx.jit(in_place)
    graphdef, state = nnx.split(make())

    def functional(state):
        model, optimizer = nnx.merge(graphdef, state)
        loss = in_place(model, optimizer)
        return nnx.state((model, optimizer)), loss

    steps = {"split/merge + jax.jit": jax.jit(functional),
             "split/merge + jaxfog.jit": jf.jit(functional)}
    states = {name: state for name in steps}

    def run_nnx():
        nnx_step(model, optimizer).block_until_ready()

    def runner(name):
        def run():
            states[name], loss = steps[name](states[name])
            loss.block_until_ready()
        return run

    timed = rounds({"nnx.jit": run_nnx, **{name: runner(name) for name in steps}},
                   args.repeats)
    if jf.rank() != 0:
        return
    base = timed["split/merge + jaxfog.jit"]
    leaves = len(jax.tree.leaves(state))
    lines = [f"# Flax NNX step with jaxfog.optax.atc, {SIZE} ranks (ring)", "",
             f"Machine: {machine()}; flax {__import__('flax').__version__}.", "",
             f"The CNN of examples/train_digits_nnx.py, a minibatch of {BATCH}; the state "
             f"(model and optimizer) has {leaves} leaves. Median over interleaved rounds of "
             "the slowest rank's time for one blocking step.", "",
             "| compiled as | us / step | vs split/merge + jaxfog.jit |", "|---|---|---|"]
    lines += [f"| {name} | {us:.0f} | {us / base:.2f}x |" for name, us in timed.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"nnx_step_{SIZE}ranks.md").write_text(text)
    (RESULTS / f"nnx_step_{SIZE}ranks.json").write_text(json.dumps(
        {"machine": machine(), "leaves": leaves, "us_per_step": timed}, indent=1))


if __name__ == "__main__":
    main()
