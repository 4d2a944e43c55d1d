r"""Exact methods: :func:`gradient_tracking` and :func:`exact_diffusion`
reach the optimum of :math:`\sum_i f_i` with a constant step size."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxfog import _validate as V
from jaxfog.optax._common import Tree, average, mixes_parameters, need_params, sub


class TrackingState(NamedTuple):
    """State of :func:`gradient_tracking`."""

    #: The tracker :math:`y^{k-1}` of the last step, which tracks the network's
    #: average gradient (zeros after ``init``).
    tracker: Tree
    #: The gradient :math:`g^{k-1}` of the last step (zeros after ``init``).
    prev_grads: Tree
    #: Number of ``update`` calls so far (an int32 scalar); picks a ``Schedule``'s entry.
    count: jax.Array  # type: ignore[assignment]  # optax's name; shadows tuple.count
    #: The inner transformation's state when ``gradient_tracking`` was given one
    #: (``optax.EmptyState()`` with a learning rate).
    inner: optax.OptState = optax.EmptyState()


@mixes_parameters
def gradient_tracking(learning_rate: float | optax.Schedule | optax.GradientTransformation,
                      *, topology: Any = None) -> optax.GradientTransformationExtraArgs:
    r"""Gradient tracking (DIGing) in adapt-then-combine form: exact at a constant step size.

    .. math::

        y_i^k &= \sum_j W_{ij} \left( y_j^{k-1} + g_j^k - g_j^{k-1} \right),
        \qquad y^{-1} = g^{-1} = 0, \\
        x_i^{k+1} &= \sum_j W_{ij} \left( x_j^k - a\, y_j^k \right),

    where :math:`x_i^k` are agent :math:`i`'s parameters, :math:`g_i^k` its
    local gradient at :math:`x_i^k`, :math:`y_i^k` the tracker, :math:`a` the
    learning rate and :math:`W` the mixing matrix of ``topology``
    (:math:`x_i \leftarrow \sum_j W_{ij} x_j`). With a doubly stochastic
    :math:`W` the trackers' average equals the agents' average gradient at
    every step, so with a constant step size the iterates converge to the
    exact optimum of :math:`\sum_i f_i`, not to a neighbourhood of it as
    :func:`atc` does. Two neighbour exchanges per step, one after the other.

    Given an optax transformation instead of a learning rate (momentum, Adam,
    a chain with clipping or weight decay), the tracker is what that
    transformation sees: every agent runs it on :math:`y_i^k`, an estimate of
    the network's average gradient, instead of on its own gradient,

    .. math::

        u_i^k = \mathrm{inner}\left( y_i^k \right), \qquad
        x_i^{k+1} = \sum_j W_{ij} \left( x_j^k + u_j^k \right),

    (``optax.sgd(a)`` gives the equations above exactly). This is the remedy
    for adaptive optimizers on agents whose data differ: under :func:`atc`
    each agent's Adam normalises its *own* gradient, and where the local
    gradients disagree the normalised steps do not average to zero at the
    optimum of :math:`\sum_i f_i` (near it Adam's step tends to
    :math:`-a\, \mathrm{sign}(g_i)` per coordinate, whatever the step
    size), so the agents settle elsewhere; fed the tracker, every agent's
    Adam normalises about the same average gradient, as under
    :func:`gradient_allreduce` (the idea of GTAdam, Carnevale et al. 2023).

    Both exchanges come after the local terms are added (adapt then
    combine), as in Xu et al.'s Aug-DGM; DIGing and Qu & Li's method add them
    after mixing: :math:`x_i^{k+1} = \sum_j W_{ij} x_j^k - a\, y_i^k` and
    :math:`y_i^k = \sum_j W_{ij} y_j^{k-1} + g_i^k - g_i^{k-1}`.

    Args:
      learning_rate: the step size :math:`a`: a number, or an optax schedule
        (a function of the step count :math:`k`); or an optax transformation
        (``inner`` above), whose ``update`` receives the tracker, its state,
        the unmixed ``params`` and the extra keyword arguments given to this
        ``update``.
      topology: :math:`W`: a doubly stochastic
        :class:`~jaxfog.topology.Topology`, a :class:`~jaxfog.topology.Schedule`
        of them (entry ``k % period`` at step ``k``, for both exchanges) or
        ``None``, the current topology (:func:`jaxfog.load_topology`; in
        :func:`jaxfog.simulate`, the simulation's).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`TrackingState` (the tracker, the last gradient, the step
      counter and the inner state). ``update(grads, state, params)`` needs
      ``params`` (``ValueError`` without) and returns :math:`x_i^{k+1} -
      x_i^k`, so it must be the last element of a chain. Use it alone or
      after gradient-only transformations such as clipping (which then clip
      the local gradients, before tracking).

    Example::

        optimizer = jaxfog.optax.gradient_tracking(
            0.05, topology=jaxfog.topology.exponential(jaxfog.size()))
        # Adam on the tracked gradient: for agents whose data differ
        optimizer = jaxfog.optax.gradient_tracking(
            optax.adam(1e-3), topology=jaxfog.topology.exponential(jaxfog.size()))
        opt_state = optimizer.init(params)
        # ... then the jitted train step of the module docstring

    References:
      Nedić, Olshevsky, Shi. *Achieving Geometric Convergence for Distributed
      Optimization over Time-Varying Graphs*. SIAM Journal on Optimization,
      2017.

      Qu, Li. *Harnessing Smoothness to Accelerate Distributed Optimization*.
      IEEE Transactions on Control of Network Systems, 2018.

      Xu, Zhu, Soh, Xie. *Augmented Distributed Gradient Methods for
      Multi-Agent Optimization Under Uncoordinated Constant Stepsizes*. IEEE
      Conference on Decision and Control (CDC), 2015.

      Carnevale, Farina, Notarnicola, Notarstefano. *GTAdam: Gradient Tracking
      with Adaptive Momentum for Distributed Online Optimization*. IEEE
      Transactions on Control of Network Systems, 2023.
    """
    V.topology("jaxfog.optax.gradient_tracking", topology)
    if isinstance(learning_rate, optax.GradientTransformation):
        inner = learning_rate
        init_inner = inner.init

        def local_step(y, state, params, extra):
            return inner.update(y, state.inner, params, **extra)
    else:
        learning_rate = V.learning_rate("jaxfog.optax.gradient_tracking", learning_rate)

        def init_inner(params):
            return optax.EmptyState()

        def local_step(y, state, params, extra):
            lr = V.step_size(learning_rate, state.count)
            return jax.tree.map(lambda t: -lr * t, y), state.inner

    def init(params: optax.Params) -> TrackingState:
        zeros = jax.tree.map(jnp.zeros_like, params)
        return TrackingState(zeros, zeros, jnp.zeros([], jnp.int32), init_inner(params))

    def update(grads: optax.Updates, state: TrackingState, params: optax.Params | None = None,
               **extra: Any) -> tuple[optax.Updates, TrackingState]:
        need_params("gradient_tracking", params)
        y = average(jax.tree.map(lambda y, g, h: y + g - h, state.tracker, grads,
                                  state.prev_grads), topology, state.count, "gradient_tracking")
        u, inner_state = local_step(y, state, params, extra)
        x = average(optax.apply_updates(params, u), topology, state.count, "gradient_tracking")
        return sub(x, params), TrackingState(y, grads, state.count + 1, inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


class ExactDiffusionState(NamedTuple):
    """State of :func:`exact_diffusion`."""

    #: :math:`\psi^{k-1} = x^{k-1} - a\, g^{k-1}` of the last step (the
    #: parameters after ``init``).
    psi: Tree
    #: Number of ``update`` calls so far (an int32 scalar); picks a ``Schedule``'s entry.
    count: jax.Array  # type: ignore[assignment]  # optax's name; shadows tuple.count


@mixes_parameters
def exact_diffusion(learning_rate: float | optax.Schedule, *, topology: Any = None
                    ) -> optax.GradientTransformationExtraArgs:
    r"""Exact diffusion: diffusion with a bias correction, exact at a constant step size.

    .. math::

        \psi_i^k &= x_i^k - a\, g_i^k, \\
        \phi_i^k &= \psi_i^k + x_i^k - \psi_i^{k-1},
        \qquad \psi_i^{-1} = x_i^0, \\
        x_i^{k+1} &= \sum_j \bar W_{ij}\, \phi_j^k,
        \qquad \bar W = \tfrac{1}{2} (I + W),

    where :math:`x_i^k` are agent :math:`i`'s parameters, :math:`g_i^k` its
    local gradient at :math:`x_i^k`, :math:`a` the learning rate and
    :math:`W` the mixing matrix of ``topology``
    (:math:`x_i \leftarrow \sum_j W_{ij} x_j`). The first step is ATC
    diffusion with :math:`\bar W`; the correction :math:`x_i^k -
    \psi_i^{k-1}` removes diffusion's bias: with a symmetric doubly stochastic
    :math:`W` the iterates converge to the exact optimum of :math:`\sum_i f_i`
    with a constant step size. One neighbour exchange per step
    (:math:`\bar W \phi = (\phi + W \phi) / 2`).

    Args:
      learning_rate: the step size :math:`a`: a number, or an optax schedule
        (a function of the step count :math:`k`).
      topology: :math:`W`, which the analysis assumes symmetric and doubly
        stochastic: a :class:`~jaxfog.topology.Topology`, a
        :class:`~jaxfog.topology.Schedule` (entry ``k % period`` at step
        ``k``) or ``None``, the current topology (:func:`jaxfog.load_topology`;
        in :func:`jaxfog.simulate`, the simulation's).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is an
      :class:`ExactDiffusionState` (:math:`\psi` of the last step and the step
      counter); its ``update`` is called as :func:`gradient_tracking`'s.

    Example::

        optimizer = jaxfog.optax.exact_diffusion(
            0.05, topology=jaxfog.topology.ring(jaxfog.size()))  # symmetric W
        opt_state = optimizer.init(params)
        # ... then the jitted train step of the module docstring

    References:
      Yuan, Ying, Zhao, Sayed. *Exact Diffusion for Distributed Optimization
      and Learning—Part I: Algorithm Development*. IEEE Transactions on Signal
      Processing, 2019.

      Ying, Yuan, Hu, Chen, Yin. *BlueFog: Make Decentralized Algorithms
      Practical for Optimization and Deep Learning*. arXiv:2111.04287, 2021,
      appendix A.
    """
    learning_rate = V.learning_rate("jaxfog.optax.exact_diffusion", learning_rate)
    V.topology("jaxfog.optax.exact_diffusion", topology)
    def init(params: optax.Params) -> ExactDiffusionState:
        return ExactDiffusionState(params, jnp.zeros([], jnp.int32))

    def update(grads: optax.Updates, state: ExactDiffusionState, params: optax.Params | None = None,
               **extra: Any) -> tuple[optax.Updates, ExactDiffusionState]:
        need_params("exact_diffusion", params)
        first = state.count == 0
        lr = V.step_size(learning_rate, state.count)
        psi = jax.tree.map(lambda x, g: x - lr * g, params, grads)
        phi = jax.tree.map(lambda s, x, prev: s + x - jnp.where(first, x, prev), psi, params,
                           state.psi)
        mixed = average(phi, topology, state.count, "exact_diffusion")
        x = jax.tree.map(lambda f, m: 0.5 * (f + m), phi, mixed)
        return sub(x, params), ExactDiffusionState(psi, state.count + 1)

    return optax.GradientTransformationExtraArgs(init, update)


__all__ = ["ExactDiffusionState", "TrackingState", "exact_diffusion", "gradient_tracking"]
