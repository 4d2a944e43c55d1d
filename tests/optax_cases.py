"""Heterogeneous decentralized problems and optimizer cases for jaxfog.optax,
shared by the simulated tests and the MPI-vs-simulation tests.

Both problems take scikit-learn's rows sorted by target (so every agent sees
a different slice: heterogeneous data), deal them to n agents in contiguous
blocks zero-padded to one length (a zero row changes no local loss), and add a
ridge term of total weight ``ridge`` split evenly over the agents:

* least squares (diabetes, the examples' problem from examples/_regression_data.py):
  f_i(x) = 1/2 ||A_i x - b_i||^2 + ridge/(2n) ||x||^2
* logistic regression (breast cancer, labels y in {-1, 1}, padding y = 0):
  f_i(x) = sum_k log(1 + exp(-y_k a_k.x)) + ridge/(2n) ||x||^2

``optimum`` is the centralized minimiser of sum_i f_i, computed in numpy
(a linear solve, or Newton's method to machine precision).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

import jaxfog.topology as T

#: The examples' data of the regression problems.
REGRESSION_DATA = Path(__file__).resolve().parents[1] / "examples" / "_regression_data.py"


class Problem(NamedTuple):
    name: str
    A: np.ndarray          # (n, rows, d)
    B: np.ndarray          # (n, rows)
    ridge: float
    optimum: np.ndarray    # (d,)
    lipschitz: float       # max_i L_i

    def loss(self, n: int) -> Callable:
        """The per-agent loss f_i(x; a, b) in jax."""
        import jax.numpy as jnp

        ridge = self.ridge / n
        if self.name == "least squares":
            return lambda x, a, b: (0.5 * jnp.sum((a @ x - b) ** 2)
                                    + 0.5 * ridge * jnp.sum(x ** 2))
        return lambda x, a, b: (jnp.sum(jnp.logaddexp(0.0, -b * (a @ x)) * (b != 0))
                                + 0.5 * ridge * jnp.sum(x ** 2))


def _standardize(features: np.ndarray) -> np.ndarray:
    features = (features - features.mean(0)) / features.std(0)
    return np.hstack([features, np.ones((len(features), 1))])


def _deal(a: np.ndarray, b: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(b, kind="stable")
    a, b = a[order], b[order]
    rows = -(-len(b) // n)
    A, B = np.zeros((n, rows, a.shape[1])), np.zeros((n, rows))
    for i, block in enumerate(np.array_split(np.arange(len(b)), n)):
        A[i, :len(block)], B[i, :len(block)] = a[block], b[block]
    return A, B


def least_squares(n: int) -> Problem:
    """The examples' ridge regression (examples/_regression_data.py), stacked."""
    spec = importlib.util.spec_from_file_location("_regression_data", REGRESSION_DATA)
    assert spec is not None and spec.loader is not None
    data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(data)

    blocks = [data.load(r, n) for r in range(n)]
    A, B = np.stack([a for a, _, _ in blocks]), np.stack([b for _, b, _ in blocks])
    return Problem("least squares", A, B, data.RIDGE, blocks[0][2], data.smoothness(n))


def logistic(n: int, ridge: float = 30.0) -> Problem:
    from sklearn.datasets import load_breast_cancer

    features, labels = load_breast_cancer(return_X_y=True)
    a, y = _standardize(features), 2.0 * labels - 1.0
    x = np.zeros(a.shape[1])
    for _ in range(50):  # Newton's method; quadratic convergence from 0
        p = 1.0 / (1.0 + np.exp(y * (a @ x)))  # sigma(-y a.x)
        grad = -a.T @ (y * p) + ridge * x
        hess = a.T @ (a * (p * (1 - p))[:, None]) + ridge * np.eye(len(x))
        x -= np.linalg.solve(hess, grad)
    assert np.linalg.norm(grad) < 1e-10
    A, B = _deal(a, y, n)
    lipschitz = max(0.25 * np.linalg.eigvalsh(z.T @ z)[-1] for z in A) + ridge / n
    return Problem("logistic", A, B, ridge, x, float(lipschitz))


def local_gradients(problem: Problem, X: np.ndarray) -> np.ndarray:
    """Every agent's gradient of its least-squares loss at its row of X (n, d),
    in numpy: the references' side of ``Problem.loss``."""
    n = X.shape[0]
    return np.stack([a.T @ (a @ x - b) + problem.ridge / n * x
                     for a, b, x in zip(problem.A, problem.B, X)])


class HeavyBall:
    """optax.sgd(lr, momentum, nesterov) in numpy, on an array or the rows of
    X: each call takes a gradient and returns the update."""

    def __init__(self, lr, momentum=0.0, nesterov=False):
        self.lr, self.m, self.nesterov, self.trace = lr, momentum, nesterov, 0.0

    def __call__(self, g):
        self.trace = g + self.m * self.trace
        return -self.lr * (g + self.m * self.trace if self.nesterov else self.trace)


def train(optimizer, problem: Problem, n: int, steps: int, *, every_step: bool = False
          ) -> Callable:
    """Per-agent training: ``fn(a, b) -> x after steps`` and the optimizer's
    ``finish`` where it has one (with ``every_step``, the iterate after each
    step, ``(steps, d)``), on any backend."""
    import jax
    import jax.numpy as jnp
    import optax

    loss = problem.loss(n)

    def agent(a, b):
        x0 = jnp.zeros(problem.A.shape[-1], a.dtype)

        def step(carry, _):
            x, state = carry
            updates, state = optimizer.update(jax.grad(loss)(x, a, b), state, x)
            x = optax.apply_updates(x, updates)
            return (x, state), x if every_step else None

        (x, state), path = jax.lax.scan(step, (x0, optimizer.init(x0)), None, length=steps)
        if every_step:
            return path
        if hasattr(optimizer, "finish"):  # the exchanges still in flight, merged
            updates, _ = optimizer.finish(state, x)
            x = optax.apply_updates(x, updates)
        return x

    return agent


def exact_cases(n: int, problem: Problem):
    """(name, optimizer, topology for simulate, steps) that reach the optimum
    to 1e-8 relative error in float64."""
    import optax

    import jaxfog.optax as jfo

    lr = 1.0 / problem.lipschitz
    ring, expo = T.ring(n), T.exponential(n)  # expo is directed (non-symmetric)
    long = 2 if problem.name == "logistic" else 1
    yield "exact_diffusion", jfo.exact_diffusion(lr, topology=ring), ring, 2500 * long
    yield "gradient_tracking", jfo.gradient_tracking(lr / 2, topology=ring), ring, 3000 * long
    yield "gradient_allreduce", jfo.gradient_allreduce(optax.sgd(lr)), ring, 1500 * long
    yield "push_diging", jfo.push_diging(lr / 4, topology=expo), expo, 6000 * long


def all_cases(n: int, problem: Problem):
    """Every transformation, a few steps each: for iterate agreement."""
    import optax

    import jaxfog.optax as jfo

    lr = 0.5 / problem.lipschitz
    expo, schedule = T.exponential(n), T.one_peer_exponential(n)
    yield "atc", jfo.atc(optax.sgd(lr)), expo
    yield "atc one-peer schedule", jfo.atc(optax.sgd(lr), topology=schedule), expo
    yield "atc global_every=3", jfo.atc(optax.sgd(lr, momentum=0.5), global_every=3), expo
    yield "awc", jfo.awc(optax.adam(1e-2)), expo
    yield "awc allreduce", jfo.awc(optax.sgd(lr), communication="allreduce"), expo
    yield ("atc delay=1 one-peer schedule", jfo.atc(optax.sgd(lr), topology=schedule, delay=1),
           expo)
    yield ("awc delay=1 allreduce", jfo.awc(optax.sgd(lr), communication="allreduce", delay=1),
           expo)
    yield "gradient_allreduce", jfo.gradient_allreduce(optax.sgd(lr)), expo
    yield "gradient_tracking", jfo.gradient_tracking(lr, topology=schedule), expo
    yield ("gradient_tracking adam", jfo.gradient_tracking(optax.adam(1e-2), topology=schedule),
           expo)
    yield "exact_diffusion", jfo.exact_diffusion(lr), expo
    yield "push_sum", jfo.push_sum(optax.sgd(lr)), expo
    yield "push_diging", jfo.push_diging(lr / 2, topology=schedule), expo
    # Rounds of 2 steps: a sync at every second step (the cases run 2 steps and more).
    yield ("local_sgd gossip", jfo.local_sgd(optax.sgd(lr, momentum=0.5), every=2,
                                             communication="gossip"), expo)
    yield "diloco", jfo.diloco(optax.sgd(lr), every=2), expo
    # One fragment (the parameters are one leaf), its exchange finished a step later.
    yield ("streaming_diloco delay=1", jfo.streaming_diloco(optax.sgd(lr), every=2, fragments=1,
                                                            delay=1), expo)
    yield "noloco", jfo.noloco(optax.sgd(lr), every=2, gamma=0.5), expo


def directed_graph(n: int, rng: np.random.Generator) -> T.Topology:
    """A random directed, non-regular, strongly connected graph (a ring of
    edges i-1 -> i plus random ones), row-stochastic: push-sum's test graph."""
    edges = (rng.random((n, n)) < 0.4).astype(float)
    for i in range(n):
        edges[i, (i - 1) % n] = 1.0
    np.fill_diagonal(edges, 1.0)
    return T.from_weights(edges / edges.sum(1, keepdims=True))


def compressed_cases(n: int, problem: Problem):
    """(name, optimizer, compressor, payloads per message) for every compressed
    transformation, on the current topology: for MPI/simulation agreement and
    byte counts (BEER sends two compressed quantities in one message)."""
    import optax

    import jaxfog.compress as C
    import jaxfog.optax as jfo

    lr = 0.3 / problem.lipschitz
    for c in (C.identity(), C.top_k(0.1), C.rand_k(0.2), C.qsgd(7, unbiased=False), C.qsgd(2),
              C.sign()):
        yield f"choco {c.name}", jfo.choco(optax.sgd(lr), compressor=c, gamma=0.3), c, 1
    c = C.top_k(0.2)
    yield "beer top_k", jfo.beer(lr, compressor=c, gamma=0.5), c, 2
    c = C.sign()
    yield ("gradient_allreduce EF sign",
           jfo.gradient_allreduce(optax.sgd(lr), compressor=c, groups=1), c, 1)
    c = C.top_k(0.3)
    yield "awc EF top_k", jfo.awc(optax.sgd(lr), compressor=c, gamma=0.5), c, 1
    # NoLoCo's public copies, a round every step over the current topology's links.
    yield ("noloco top_k", jfo.noloco(optax.sgd(lr), every=1, communication="neighbor",
                                      compressor=c), c, 1)
