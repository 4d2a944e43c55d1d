r"""Compressed gossip as optax transformations (exported by :mod:`jaxfog.optax`).

Every agent sends its compressed payload (:mod:`jaxfog.compress`) to its
out-neighbours in one fused message per peer (:func:`jaxfog.neighbor_allgather`
of the payloads' pytree) and keeps *public copies* :math:`\hat x_j` of itself
and of each in-neighbour, updated with the same decompressed values on the
sender and on the receivers, so the copies agree bit for bit.

Time-varying graphs (a :class:`~jaxfog.topology.Schedule`): the rule for the
public copies of neighbours that come and go is that none ever goes stale.
Every agent keeps copies of the union of its in-neighbours over the period and
sends its payload to the union of its out-neighbours at every step; the mixing
uses the step's weights. The price is the union graph's bandwidth.
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

from jaxfog import _validate as V
from jaxfog import compress as C
from jaxfog.optax import _gossip as G
from jaxfog.optax._common import mixes_parameters, need_params

Tree = Any
Parts = list  # one array per group of leaves (jaxfog.compress.merge)


# --- CHOCO-SGD ---------------------------------------------------------------------


class ChocoState(NamedTuple):
    """State of :func:`choco`."""

    #: The inner transformation's state.
    inner: optax.OptState
    #: The public copies :math:`\hat x` (zeros after ``init``).
    public: G.PublicCopies
    #: This agent's base key (raw uint32 words).
    key: jax.Array
    #: Number of ``update`` calls so far (an int32 scalar).
    count: jax.Array  # type: ignore[assignment]  # optax's name; shadows tuple.count


@mixes_parameters
def choco(inner: optax.GradientTransformation, *, compressor: C.Compressor, gamma: float,
          topology: Any = None, groups: Any = None, seed: int = 0
          ) -> optax.GradientTransformationExtraArgs:
    r"""CHOCO-SGD: decentralized SGD that sends compressed differences.

    .. math::

        x_i^{k+1/2} &= x_i^k + u_i^k, \\
        q_i^k &= C\big(x_i^{k+1/2} - \hat x_i^k\big)
        \quad \text{(sent to the out-neighbours)}, \\
        \hat x_j^{k+1} &= \hat x_j^k + q_j^k
        \quad \text{for } j = i \text{ and every in-neighbour } j, \\
        x_i^{k+1} &= x_i^{k+1/2} + \gamma \sum_j W_{ij}
        \big(\hat x_j^{k+1} - \hat x_i^{k+1}\big),

    where :math:`u_i^k` is ``inner``'s update from the local gradient,
    :math:`C` the compressor (applied per group of leaves, key
    ``fold_in(fold_in(PRNGKey(seed), rank), k)`` folded with the group) and
    :math:`\hat x` the public copies, zero at the start. Only
    :math:`q` travels: :math:`C`'s payload, in one message per peer. With a
    doubly stochastic :math:`W` the network average moves only by the
    updates :math:`u`; with ``inner = optax.sgd(0)`` this is CHOCO-Gossip,
    which reaches consensus linearly for a contraction :math:`C` and
    :math:`\gamma` small enough (about :math:`\delta` times the spectral gap).

    Args:
      inner: the local optimizer, any optax transformation.
      compressor: a :class:`jaxfog.compress.Compressor` (a contraction: use
        the biased forms of ``rand_k`` and ``qsgd``, or a small ``gamma``).
      gamma: the consensus step size, in (0, 1].
      topology: :math:`W`: a :class:`~jaxfog.topology.Topology`, a
        :class:`~jaxfog.topology.Schedule` (see :mod:`jaxfog.optax` for the
        rule on neighbours that come and go) or ``None``, the current one
        (read at every call, like every transformation here: a state made
        by ``init`` for a graph with other in-neighbours is refused).
      groups: how leaves are merged before compression: ``None`` (one group
        per leaf), an int ``y`` (:func:`jaxfog.compress.balanced`), explicit
        groups or a :func:`jaxfog.compress.search` result.
      seed: the seed of the compressors' keys.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`ChocoState`; ``update(grads, state, params, **extra)`` needs
      ``params`` and returns :math:`x_i^{k+1} - x_i^k` (last in a chain).

    Example::

        optimizer = jaxfog.optax.choco(optax.sgd(0.1),
                                       compressor=jaxfog.compress.top_k(0.01), gamma=0.2)

    References:
      Koloskova, Stich, Jaggi. *Decentralized Stochastic Optimization and
      Gossip Algorithms with Compressed Communication*. ICML, 2019.
    """
    G.check_compressor("choco", compressor)
    gamma = G.check_gamma("choco", gamma)
    G.check_options("choco", groups, seed)
    V.transformation("jaxfog.optax.choco", "inner", inner)
    V.topology("jaxfog.optax.choco", topology)

    def init(params: optax.Params) -> ChocoState:
        plan = G.layout(topology, compressor, params, groups)
        links = cast(G.Links, plan.links)  # layout() with neighbors=True: never None
        key = G.agent_key(seed)
        parts = C.merge(params, plan.groups)
        return ChocoState(inner.init(params), G.copies(compressor, parts, G.degree(links)),
                          key, jnp.zeros([], jnp.int32))

    def update(grads: optax.Updates, state: ChocoState, params: optax.Params | None = None,
               **extra: Any) -> tuple[optax.Updates, ChocoState]:
        need_params("choco", params)
        plan = G.layout(topology, compressor, params, groups)
        links = cast(G.Links, plan.links)  # layout() with neighbors=True: never None
        G.check_degree("choco", state.public, links)
        u, inner_state = inner.update(grads, state.inner, params, **extra)
        half = C.merge(optax.apply_updates(params, u), plan.groups)
        differences, public = G.gossip_round(compressor, links, half, state.public,
                                             G.step_key(state.key, state.count), state.count)
        new = [x + gamma * m for x, m in zip(half, differences)]
        x = C.split(new, params, plan.groups)
        return (jax.tree.map(lambda a, b: a - b, x, params),
                ChocoState(inner_state, public, state.key, state.count + 1))

    return optax.GradientTransformationExtraArgs(init, update)


# --- BEER ----------------------------------------------------------------------------


class BeerState(NamedTuple):
    """State of :func:`beer`."""

    #: The tracker :math:`v^{k-1}` (zeros after ``init``).
    tracker: Parts
    #: The gradient :math:`g^{k-1}` (zeros after ``init``).
    prev_grads: Parts
    #: Public copies :math:`H` of the parameters.
    public_x: G.PublicCopies
    #: Public copies :math:`G` of the tracker.
    public_v: G.PublicCopies
    #: This agent's base key (raw uint32 words).
    key: jax.Array
    #: Number of ``update`` calls so far (an int32 scalar).
    count: jax.Array  # type: ignore[assignment]  # optax's name; shadows tuple.count


@mixes_parameters
def beer(learning_rate: float | optax.Schedule, *, compressor: C.Compressor, gamma: float,
         topology: Any = None, groups: Any = None, seed: int = 0
         ) -> optax.GradientTransformationExtraArgs:
    r"""BEER: gradient tracking with compressed differences; exact with any contraction.

    .. math::

        v_i^k &= v_i^{k-1} + \gamma \sum_j W_{ij} (G_j^{k-1} - G_i^{k-1})
                 + g_i^k - g_i^{k-1}, &
        G_j^k &= G_j^{k-1} + C(v_j^k - G_j^{k-1}), \\
        x_i^{k+1} &= x_i^k + \gamma \sum_j W_{ij} (H_j^k - H_i^k) - a\, v_i^k, &
        H_j^{k+1} &= H_j^k + C(x_j^{k+1} - H_j^k),

    with :math:`v^{-1} = g^{-1} = G^{-1} = H^0 = 0`, :math:`a` the learning
    rate, :math:`g_i^k` the local gradient at :math:`x_i^k` and :math:`H`,
    :math:`G` the public copies of the parameters and of the tracker (kept
    for this agent and its in-neighbours, as in :func:`choco`). Both
    compressed differences travel in one message per peer per step. With a
    doubly stochastic :math:`W` the trackers' average is the average gradient,
    so with a constant step size the agents reach the exact optimum of
    :math:`\sum_i f_i` on heterogeneous data, for biased contractions (top-k,
    sign) as well.

    Why BEER rather than LEAD: BEER needs only a contraction, so top-k and
    sign qualify; LEAD's analysis assumes an unbiased compressor. With
    ``identity()`` and ``gamma = 1`` it is DIGing, the combine-then-adapt form
    of gradient tracking (:func:`gradient_tracking` is the adapt-then-combine
    one).

    Args:
      learning_rate: the step size :math:`a`: a number, or an optax schedule.
      compressor, gamma, topology, groups, seed: as for :func:`choco`.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`BeerState`; ``update(grads, state, params)`` needs ``params``
      and returns :math:`x_i^{k+1} - x_i^k`. Use it alone.

    Example::

        optimizer = jaxfog.optax.beer(0.05, compressor=jaxfog.compress.top_k(0.1),
                                      gamma=0.3, topology=jaxfog.topology.ring(jaxfog.size()))
        opt_state = optimizer.init(params)
        # ... then the jitted train step of the module docstring

    References:
      Zhao, Li, Richtárik, Chi. *BEER: Fast O(1/T) Rate for Decentralized
      Nonconvex Optimization with Communication Compression*. NeurIPS, 2022.
    """
    G.check_compressor("beer", compressor)
    gamma = G.check_gamma("beer", gamma)
    G.check_options("beer", groups, seed)
    V.topology("jaxfog.optax.beer", topology)
    learning_rate = V.learning_rate("jaxfog.optax.beer", learning_rate)

    def init(params: optax.Params) -> BeerState:
        plan = G.layout(topology, compressor, params, groups)
        links = cast(G.Links, plan.links)  # layout() with neighbors=True: never None
        key = G.agent_key(seed)
        parts = C.merge(params, plan.groups)
        k = G.degree(links)
        zeros = [jnp.zeros_like(p) for p in parts]
        return BeerState(zeros, zeros, G.copies(compressor, parts, k),
                         G.copies(compressor, parts, k), key, jnp.zeros([], jnp.int32))

    def update(grads: optax.Updates, state: BeerState, params: optax.Params | None = None,
               **extra: Any) -> tuple[optax.Updates, BeerState]:
        need_params("beer", params)
        plan = G.layout(topology, compressor, params, groups)
        links = cast(G.Links, plan.links)  # layout() with neighbors=True: never None
        G.check_degree("beer", state.public_x, links)
        groups_, weights = plan.groups, G.row(links, state.count)
        g = C.merge(grads, groups_)
        v = [t + gamma * m + a - b for t, m, a, b in
             zip(state.tracker, G.mixing(state.public_v, weights), g, state.prev_grads)]
        x = C.merge(params, groups_)
        lr = V.step_size(learning_rate, state.count)
        x_new = [p + gamma * m - lr * t for p, m, t in
                 zip(x, G.mixing(state.public_x, weights), v)]
        key = G.step_key(state.key, state.count)
        mine_x = G.compress(compressor, x_new, state.public_x, key)
        mine_v = G.compress(compressor, v, state.public_v, jax.random.fold_in(key, 1 << 20))
        theirs = G.exchange(links, mine_x + mine_v)
        n = len(mine_x)
        public_x = G.receive(compressor, state.public_x, mine_x, theirs[:n])
        public_v = G.receive(compressor, state.public_v, mine_v, theirs[n:])
        out = C.split(x_new, params, groups_)
        return (jax.tree.map(lambda a, b: a - b, out, params),
                BeerState(v, g, public_x, public_v, state.key, state.count + 1))

    return optax.GradientTransformationExtraArgs(init, update)


__all__ = ["BeerState", "ChocoState", "beer", "choco"]
