"""Decentralized training of a Flax NNX CNN on scikit-learn's digits, split by label.

    jaxfog run -np 4 python examples/train_digits_nnx.py   # 4 MPI processes
    python examples/train_digits_nnx.py                     # 4 simulated agents

The Flax NNX form of ``train_digits.py``: a small CNN (``nnx.Module``) and an
``nnx.Optimizer`` whose transformation is ``jaxfog.optax.atc`` (adapt, then
combine with the neighbours), on the same heterogeneous split (agent 0 sees
mostly 0s, 1s and 2s).

The pattern is the fast one for NNX with ``jaxfog.jit``: split the model and
the optimizer once into a static ``graphdef`` and a ``state`` (a pytree of
arrays), and let the compiled step take the state, ``nnx.merge`` it, update in
place *inside*, and return ``nnx.state(...)``. The step is then an ordinary
function of arrays: one C++ dispatch per call, and the same code runs on MPI
processes (``jaxfog.jit``) and on simulated agents (``jaxfog.simulate``, the
state stacked along the agent axis). Passing the ``nnx.Module`` itself to a
jitted function and updating it in place would update a copy: ``jaxfog.jit``
raises a ``TypeError`` saying so, and ``nnx.jit`` carries the change back but
pays Python work on every call.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import train_digits  # the data split (examples/train_digits.py, beside this script)

import jaxfog as jf
import jaxfog.optax as jfo


class CNN(nnx.Module):
    """Two 3x3 convolutions on the 8x8 digits, then a dense layer."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(16, 16, (3, 3), strides=2, rngs=rngs)
        self.out = nnx.Linear(4 * 4 * 16, train_digits.CLASSES, rngs=rngs)

    def __call__(self, x):
        x = x.reshape(x.shape[0], 8, 8, 1)
        x = nnx.relu(self.conv2(nnx.relu(self.conv1(x))))
        return self.out(x.reshape(x.shape[0], -1))


def main(argv=None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--agents", type=int, default=4, help="without a launcher")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the model state here (npz)")
    args = parser.parse_args(argv)

    agents = jf.Agents(simulated=args.agents)
    shards, (x_test, y_test) = train_digits.load(agents.size)
    length = shards[0][0].shape[0]
    steps = length // args.batch
    schedule = optax.cosine_decay_schedule(args.lr, args.epochs * steps)

    # The same initial model on every agent; split once into graphdef + state.
    model = CNN(nnx.Rngs(args.seed))
    optimizer = nnx.Optimizer(model, jfo.atc(optax.sgd(schedule, momentum=0.9)),
                              wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    state = agents.data(lambda r: state)
    xs, ys = agents.data(lambda r: shards[r])

    def step(state, xs, ys, epoch, i):
        model, optimizer = nnx.merge(graphdef, state)
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(args.seed), jf.rank()),
                                 epoch)
        take = jax.lax.dynamic_slice(jax.random.permutation(key, length), [i * args.batch],
                                     [args.batch])

        def loss_fn(model):
            logits = model(xs[take])
            return optax.softmax_cross_entropy_with_integer_labels(logits, ys[take]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)  # in place, on the merged copy
        return nnx.state((model, optimizer)), loss

    def evaluate(state):
        model, _ = nnx.merge(graphdef, state)
        accuracy = lambda m: jnp.mean(jnp.argmax(m(x_test), -1) == y_test)  # noqa: E731
        own = accuracy(model)
        nnx.update(model, jf.allreduce(nnx.state(model, nnx.Param)))  # the averaged model
        return accuracy(model), own

    step = agents.map(step, in_axes=(0, 0, 0, None, None))
    evaluate = agents.map(evaluate)
    rows = []
    for epoch in range(args.epochs):
        losses = []
        for i in range(steps):
            state, loss = step(state, xs, ys, epoch, i)
            losses.append(loss)
        averaged, own = evaluate(state)
        rows.append({"epoch": epoch + 1, "loss": float(np.mean(agents.mean(jnp.stack(losses)))),
                     "test_accuracy": 100 * float(np.mean(averaged)),
                     "agents_accuracy": 100 * float(np.mean(agents.mean(own)))})
        if agents.is_root:
            print(f"epoch {epoch + 1:3d}  loss {rows[-1]['loss']:.4f}  test accuracy "
                  f"{rows[-1]['test_accuracy']:.1f}% (averaged model), "
                  f"{rows[-1]['agents_accuracy']:.1f}% (agents' own, mean)", flush=True)
    model, optimizer = nnx.merge(graphdef, jax.tree.map(lambda v: v[0], state)
                                 if agents.simulated else state)
    where = f"{agents.size} simulated agents" if agents.simulated else (
        f"{agents.size} MPI processes")
    if agents.is_root:
        print(f"{where}: {int(optimizer.step[...])} steps per agent, final test accuracy "
              f"{rows[-1]['test_accuracy']:.1f}%")
    params = agents.mean(nnx.state(nnx.merge(graphdef, state)[0], nnx.Param))  # collective
    if args.out and agents.is_root:
        os.makedirs(args.out, exist_ok=True)
        flat = {"/".join(map(str, path)): np.asarray(v) for path, v in
                jax.tree_util.tree_flatten_with_path(params)[0]}
        np.savez(os.path.join(args.out, "train_digits_nnx.npz"), **flat)
    return {"where": where, "rows": rows, "steps": int(optimizer.step[...])}


if __name__ == "__main__":
    main()
