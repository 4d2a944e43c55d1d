r"""Diffusion: adapt-then-combine (:func:`atc`), adapt-with-combine
(:func:`awc`, optionally with compressed, error-fed mixing) and the global
gradient average they are measured against (:func:`gradient_allreduce`)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

from jaxfog import _validate as V
from jaxfog import compress as C
from jaxfog.ops import allreduce
from jaxfog.optax import _gossip as G
from jaxfog.optax._common import (COMMUNICATIONS, Delayed, check_delay, communicate,
                                  delayed_finish, delayed_init, delayed_mix, mixes_parameters,
                                  need_params, sub)
from jaxfog.optax._gossip import ErrorFeedbackState


def _check_diffusion(what: str, inner: Any, topology: Any, communication: Any,
                     global_every: Any) -> None:
    """atc's and awc's options, checked when the transformation is made."""
    what = f"jaxfog.optax.{what}"
    V.transformation(what, "inner", inner)
    V.topology(what, topology)
    V.choice(what, "communication", communication, COMMUNICATIONS)
    if global_every is not None:
        V.integer(what, "global_every", global_every, minimum=1)


class DiffusionState(NamedTuple):
    """State of :func:`atc` and :func:`awc`: the inner state and a step counter."""

    #: The inner transformation's state.
    inner: optax.OptState
    #: Number of ``update`` calls so far (an int32 scalar, 0 after ``init``): it
    #: picks the entry of a ``Schedule`` and the ``global_every`` steps.
    count: jax.Array  # type: ignore[assignment]  # optax's name; shadows tuple.count


class DelayedDiffusionState(NamedTuple):
    """State of :func:`atc` and :func:`awc` with ``delay=d``: as
    :class:`DiffusionState`, and the ``d`` exchanges in flight."""

    inner: optax.OptState
    count: jax.Array  # type: ignore[assignment]  # optax's name; shadows tuple.count
    #: The exchanges in flight, oldest first: ``(handle, sent)`` pairs, each
    #: handle (:class:`jaxfog.Handle`) mixing what was sent.
    in_flight: Delayed


Tree = Any


class Diffusion(optax.GradientTransformationExtraArgs):
    """What :func:`atc` and :func:`awc` return: an optax transformation with a
    :meth:`finish` method."""

    __slots__ = ()

    def finish(self, state: Any, params: Tree) -> tuple[Tree, Any]:
        r"""Waits for every exchange in flight and merges it now, without an
        inner step.

        With ``delay=d``, after the ``update`` of step :math:`K - 1` (which
        gave the parameters :math:`x^K`) the state holds the exchanges
        started at steps :math:`K - d, \dots, K - 1`, of the values
        :math:`y^{K-d}, \dots, y^{K-1}` that the method mixes
        (:math:`y^k = x^k + u^k` for :func:`atc`, :math:`y^k = x^k` for
        :func:`awc`; :math:`y^m = x^0` for :math:`m < 0`, sent by ``init``).
        ``finish`` merges them oldest first, each as ``update`` merges one,
        from :math:`z^0 = x_i^K`:

        .. math::

            z^{m+1} = W_{ii}\, z^m + \sum_{j \ne i} W_{ij}\, y_j^{K-d+m},
            \qquad m = 0, \dots, d - 1,

        with :math:`W` the matrix of step :math:`K - d + m` (that
        exchange's), and returns the updates :math:`z^d - x_i^K`. So
        :math:`z^d` is the iterate the method reaches in :math:`d` more
        steps with no inner update (:math:`u = 0`): those steps mix exactly
        the exchanges in flight, and the exchanges they would start are not
        started. With ``delay=0`` (and with a ``compressor``) nothing is in
        flight: zero updates and the state unchanged.

        Returns ``(updates, state)`` as ``update`` does (apply the updates to
        ``params``). Call it, with the ``params`` the next ``update`` would
        get, at the end of training (on MPI processes a handle never waited
        for is reported at :func:`jaxfog.shutdown`, and those mixes would be
        lost) or before saving the state (a handle names an exchange of this
        process; it cannot be restored). Runs the same waits on every rank, in
        one order; jittable. The state after it holds ``d`` *idle* exchanges
        (zero arrays: on MPI processes handle id 0, which waits for nothing),
        the same pytree as before, so :func:`jaxfog.wait_all` on it is safe
        and training may go on: its next ``d`` steps mix with nobody
        (:math:`W = I`, since the exchanges they would have waited for were
        merged here), the steps after them as before. (``jaxfog.wait_all(state)``
        also leaves nothing in flight, but drops those mixes instead of
        applying them.)
        """
        return self.update.finish(state, params)


class _Update:
    """The ``update`` of :func:`atc` or :func:`awc`, with the ``finish`` that
    :meth:`Diffusion.finish` calls. (No ``__slots__``: ``jax.jit(optimizer.update)``
    needs a weak reference to it.)"""

    def __init__(self, what: str, step: Callable,
                 finish: Callable[[Any, Tree], tuple[Tree, Any]] | None = None):
        def nothing_in_flight(state: optax.OptState,
                              params: optax.Params) -> tuple[optax.Updates, optax.OptState]:
            need_params(what, params)
            return jax.tree.map(jnp.zeros_like, params), state

        self.step = step
        self.finish = nothing_in_flight if finish is None else finish

    def __call__(self, grads: Tree, state: Any, params: Tree = None,
                 **extra: Any) -> tuple[Tree, Any]:
        return self.step(grads, state, params, **extra)


def _delayed(what: str, inner: optax.GradientTransformation, topology: Any,
             communication: str, delay: int, mix_params: bool) -> Diffusion:
    """awc (``mix_params``: mix x) or atc (mix x + u) with each mix applied
    ``delay`` steps after its exchange started."""

    def init(params: optax.Params) -> DelayedDiffusionState:
        return DelayedDiffusionState(
            inner.init(params), jnp.zeros([], jnp.int32),
            delayed_init(params, delay, topology, communication, what))

    def update(grads: optax.Updates, state: DelayedDiffusionState,
               params: optax.Params | None = None,
               **extra: Any) -> tuple[optax.Updates, DelayedDiffusionState]:
        need_params(what, params)
        if mix_params:  # started first: the exchange of x overlaps the inner update
            mixed, in_flight = delayed_mix(params, state.in_flight, topology, state.count,
                                           communication, what)
        u, inner_state = inner.update(grads, state.inner, params, **extra)
        if mix_params:
            updates = jax.tree.map(lambda m, p, d: m - p + d, mixed, params, u)
        else:
            mixed, in_flight = delayed_mix(optax.apply_updates(params, u), state.in_flight,
                                           topology, state.count, communication, what)
            updates = sub(mixed, params)
        return updates, DelayedDiffusionState(inner_state, state.count + 1, in_flight)

    def finish(state: DelayedDiffusionState,
               params: optax.Params) -> tuple[optax.Updates, DelayedDiffusionState]:
        need_params(what, params)
        merged, in_flight = delayed_finish(params, state.in_flight)
        return sub(merged, params), state._replace(in_flight=in_flight)

    return Diffusion(init, _Update(what, update, finish))


@mixes_parameters
def atc(inner: optax.GradientTransformation, *, topology: Any = None,
        communication: str = "neighbor", global_every: int | None = None,
        delay: int = 0, fused: bool = True) -> Diffusion:
    r"""Adapt then combine (ATC diffusion): a local optimizer step, then averaging.

    Every agent applies its inner update, then averages the result with its
    neighbours:

    .. math::

        x_i^{k+1} = \sum_j W_{ij} \left( x_j^k + u_j^k \right),

    where :math:`x_i^k` are agent :math:`i`'s parameters, :math:`u_i^k` the
    update of ``inner`` computed from the local gradient :math:`g_i^k` at
    :math:`x_i^k`, and :math:`W` the mixing matrix of ``topology``
    (:math:`x_i \leftarrow \sum_j W_{ij} x_j`). With ``inner=optax.sgd(a)``,
    :math:`u_i^k = -a\, g_i^k` and this is the ATC diffusion algorithm; with a
    constant step size it converges to a neighbourhood of the optimum whose
    size shrinks with the step size.

    **When the agents' data differ** (split by label, by user, by site), use
    SGD with momentum as ``inner``, not Adam; or, for Adam, feed it the
    tracked gradient with ``gradient_tracking(optax.adam(...))``
    (:func:`gradient_tracking`). An adaptive ``inner`` (Adam, AdamW,
    RMSProp, Adagrad) normalises each agent's own gradient; where the local
    gradients disagree for good, near the optimum of :math:`\sum_i f_i`
    each agent steps by about :math:`-a\, \mathrm{sign}(g_i^k)` per
    coordinate, these steps do not cancel where the gradients do, and the
    agents settle elsewhere, at a distance that does not shrink with the
    step size (for :math:`f_i(x) = (x - c_i)^2 / 2`, at the median of the
    :math:`c_i` instead of their mean). The optax guide's "Which method when
    agents' data differ" has the measurements (the digits MLP split by label).

    ``communication`` chooses the averaging that replaces :math:`W`:
    ``"allreduce"`` the global mean (:math:`W = \frac{1}{n} \mathbf{1}
    \mathbf{1}^\top` for :math:`n` agents), ``"hierarchical"`` the
    machine-level average of :func:`jaxfog.hierarchical_neighbor_allreduce`,
    ``"none"`` no averaging (:math:`W = I`). ``global_every=p`` uses the
    global mean at the steps :math:`k = 0, p, 2p, \dots` and ``communication``
    at the others; ``communication="none", global_every=p`` is thus local
    training with a global average every :math:`p` steps.

    Put clipping, weight decay and the like *inside* (``inner``), never after
    ``atc`` in an ``optax.chain``: a transformation after it would transform
    the mixing too (a clip would clip the consensus step, silently).
    :func:`check_chain` warns about such a chain.

    Args:
      inner: the local optimizer, any optax transformation (a chain with
        clipping, weight decay, schedules, ...). Its ``update`` receives the
        local gradient, its state, the unmixed ``params`` and the extra
        keyword arguments given to this ``update``.
      topology: the graph of ``"neighbor"`` communication: a
        :class:`~jaxfog.topology.Topology`, a :class:`~jaxfog.topology.Schedule`
        (entry ``k % period`` at step ``k``) or ``None``, the current topology
        (:func:`jaxfog.load_topology`; in :func:`jaxfog.simulate`, the
        simulation's). The other ``communication`` modes ignore it.
      communication: ``"neighbor"`` (default: one
        :func:`jaxfog.neighbor_allreduce` over ``topology``), ``"allreduce"``
        (:func:`jaxfog.allreduce`, the mean over all agents),
        ``"hierarchical"`` (:func:`jaxfog.hierarchical_neighbor_allreduce`
        over the machine topology, :func:`jaxfog.set_machine_topology` or
        ``simulate``'s ``machine_topology``) or ``"none"``. Another value
        raises ``ValueError`` when ``update`` is called.
      global_every: ``None`` (default) or a positive integer ``p``: the steps
        whose counter is a multiple of ``p`` (the first step included) average
        over all agents instead (BlueFog paper, Listing 4). Another value
        raises ``ValueError`` here.
      delay: ``0`` (default) or ``d >= 1``, delayed averaging: the exchange
        started at step :math:`k` is waited for at step :math:`k + d`, so it
        has ``d`` steps to travel (a slow link hidden behind computing), and
        its correction is applied then:

        this agent's fresh value mixed with the neighbours' values of ``d``
        steps ago,

        .. math::

            y_i^k = x_i^k + u_i^k, \qquad
            x_i^{k+1} = W_{ii}\, y_i^k + \sum_{j \ne i} W_{ij}\, y_j^{k-d},

        with :math:`y^{k-d} = x^0` for :math:`k < d` and :math:`W` the
        matrix of step :math:`k - d`. A convex combination of past values for
        a nonnegative :math:`W`, so stable for every ``d``; ``d = 0`` is the
        update above. Neighbour or ``"allreduce"`` communication, no
        ``global_every``. The exchanges in flight are
        :class:`jaxfog.Handle` s in the state (:class:`DelayedDiffusionState`).
        When training ends, ``optimizer.finish(state, params)``
        (:meth:`Diffusion.finish`) waits for the last ``d`` and merges them,
        oldest first, as the next ``d`` steps would with no inner update
        (from :math:`z^0 = x_i^K` after :math:`K` steps):

        .. math::

            z^{m+1} = W_{ii}\, z^m + \sum_{j \ne i} W_{ij}\, y_j^{K-d+m},
            \qquad m = 0, \dots, d - 1,

        its updates being :math:`z^d - x_i^K`.
      fused: ``True`` (default): the whole pytree travels as one message per
        peer, started once every leaf's update is computed. ``False``: one
        exchange per leaf, in reverse leaf order (the order in which the
        backward pass of a layered model produces the gradients: last layer
        first), so that inside one jitted train step each leaf's exchange can
        start as soon as its update is ready, while the backward pass goes on
        (BlueFog's per-layer hooks). The same iterates; more, smaller messages.
        It helps only when ``inner`` updates leaf by leaf (SGD, momentum,
        Adam; not a global-norm clip, which needs every gradient first).

    Returns:
      A :class:`Diffusion`, an ``optax.GradientTransformationExtraArgs``
      whose state is a :class:`DiffusionState` (the inner state and the step
      counter; :class:`DelayedDiffusionState` with a delay).
      ``update(grads, state, params, **extra)`` needs ``params``
      (``ValueError`` without) and returns :math:`x_i^{k+1} - x_i^k`, the
      updates that move the parameters to the mixed values, so it must be the
      last element of a chain. Its ``finish(state, params)``
      (:meth:`Diffusion.finish`) waits for the exchanges a delay keeps in
      flight and returns the updates that merge them: call it at the end of
      training and before saving the state (zero updates without a delay).

    Example::

        optimizer = jaxfog.optax.atc(
            optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
            topology=jaxfog.topology.one_peer_exponential(jaxfog.size()))
        opt_state = optimizer.init(params)
        # ... then the jitted train step of the module docstring

    References:
      Chen, Sayed. *Diffusion Adaptation Strategies for Distributed
      Optimization and Learning Over Networks*. IEEE Transactions on Signal
      Processing, 2012.

      Ying, Yuan, Hu, Chen, Yin. *BlueFog: Make Decentralized Algorithms
      Practical for Optimization and Deep Learning*. arXiv:2111.04287, 2021,
      eq. (4)-(5) and Listing 4.
    """
    _check_diffusion("atc", inner, topology, communication, global_every)
    V.flag("jaxfog.optax.atc", "fused", fused)
    if check_delay("atc", delay, communication, global_every):
        if not fused:
            raise ValueError("jaxfog.optax.atc: fused=False starts each leaf's exchange "
                             "within the step; delay= already moves it across steps")
        return _delayed("atc", inner, topology, communication, delay, mix_params=False)

    def init(params: optax.Params) -> DiffusionState:
        return DiffusionState(inner.init(params), jnp.zeros([], jnp.int32))

    def mix(tree, count):
        if fused:
            return communicate(tree, topology, count, communication, global_every, "atc")
        leaves, treedef = jax.tree.flatten(tree)
        mixed = [None] * len(leaves)
        for i in reversed(range(len(leaves))):  # program order: the last leaf's first
            mixed[i] = communicate(leaves[i], topology, count, communication, global_every,
                                   "atc")
        return jax.tree.unflatten(treedef, mixed)

    def update(grads: optax.Updates, state: DiffusionState, params: optax.Params | None = None,
               **extra: Any) -> tuple[optax.Updates, DiffusionState]:
        need_params("atc", params)
        u, inner_state = inner.update(grads, state.inner, params, **extra)
        mixed = mix(optax.apply_updates(params, u), state.count)
        return sub(mixed, params), DiffusionState(inner_state, state.count + 1)

    return Diffusion(init, _Update("atc", update))


@mixes_parameters
def awc(inner: optax.GradientTransformation, *, topology: Any = None,
        communication: str = "neighbor", global_every: int | None = None,
        compressor: C.Compressor | None = None, gamma: float = 1.0, groups: Any = None,
        seed: int = 0, delay: int = 0) -> Diffusion:
    r"""Adapt with combine (decentralized gradient descent): average, add the local update.

    .. math::

        x_i^{k+1} = \sum_j W_{ij}\, x_j^k + u_i^k,

    where :math:`u_i^k` is the update of ``inner`` computed from the local
    gradient :math:`g_i^k` at the unmixed :math:`x_i^k` and :math:`W` the
    mixing matrix of ``topology`` (:math:`x_i \leftarrow \sum_j W_{ij} x_j`).
    With ``inner=optax.sgd(a)`` this is decentralized (stochastic) gradient
    descent, :math:`x_i^{k+1} = \sum_j W_{ij} x_j^k - a\, g_i^k`; like
    :func:`atc` it converges, with a constant step size, to a neighbourhood of
    the optimum whose size shrinks with the step size.

    **When the agents' data differ**, use SGD with momentum as ``inner``, not
    Adam (or another adaptive optimizer): as under :func:`atc`, each agent's
    Adam normalises its own gradient and the agents settle away from the
    optimum of :math:`\sum_i f_i`, at a distance that does not shrink with
    the step size. For Adam use ``gradient_tracking(optax.adam(...))``
    (:func:`gradient_tracking`: Adam on the tracked average gradient).
    The optax guide's "Which method when agents' data differ" has the
    measurements.

    The exchange of :math:`x^k` does not depend on the gradient, so inside one
    jitted train step XLA is free to run it while the backward pass computes
    (BlueFog paper, section V-A). ``communication`` and ``global_every``
    replace :math:`W` as in :func:`atc`.

    With a ``compressor`` :math:`C`, what is sent is compressed with error
    feedback (DeepSqueeze):

    .. math::

        p_i^k = x_i^k + e_i^k, \qquad \hat y_i^k = C(p_i^k), \qquad
        e_i^{k+1} = p_i^k - \hat y_i^k, \\
        x_i^{k+1} = x_i^k + \gamma \sum_j W_{ij} (\hat y_j^k - \hat y_i^k) + u_i^k,

    the residual :math:`e` (zero at the start) carrying what compression left
    out into the next step. Only the payloads travel (on a ``Schedule``, to
    the union of the period's out-neighbours at every step, as :func:`choco`
    does; absent neighbours get weight 0). With a doubly
    stochastic :math:`W` the network average moves only by the updates; with
    ``identity()`` and ``gamma=1`` this is plain ``awc``.

    Args:
      inner: the local optimizer, any optax transformation. Its ``update``
        receives the local gradient, its state, the unmixed ``params`` and the
        extra keyword arguments given to this ``update``.
      topology, communication, global_every: as for :func:`atc` (with a
        compressor: neighbour communication only).
      compressor: a :class:`jaxfog.compress.Compressor`, or ``None`` (dense).
      gamma: the consensus step size with a compressor, in (0, 1].
      groups, seed: how leaves are grouped and the keys' seed, as for
        :func:`choco`.
      delay: ``0`` (default) or ``d >= 1``, delayed averaging (as for
        :func:`atc`): the exchange of :math:`x^k` is waited for at step
        :math:`k + d`,

        .. math::

            x_i^{k+1} = W_{ii}\, x_i^k + \sum_{j \ne i} W_{ij}\, x_j^{k-d} + u_i^k,

        with :math:`x^{k-d} = x^0` for :math:`k < d`; no compressor. When
        training ends, ``optimizer.finish(state, params)``
        (:meth:`Diffusion.finish`) merges the last ``d`` exchanges, oldest
        first, as the next ``d`` steps would with :math:`u = 0`: from
        :math:`z^0 = x_i^K`, :math:`z^{m+1} = W_{ii}\, z^m + \sum_{j \ne i}
        W_{ij}\, x_j^{K-d+m}`, its updates :math:`z^d - x_i^K`.

    Returns:
      A :class:`Diffusion`, an ``optax.GradientTransformationExtraArgs``
      whose state is a :class:`DiffusionState` (the inner state and the step
      counter; :class:`DelayedDiffusionState` with a delay), or an
      :class:`ErrorFeedbackState` with a compressor.
      ``update(grads, state, params, **extra)`` needs ``params``
      (``ValueError`` without) and returns :math:`x_i^{k+1} - x_i^k`, so it
      must be the last element of a chain. Its ``finish(state, params)``
      (:meth:`Diffusion.finish`) merges what a delay keeps in flight (zero
      updates without one), as for :func:`atc`.

    Example::

        optimizer = jaxfog.optax.awc(
            optax.sgd(0.1, momentum=0.9),
            topology=jaxfog.topology.exponential(jaxfog.size()))
        opt_state = optimizer.init(params)
        # ... then the jitted train step of the module docstring

    References:
      Nedić, Ozdaglar. *Distributed Subgradient Methods for Multi-Agent
      Optimization*. IEEE Transactions on Automatic Control, 2009.

      Lian, Zhang, Zhang, Hsieh, Zhang, Liu. *Can Decentralized Algorithms
      Outperform Centralized Algorithms? A Case Study for Decentralized
      Parallel Stochastic Gradient Descent*. NeurIPS, 2017.

      Ying, Yuan, Hu, Chen, Yin. *BlueFog: Make Decentralized Algorithms
      Practical for Optimization and Deep Learning*. arXiv:2111.04287, 2021,
      section V-A.
    """
    _check_diffusion("awc", inner, topology, communication, global_every)
    if check_delay("awc", delay, communication, global_every):
        if compressor is not None:
            raise ValueError("jaxfog.optax.awc: delay= and compressor= do not combine")
        return _delayed("awc", inner, topology, communication, delay, mix_params=True)
    if compressor is not None:
        if communication != "neighbor" or global_every is not None:
            raise ValueError("jaxfog.optax.awc: a compressor compresses neighbour "
                             "communication; communication= and global_every= do not apply")
        G.check_options("awc", groups, seed)
        return _compressed_awc(inner, topology, G.check_compressor("awc", compressor),
                               G.check_gamma("awc", gamma), groups, seed)

    def init(params: optax.Params) -> DiffusionState:
        return DiffusionState(inner.init(params), jnp.zeros([], jnp.int32))

    def update(grads: optax.Updates, state: DiffusionState, params: optax.Params | None = None,
               **extra: Any) -> tuple[optax.Updates, DiffusionState]:
        need_params("awc", params)
        mixed = communicate(params, topology, state.count, communication, global_every,
                             "awc")
        u, inner_state = inner.update(grads, state.inner, params, **extra)
        return (jax.tree.map(lambda m, p, d: m - p + d, mixed, params, u),
                DiffusionState(inner_state, state.count + 1))

    return Diffusion(init, _Update("awc", update))


def _compressed_awc(inner: optax.GradientTransformation, topology: Any,
                    compressor: C.Compressor, gamma: float, groups: Any,
                    seed: int) -> Diffusion:

    def init(params: optax.Params) -> ErrorFeedbackState:
        plan = G.layout(topology, compressor, params, groups)
        return G.feedback_init(plan.groups, params, inner.init(params), seed)

    def update(grads: optax.Updates, state: ErrorFeedbackState, params: optax.Params | None = None,
               **extra: Any) -> tuple[optax.Updates, ErrorFeedbackState]:
        need_params("awc", params)
        plan = G.layout(topology, compressor, params, groups)
        links = cast(G.Links, plan.links)  # layout() with neighbors=True: never None
        payloads, residual = G.feedback(compressor, plan.groups, params, state)
        mix = C.split(G.neighbor_mix(compressor, links, payloads, state.count),
                      params, plan.groups)
        u, inner_state = inner.update(grads, state.inner, params, **extra)
        return (jax.tree.map(lambda m, d: gamma * m + d, mix, u),
                ErrorFeedbackState(inner_state, residual, state.key, state.count + 1))

    return Diffusion(init, _Update("awc", update))


def gradient_allreduce(inner: optax.GradientTransformation, *,
                       compressor: C.Compressor | None = None, groups: Any = None,
                       seed: int = 0) -> optax.GradientTransformationExtraArgs:
    r"""Global gradient averaging (Horovod-style data parallelism), the baseline.

    .. math::

        u_i^k = \mathrm{inner}\Big( \frac{1}{n} \sum_{j=1}^{n} g_j^k \Big),

    where :math:`g_j^k` is agent :math:`j`'s local gradient, :math:`n` the
    number of agents and :math:`u_i^k` the update returned. Every agent gets
    the same averaged gradient, so agents that start from the same parameters
    (e.g. after :func:`jaxfog.broadcast`) stay identical: synchronous
    data-parallel training, the baseline the decentralized methods are
    compared with. No topology is involved (one :func:`jaxfog.allreduce` per
    step).

    With a ``compressor`` :math:`C`, every agent sends its compressed
    gradient with error feedback (EF-SGD) and averages what all sent:

    .. math::

        p_i^k = g_i^k + e_i^k, \qquad e_i^{k+1} = p_i^k - C(p_i^k), \qquad
        u_i^k = \mathrm{inner}\Big( \frac1n \sum_j C(p_j^k) \Big),

    so that, summed over steps, the averaged gradients differ from the true
    ones only by the residuals left: :math:`\sum_k \frac1n \sum_j
    C(p_j^k) = \frac1n \sum_j (\sum_k g_j^k - e_j^{K})`. The payloads
    travel in one :func:`jaxfog.allgather` per step.

    Args:
      inner: the optimizer applied to the averaged gradient. Its ``update``
        also receives ``params`` and the extra keyword arguments given to this
        ``update``.
      compressor: a :class:`jaxfog.compress.Compressor`, or ``None`` (a dense
        allreduce).
      groups, seed: how leaves are grouped and the keys' seed, as for
        :func:`choco`.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is ``inner``'s
      own (its ``init`` is ``inner.init``), or with a compressor an
      :class:`ErrorFeedbackState`, and whose updates are ``inner``'s.
      ``update(grads, state, params=None, **extra)`` needs ``params`` only if
      ``inner`` does.

    Example::

        params = jaxfog.broadcast(params, root=0)  # the same start everywhere
        optimizer = jaxfog.optax.gradient_allreduce(optax.adamw(1e-3))
        opt_state = optimizer.init(params)
        # ... then the jitted train step of the module docstring

    References:
      Sergeev, Del Balso. *Horovod: fast and easy distributed deep learning in
      TensorFlow*. arXiv:1802.05799, 2018.
    """
    V.transformation("jaxfog.optax.gradient_allreduce", "inner", inner)
    if compressor is None:
        def update(grads: optax.Updates, state: optax.OptState, params: optax.Params | None = None,
                   **extra: Any) -> tuple[optax.Updates, optax.OptState]:
            return inner.update(allreduce(grads), state, params, **extra)

        return optax.GradientTransformationExtraArgs(inner.init, update)

    G.check_compressor("gradient_allreduce", compressor)
    G.check_options("gradient_allreduce", groups, seed)

    def init(params: optax.Params) -> ErrorFeedbackState:
        plan = G.layout(None, compressor, params, groups, neighbors=False)
        return G.feedback_init(plan.groups, params, inner.init(params), seed)

    def update_compressed(grads: optax.Updates, state: ErrorFeedbackState,
                          params: optax.Params | None = None,
                          **extra: Any) -> tuple[optax.Updates, ErrorFeedbackState]:
        plan = G.layout(None, compressor, grads, groups, neighbors=False)
        payloads, residual = G.feedback(compressor, plan.groups, grads, state)
        mean = C.split(G.mean_of_all(compressor, payloads), grads, plan.groups)
        u, inner_state = inner.update(mean, state.inner, params, **extra)
        return u, ErrorFeedbackState(inner_state, residual, state.key, state.count + 1)

    return optax.GradientTransformationExtraArgs(init, update_compressed)


Diffusion.__module__ = "jaxfog.optax"  # documented (and exported) there

__all__ = ["DelayedDiffusionState", "Diffusion", "DiffusionState", "atc", "awc",
           "gradient_allreduce"]
