"""A user's program, written from the docs alone (README, docs/guide/simulate.rst,
flax.rst, optax.rst, mesh.rst): a Flax linen MLP on scikit-learn's digits,
trained by decentralized optimizers from ``jaxfog.optax`` on ``jaxfog.Agents``.

    python user_digits_program.py OUT.npz [METHOD]                      # simulated agents
    jaxfog run -np 2 python user_digits_program.py OUT.npz [METHOD]     # MPI processes
    jaxfog run -np 2 python user_digits_program.py OUT.npz [METHOD] --mesh   # device mesh
    python user_digits_program.py OUT.npz [METHOD] --mesh    # this process's devices
    (--agents=N: N simulated agents instead of 2)

METHOD is atc (default), awc, gradient_tracking or exact_diffusion. Rank 0
(or the simulation) writes the per-step losses, the final parameters of every
agent, the accuracy of the averaged model and the parameters' dtypes to OUT.
"""

import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import jaxfog as jf
import jaxfog.optax as jfo
import jaxfog.topology as T

AGENTS, STEPS, BATCH = 2, 30, 32


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        return nn.Dense(10)(x)


def main(out, method="atc", mesh=False, simulated=AGENTS):
    agents = jf.Agents(simulated=simulated, topology=T.exponential, mesh=mesh or None)
    topology = T.exponential(agents.size)          # "agents.size with Agents" (optax.rst)
    optimizer = {
        "atc": lambda: jfo.atc(optax.sgd(0.1, momentum=0.9), topology=topology),
        "awc": lambda: jfo.awc(optax.sgd(0.1, momentum=0.9), topology=topology),
        "gradient_tracking": lambda: jfo.gradient_tracking(0.1, topology=topology),
        "exact_diffusion": lambda: jfo.exact_diffusion(0.1, topology=topology),
    }[method]()

    images, labels = load_digits(return_X_y=True)
    images = (images / 16.0).astype(np.float32)
    order = np.argsort(labels, kind="stable")        # heterogeneous: split by label
    images, labels = images[order], labels[order]
    per_agent = len(labels) // agents.size

    def shard(r):
        rows = r * per_agent + np.random.default_rng(r).permutation(per_agent)
        return images[rows], labels[rows].astype(np.int32)

    model = MLP()
    params0 = model.init(jax.random.key(0), jnp.zeros((1, 64), jnp.float32))

    def init(_):
        return params0, optimizer.init(params0)

    def loss_fn(params, x, y):
        logits = model.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(params, state, x, y, i):
        batch = (jnp.arange(BATCH) + i * BATCH) % x.shape[0]
        loss, grads = jax.value_and_grad(loss_fn)(params, x[batch], y[batch])
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    x, y = agents.data(shard)
    params, state = agents.map(init)(agents.data(lambda r: np.int32(r)))
    step = agents.map(step, in_axes=(0, 0, 0, 0, None))
    losses = []
    for i in range(STEPS):
        params, state, loss = step(params, state, x, y, jnp.int32(i))
        losses.append(float(agents.mean(loss)))

    averaged = agents.mean(params)
    every = agents.gather(params)
    if agents.is_root:
        xs, ys = images, labels
        accuracy = float(jnp.mean(jnp.argmax(model.apply(averaged, xs), -1) == ys))
        leaves = jax.tree_util.tree_leaves_with_path(every)
        np.savez(out, losses=np.array(losses), accuracy=accuracy, size=agents.size,
                 dtypes=np.array(sorted({str(np.asarray(v).dtype) for _, v in leaves})),
                 **{jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves})
        print(f"{method}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, accuracy {accuracy:.3f}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    agents = [int(a.split("=")[1]) for a in sys.argv if a.startswith("--agents=")]
    main(*args, mesh="--mesh" in sys.argv, simulated=(agents or [AGENTS])[0])
