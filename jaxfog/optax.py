"""Decentralized optimizers as optax transformations.

Each is an ``optax.GradientTransformationExtraArgs`` with a NamedTuple state,
pure and jittable, called as ``update(grads, state, params)`` (``params`` is
required), and runs unchanged on every backend: MPI processes (``jaxfog run``)
and simulated agents (``jaxfog.simulate``). In the equations, ``W`` is the
mixing matrix in jaxfog's convention (``x_i <- sum_j W[i, j] x_j``), ``u`` the
inner optimizer's updates, ``g`` the local gradient and ``a`` the learning rate.

``topology=`` takes a ``Topology``, a ``Schedule`` (the step counter lives in
the state, so a time-varying graph never retraces) or ``None``: the runtime's
current topology (or, in ``simulate``, the simulation's).

Where they stand in a chain: ``atc``, ``awc`` and ``push_sum`` wrap an inner
optax transformation (put clipping, weight decay, etc. inside it) and must be
the last element of a chain, since their updates move the parameters to
mixed values; ``gradient_allreduce`` averages the gradients before its inner
transformation; ``gradient_tracking``, ``exact_diffusion`` and ``push_diging``
take a learning rate and are used alone (or after gradient-only transforms
such as clipping).

Compile the train step with ``jaxfog.jit`` (a drop-in for ``jax.jit``): the
step then dispatches on JAX's C++ path, which matters for a state of hundreds
of leaves (plain ``jax.jit`` is correct but pays about 9 us per leaf per call)::

    @jaxfog.jit
    def step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxfog import runtime
from jaxfog import topology as T
from jaxfog.ops import allreduce, hierarchical_neighbor_allreduce, neighbor_allreduce

Tree = Any


def _need_params(name: str, params: Any) -> None:
    if params is None:
        raise ValueError(f"jaxfog.optax.{name}: update() needs params "
                         "(call update(grads, state, params))")


def _mix(tree: Tree, topology: Any, count: jax.Array) -> Tree:
    """One neighbor averaging step with W (static, runtime or scheduled: the
    step picks a Schedule's entry and is ignored by a static graph)."""
    return neighbor_allreduce(tree, topology=topology, step=count)


def _sub(a: Tree, b: Tree) -> Tree:
    return jax.tree.map(lambda x, y: x - y, a, b)


def _communicate(tree: Tree, topology: Any, count: jax.Array, communication: str,
                 global_every: int | None) -> Tree:
    mixers = {"neighbor": lambda t: _mix(t, topology, count),
              "allreduce": allreduce,
              "hierarchical": hierarchical_neighbor_allreduce,
              "none": lambda t: t}
    if communication not in mixers:
        raise ValueError(f"communication must be one of {sorted(mixers)}, got "
                         f"{communication!r}")
    mix = mixers[communication]
    if global_every is None:
        return mix(tree)
    # The step count is the same on every rank, so all take the same branch.
    return lax.cond(count % global_every == 0, allreduce, mix, tree)


def _check_global_every(global_every: int | None) -> None:
    if global_every is not None and (isinstance(global_every, bool) or
                                     not isinstance(global_every, int) or global_every < 1):
        raise ValueError(f"global_every must be a positive integer, got {global_every!r}")


# --- adapt-then-combine / adapt-with-combine -------------------------------


class DiffusionState(NamedTuple):
    """State of :func:`atc` and :func:`awc`."""

    inner: optax.OptState
    count: jax.Array


def atc(inner: optax.GradientTransformation, *, topology: Any = None,
        communication: str = "neighbor",
        global_every: int | None = None) -> optax.GradientTransformationExtraArgs:
    """Adapt then combine (diffusion): ``x+ = W (x + u)``.

    The inner updates are applied first, then the result is averaged with the
    neighbours (BlueFog paper, eq. (4)-(5)). ``communication`` may also be
    ``"allreduce"`` (global averaging), ``"hierarchical"`` (machine-level,
    ``hierarchical_neighbor_allreduce``) or ``"none"``; ``global_every=k``
    replaces the neighbour step by a global average every k steps (BlueFog
    paper, Listing 4). With a constant step size it converges to a
    neighbourhood of the optimum whose size shrinks with the step size.
    """
    _check_global_every(global_every)

    def init(params):
        return DiffusionState(inner.init(params), jnp.zeros([], jnp.int32))

    def update(grads, state, params=None, **extra):
        _need_params("atc", params)
        u, inner_state = inner.update(grads, state.inner, params, **extra)
        mixed = _communicate(optax.apply_updates(params, u), topology, state.count,
                             communication, global_every)
        return _sub(mixed, params), DiffusionState(inner_state, state.count + 1)

    return optax.GradientTransformationExtraArgs(init, update)


def awc(inner: optax.GradientTransformation, *, topology: Any = None,
        communication: str = "neighbor",
        global_every: int | None = None) -> optax.GradientTransformationExtraArgs:
    """Adapt with combine (decentralized gradient descent): ``x+ = W x + u``.

    The exchange of ``x`` does not depend on the gradient, so inside one
    jitted train step XLA is free to run it while the backward pass computes
    (BlueFog paper, section V-A). Same options as :func:`atc`.
    """
    _check_global_every(global_every)

    def init(params):
        return DiffusionState(inner.init(params), jnp.zeros([], jnp.int32))

    def update(grads, state, params=None, **extra):
        _need_params("awc", params)
        mixed = _communicate(params, topology, state.count, communication, global_every)
        u, inner_state = inner.update(grads, state.inner, params, **extra)
        return (jax.tree.map(lambda m, p, d: m - p + d, mixed, params, u),
                DiffusionState(inner_state, state.count + 1))

    return optax.GradientTransformationExtraArgs(init, update)


def gradient_allreduce(inner: optax.GradientTransformation
                       ) -> optax.GradientTransformationExtraArgs:
    """Horovod-style data parallelism: ``u = inner(mean over ranks of g)``.

    The baseline the decentralized methods are compared with.
    """
    def update(grads, state, params=None, **extra):
        return inner.update(allreduce(grads), state, params, **extra)

    return optax.GradientTransformationExtraArgs(inner.init, update)


# --- exact methods ------------------------------------------------------------


class TrackingState(NamedTuple):
    """State of :func:`gradient_tracking` and :func:`push_diging`."""

    tracker: Tree      # y, tracks the network's average gradient
    prev_grads: Tree   # g of the previous step
    count: jax.Array


def gradient_tracking(learning_rate: float, *, topology: Any = None
                      ) -> optax.GradientTransformationExtraArgs:
    """Gradient tracking in ATC form (Nedic et al., Qu & Li; DIGing):

        y_k     = W (y_{k-1} + g_k - g_{k-1})      (y_{-1} = g_{-1} = 0)
        x_{k+1} = W (x_k - a y_k)

    With a doubly stochastic W the tracker's average equals the average
    gradient, so with a constant step size the iterates converge to the exact
    optimum of sum_i f_i. Two neighbour exchanges per step.
    """
    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return TrackingState(zeros, zeros, jnp.zeros([], jnp.int32))

    def update(grads, state, params=None, **extra):
        _need_params("gradient_tracking", params)
        y = _mix(jax.tree.map(lambda y, g, h: y + g - h, state.tracker, grads,
                              state.prev_grads), topology, state.count)
        x = _mix(jax.tree.map(lambda p, t: p - learning_rate * t, params, y), topology,
                 state.count)
        return _sub(x, params), TrackingState(y, grads, state.count + 1)

    return optax.GradientTransformationExtraArgs(init, update)


class ExactDiffusionState(NamedTuple):
    """State of :func:`exact_diffusion`."""

    psi: Tree
    count: jax.Array


def exact_diffusion(learning_rate: float, *, topology: Any = None
                    ) -> optax.GradientTransformationExtraArgs:
    """Exact diffusion (Yuan, Ying, Zhao, Sayed 2019; BlueFog paper, appendix A):

        psi_k   = x_k - a g_k
        phi_k   = psi_k + x_k - psi_{k-1}          (psi_{-1} = x_0)
        x_{k+1} = ((I + W) / 2) phi_k

    Corrects the bias of diffusion: with a symmetric doubly stochastic W it
    converges to the exact optimum of sum_i f_i with a constant step size.
    """
    def init(params):
        return ExactDiffusionState(params, jnp.zeros([], jnp.int32))

    def update(grads, state, params=None, **extra):
        _need_params("exact_diffusion", params)
        first = state.count == 0
        psi = jax.tree.map(lambda x, g: x - learning_rate * g, params, grads)
        phi = jax.tree.map(lambda s, x, prev: s + x - jnp.where(first, x, prev), psi, params,
                           state.psi)
        mixed = _mix(phi, topology, state.count)
        x = jax.tree.map(lambda f, m: 0.5 * (f + m), phi, mixed)
        return _sub(x, params), ExactDiffusionState(psi, state.count + 1)

    return optax.GradientTransformationExtraArgs(init, update)


# --- push-sum (directed graphs) ---------------------------------------------


def column_stochastic(topology: T.Topology) -> T.Topology:
    """Push weights on ``topology``'s edges: sender j keeps and sends 1/(out_degree_j + 1)."""
    import numpy as np

    edges = (topology.weights != 0).astype(float)
    np.fill_diagonal(edges, 1.0)
    return T.from_weights(edges / edges.sum(axis=0, keepdims=True),
                          name=f"push({topology.name})", check_connected=False)


def _push_topology(topology: Any) -> Any:
    if topology is None:
        topology = runtime.load_topology()
    if isinstance(topology, T.Schedule):
        return T.Schedule([column_stochastic(t) for t in topology],
                          name=f"push({topology.name})")
    return column_stochastic(topology)


def _unit_weight() -> jax.Array:
    """The initial push-sum weight, in the widest float JAX allows."""
    return jnp.ones([], jax.dtypes.canonicalize_dtype(jnp.float64))


class PushSumState(NamedTuple):
    """State of :func:`push_sum`: the biased numerator x and the push-sum weight w."""

    inner: optax.OptState
    numerator: Tree
    weight: jax.Array
    count: jax.Array


def push_sum(inner: optax.GradientTransformation, *, topology: Any = None
             ) -> optax.GradientTransformationExtraArgs:
    """Push-sum / stochastic gradient push (Kempe et al.; Assran et al. 2019):

        (x, w)_{k+1} = P ((x_k + u_k), w_k),   z_{k+1} = x_{k+1} / w_{k+1}

    with P column-stochastic on the graph's edges (sender j weights
    1/(out_degree_j + 1)), so it works on directed and time-varying graphs.
    The push-sum weight w travels in the same message as the parameters. The
    params the user sees are the de-biased z = x / w; u comes from ``inner``
    evaluated at z.
    """
    def init(params):
        return PushSumState(inner.init(params), params, _unit_weight(),
                            jnp.zeros([], jnp.int32))

    def update(grads, state, params=None, **extra):
        _need_params("push_sum", params)
        u, inner_state = inner.update(grads, state.inner, params, **extra)
        numerator = optax.apply_updates(state.numerator, u)
        numerator, weight = _mix((numerator, state.weight), _push_topology(topology),
                                 state.count)
        z = jax.tree.map(lambda x: x / weight.astype(x.dtype), numerator)
        return _sub(z, params), PushSumState(inner_state, numerator, weight, state.count + 1)

    return optax.GradientTransformationExtraArgs(init, update)


class PushDigingState(NamedTuple):
    """State of :func:`push_diging`."""

    numerator: Tree
    weight: jax.Array
    tracker: Tree
    prev_grads: Tree
    count: jax.Array


def push_diging(learning_rate: float, *, topology: Any = None
                ) -> optax.GradientTransformationExtraArgs:
    """Push-DIGing: gradient tracking with push-sum for directed and
    time-varying graphs (Nedic, Olshevsky, Shi 2017; BlueFog paper, appendix B):

        y_k          = P (y_{k-1} + g_k - g_{k-1})
        (u, v)_{k+1} = P ((u_k - a y_k), v_k),     x_{k+1} = u_{k+1} / v_{k+1}

    with P column-stochastic (see :func:`push_sum`); g is evaluated at x.
    """
    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return PushDigingState(params, _unit_weight(), zeros, zeros,
                               jnp.zeros([], jnp.int32))

    def update(grads, state, params=None, **extra):
        _need_params("push_diging", params)
        push = _push_topology(topology)
        y = _mix(jax.tree.map(lambda y, g, h: y + g - h, state.tracker, grads,
                              state.prev_grads), push, state.count)
        stepped = jax.tree.map(lambda u, t: u - learning_rate * t, state.numerator, y)
        numerator, weight = _mix((stepped, state.weight), push, state.count)
        x = jax.tree.map(lambda u: u / weight.astype(u.dtype), numerator)
        return _sub(x, params), PushDigingState(numerator, weight, y, grads, state.count + 1)

    return optax.GradientTransformationExtraArgs(init, update)


__all__ = ["atc", "awc", "column_stochastic", "exact_diffusion", "gradient_allreduce",
           "gradient_tracking", "push_diging", "push_sum"]
