r"""Low-communication training: local SGD, DiLoCo and NoLoCo as optax transformations
(exported by :mod:`jaxfog.optax`; Streaming DiLoCo is in :mod:`jaxfog.optax.streaming`).

Every agent takes ``every`` (:math:`H`) steps of its inner optimizer alone,
then the agents combine what they did. Only the steps that end a round of
:math:`H` communicate: the combination sits in one branch of a ``lax.cond`` on
the step counter (the same on every agent, so every MPI process takes the same
branch), and the other :math:`H - 1` steps run no communication op at all
(:func:`jaxfog.comm_stats` counts nothing for them).

The communications (``communication=``) and the notation are described in
:func:`local_sgd`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxfog import _validate as V
from jaxfog import compress as C
from jaxfog import runtime
from jaxfog import topology as T
from jaxfog.ops import allreduce, neighbor_allreduce
from jaxfog.optax import _gossip as G
from jaxfog.optax._common import add as _add
from jaxfog.optax._common import mixes_parameters, need_params
from jaxfog.optax._common import sub as _sub

Tree = Any

_COMMUNICATIONS = ("allreduce", "neighbor", "gossip")


# --- arguments -------------------------------------------------------------------


def _check_common(what: str, inner: Any, every: Any, communication: Any, topology: Any,
                  period: Any, seed: Any) -> int:
    V.transformation(f"jaxfog.optax.{what}", "inner", inner)
    every = V.integer(f"jaxfog.optax.{what}", "every", every, minimum=1)
    V.choice(f"jaxfog.optax.{what}", "communication", communication, _COMMUNICATIONS)
    V.integer(f"jaxfog.optax.{what}", "period", period, minimum=1)
    V.integer(f"jaxfog.optax.{what}", "seed", seed)
    if topology is not None and communication != "neighbor":
        raise ValueError(f"jaxfog.optax.{what}: topology= is the graph of "
                         f"communication='neighbor', not of {communication!r}")
    V.topology(f"jaxfog.optax.{what}", topology)
    return every


# --- communication -----------------------------------------------------------------


def random_pairs(n: int, period: int = 16, seed: int = 0) -> T.Schedule:
    r"""A schedule of ``period`` random perfect matchings of ``n`` agents.

    Entry :math:`t` pairs the agents of a random permutation two by two
    (``numpy.random.default_rng(seed)``); paired agents average with weights
    :math:`\frac12, \frac12`, and with an odd ``n`` the one left over keeps
    its value (weight 1). Every entry is symmetric and doubly stochastic, so
    averaging with it preserves the agents' mean. The gossip of
    :func:`local_sgd`, :func:`diloco` and :func:`noloco`.

    Args:
      n: the number of agents.
      period: how many matchings before the schedule repeats.
      seed: the seed of the permutations (the same on every agent).

    Returns:
      A :class:`~jaxfog.topology.Schedule` named ``"random_pairs(n, period, seed)"``.
    """
    n = V.integer("jaxfog.optax.random_pairs", "n", n, minimum=1)
    period = V.integer("jaxfog.optax.random_pairs", "period", period, minimum=1)
    seed = V.integer("jaxfog.optax.random_pairs", "seed", seed)
    rng = np.random.default_rng(seed)
    entries = []
    for t in range(period):
        order = rng.permutation(n)
        w = np.eye(n)
        for a, b in zip(order[0::2], order[1::2]):
            w[a, a] = w[b, b] = w[a, b] = w[b, a] = 0.5
        entries.append(T.from_weights(w, name=f"random_pairs[t={t}]", check_connected=False))
    return T.Schedule(entries, name=f"random_pairs({n}, {period}, {seed})")


#: NoLoCo's pairings for a number of agents, worked out once per process (a
#: pure function of its arguments, so caching it keeps ``update`` pure).
_random_pairs = functools.lru_cache(maxsize=16)(random_pairs)


def _mixer(communication: str, topology: Any, period: int, seed: int, caller: str):
    """``mix(tree, round)``: one averaging of ``tree`` with ``communication``."""
    name = f"jaxfog.optax.{caller}"
    if communication == "allreduce":
        return lambda tree, t: allreduce(tree, name=name)
    if communication == "neighbor":
        return lambda tree, t: neighbor_allreduce(tree, topology=topology, step=t, name=name)

    def gossip(tree, t):
        pairs = _random_pairs(runtime.size(), period, seed)
        return neighbor_allreduce(tree, topology=pairs, step=t, name=name)

    return gossip


def _rounds(count: jax.Array, every: int) -> tuple[jax.Array, jax.Array]:
    """Whether step ``count`` ends a round, and the round's index."""
    return (count + 1) % every == 0, count // every


def _when(sync: jax.Array, every: int, on_sync, otherwise, operands):
    """``on_sync(operands)`` at the steps that end a round, else ``otherwise``:
    a ``lax.cond`` (with ``every == 1`` no branch at all), so that the steps
    in between run no communication op."""
    if every == 1:
        return on_sync(operands)
    return lax.cond(sync, on_sync, otherwise, operands)


# --- local SGD -------------------------------------------------------------------------


class LocalSGDState(NamedTuple):
    """State of :func:`local_sgd`."""

    #: The inner transformation's state (local: never averaged).
    inner: optax.OptState
    #: Number of ``update`` calls so far (an int32 scalar, 0 after ``init``).
    count: jax.Array  # type: ignore[assignment]  # optax's name; shadows tuple.count


@mixes_parameters
def local_sgd(inner: optax.GradientTransformation, *, every: int,
              communication: str = "allreduce", topology: Any = None, period: int = 16,
              seed: int = 0) -> optax.GradientTransformationExtraArgs:
    r"""Local SGD (periodic averaging): ``every`` local steps, then the parameters are averaged.

    .. math::

        \theta_i^{k+1} = \begin{cases}
            \sum_j W_{ij} \left(\theta_j^k + u_j^k\right)
                & \text{if } (k + 1) \bmod H = 0, \\
            \theta_i^k + u_i^k & \text{otherwise,}
        \end{cases}

    where :math:`u_i^k` is ``inner``'s update from the local gradient at
    :math:`\theta_i^k`, :math:`H` is ``every`` and :math:`W` the averaging of
    ``communication`` at round :math:`t = \lfloor k / H \rfloor` (the number
    of averagings before this one), :math:`x_i \leftarrow \sum_j W_{ij} x_j`:

    * ``"allreduce"``: the mean over all agents (:func:`jaxfog.allreduce`);
    * ``"neighbor"``: one :func:`jaxfog.neighbor_allreduce` over ``topology``
      (a :class:`~jaxfog.topology.Topology`, a
      :class:`~jaxfog.topology.Schedule` whose entry ``t % schedule.period``
      serves round :math:`t`, or ``None``, the current topology);
    * ``"gossip"``: pairwise averaging with one random peer per round, the
      averaging of :func:`jaxfog.pair_gossip` (weights :math:`\frac12,
      \frac12`) over entry ``t % period`` of :func:`random_pairs` ``(n,
      period, seed)``, a schedule of random perfect matchings (with an odd
      :math:`n`, one agent per round keeps its value). It runs as a
      ``neighbor_allreduce`` over that schedule, since ``pair_gossip`` on MPI
      needs a peer fixed when the step is compiled, and the round is a traced
      counter.

    With the global mean this is local SGD / FedAvg with equal
    weights; with ``every=1`` it is :func:`atc` with that communication. The
    inner state stays local (it is not averaged). One exchange of the
    parameters every :math:`H` steps, nothing in between.

    Why :func:`atc` keeps ``global_every=``: ``atc(inner, global_every=p)``
    averages with the neighbours at *every* step and globally at the steps
    :math:`0, p, 2p, \dots` (BlueFog's Listing 4); only its
    ``communication="none"`` form is local SGD, which syncs at :math:`k = 0,
    p, \dots` (before the first local steps) where ``local_sgd`` syncs at
    :math:`k = p - 1, 2p - 1, \dots` (after them). Folding it in would drop
    the neighbour steps in between, so both stay.

    Args:
      inner: the local optimizer, any optax transformation; its ``update``
        receives the local gradient, its state, ``params`` and the extra
        keyword arguments given to this ``update``.
      every: :math:`H`, the local steps per round, an int >= 1.
      communication: ``"allreduce"`` (default), ``"neighbor"`` or
        ``"gossip"`` (above).
      topology: the graph of ``"neighbor"`` (a Topology, a Schedule indexed
        by the round, or ``None``: the current one); only with ``"neighbor"``.
      period, seed: ``"gossip"``'s :func:`random_pairs` schedule.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`LocalSGDState`; ``update(grads, state, params, **extra)`` needs
      ``params`` and returns :math:`\theta_i^{k+1} - \theta_i^k` (last in a
      chain).

    Raises:
      TypeError: ``inner`` is not an optax transformation, or ``every`` not an int.
      ValueError: ``every < 1``, an unknown ``communication``, or a
        ``topology`` with another communication than ``"neighbor"``.

    Example::

        optimizer = jaxfog.optax.local_sgd(optax.adam(1e-3), every=20)

    References:
      Stich. *Local SGD Converges Fast and Communicates Little*. ICLR, 2019.

      McMahan, Moore, Ramage, Hampson, Agüera y Arcas. *Communication-Efficient
      Learning of Deep Networks from Decentralized Data*. AISTATS, 2017.
    """
    every = _check_common("local_sgd", inner, every, communication, topology, period, seed)
    mix = _mixer(communication, topology, period, seed, "local_sgd")

    def init(params: optax.Params) -> LocalSGDState:
        return LocalSGDState(inner.init(params), jnp.zeros([], jnp.int32))

    def update(grads: optax.Updates, state: LocalSGDState, params: optax.Params | None = None,
               **extra: Any) -> tuple[optax.Updates, LocalSGDState]:
        need_params("local_sgd", params)
        u, inner_state = inner.update(grads, state.inner, params, **extra)
        sync, t = _rounds(state.count, every)
        moved = optax.apply_updates(params, u)
        new = _when(sync, every, lambda x: mix(x, t), lambda x: x, moved)
        return _sub(new, params), LocalSGDState(inner_state, state.count + 1)

    return optax.GradientTransformationExtraArgs(init, update)


# --- DiLoCo ------------------------------------------------------------------------------


class DiLoCoState(NamedTuple):
    """State of :func:`diloco`."""

    #: The inner transformation's state (local: never averaged nor reset).
    inner: optax.OptState
    #: The outer transformation's state (it changes only at the ends of rounds).
    outer: optax.OptState
    #: :math:`\phi`, the parameters of the last synchronisation (``params`` after ``init``).
    anchor: Tree
    #: The error-feedback residual :math:`e` per group of leaves, or ``()``
    #: without a compressor.
    residual: Any
    #: This agent's base key of the compressor (raw uint32 words).
    key: jax.Array
    #: Number of ``update`` calls so far (an int32 scalar).
    count: jax.Array  # type: ignore[assignment]  # optax's name; shadows tuple.count


@mixes_parameters
def diloco(inner: optax.GradientTransformation,
           outer: optax.GradientTransformation | None = None, *, every: int,
           communication: str = "allreduce", topology: Any = None,
           compressor: C.Compressor | None = None, groups: Any = None,
           error_decay: float = 1.0, period: int = 16,
           seed: int = 0) -> optax.GradientTransformationExtraArgs:
    r"""DiLoCo: ``every`` inner steps, then an outer step on the averaged pseudo-gradient.

    Every agent keeps the anchor :math:`\phi_i`, its parameters at the last
    synchronisation. For :math:`H - 1` steps it trains alone,
    :math:`\theta_i \leftarrow \theta_i + u_i`; at the step that ends round
    :math:`t` it takes that inner step too, then

    .. math::

        \Delta_i &= \phi_i - \theta_i
            \quad \text{(the pseudo-gradient)}, \\
        \bar\Delta_i &= \sum_j W_{ij} \Delta_j, \qquad
        \bar\phi_i = \sum_j W_{ij} \phi_j, \\
        (v_i, s_i) &= \mathrm{outer.update}(\bar\Delta_i, s_i, \bar\phi_i), \\
        \phi_i &\leftarrow \bar\phi_i + v_i, \qquad \theta_i \leftarrow \phi_i,

    with :math:`s_i` the outer state and :math:`W` the averaging of
    ``communication`` at round :math:`t`. With ``"allreduce"`` (the paper's
    setting) every anchor is the same, :math:`\bar\phi_i = \phi_i`, and only
    :math:`\Delta` travels (so start every agent from the same parameters,
    e.g. with :func:`jaxfog.broadcast`, as the paper does: the anchors are
    never averaged); with ``"neighbor"`` and ``"gossip"`` the anchors
    differ and are averaged in the same message (without it nothing would
    pull the replicas together). The default ``outer`` is the paper's
    ``optax.sgd(0.7, momentum=0.9, nesterov=True)``; with ``optax.sgd(1.0)``
    the outer step is plain averaging of the parameters
    (:math:`\phi - \bar\Delta = \bar\theta`) and DiLoCo is :func:`local_sgd`.
    The inner state is never averaged nor reset.

    With a ``compressor`` :math:`C` (``"allreduce"`` only), the
    pseudo-gradient is sent compressed with error feedback, as
    ``gradient_allreduce(compressor=)`` does with gradients:

    .. math::

        p_i = \Delta_i + \beta\, e_i, \qquad e_i \leftarrow p_i - C(p_i), \qquad
        \bar\Delta = \frac1n \sum_j C(p_j),

    the residual :math:`e` (zero at the start) carrying what compression left
    out into the next round, decayed by :math:`\beta` ``error_decay`` (1:
    plain error feedback); the payloads travel in one
    :func:`jaxfog.allgather` per round (key ``fold_in(fold_in(PRNGKey(seed),
    rank), t)``), each agent decoding all of them (a sum of payloads would
    have to decode and compress again at every hop; see the compression
    guide). ``identity()`` gives the uncompressed iterates. SparseLoCo is
    this with error feedback in place of the outer momentum: ``outer=
    optax.sgd(lr)``, ``compressor=jaxfog.compress.chunked_top_k(0.03)`` (2-bit
    values) and ``error_decay`` below 1 (the decayed residual is the
    momentum).

    Streaming DiLoCo, the parameters in fragments synchronised at staggered
    steps, each fragment's exchange overlapping the next inner steps (its
    handle carried in the state) and its result merged a few steps later, is
    :func:`streaming_diloco`; with one fragment, no delay and ``alpha=0`` it
    is this transformation.

    Args:
      inner: the local optimizer, any optax transformation; its ``update``
        receives the local gradient, its state, ``params`` and the extra
        keyword arguments given to this ``update``.
      outer: the outer optimizer, an optax transformation applied to
        :math:`\bar\Delta` as a gradient (``None``: Nesterov SGD, learning rate
        0.7, momentum 0.9, as in the paper).
      every: :math:`H`, the inner steps per round, an int >= 1.
      communication: ``"allreduce"`` (default, the paper), ``"neighbor"`` or
        ``"gossip"`` (see :func:`local_sgd`).
      topology, period, seed: as for :func:`local_sgd` (``seed`` also seeds
        the compressor's keys).
      compressor: a :class:`jaxfog.compress.Compressor` for the
        pseudo-gradient (with ``"allreduce"``), or ``None``.
      groups: how leaves are merged before compression, as for :func:`choco`.
      error_decay: :math:`\beta`, in [0, 1], the residual's weight in the
        next round (with a ``compressor`` only).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`DiLoCoState`; ``update(grads, state, params, **extra)`` needs
      ``params`` and returns :math:`\theta_i^{k+1} - \theta_i^k` (last in a
      chain). Pass the parameters the previous updates produced: the anchor
      lives in the state.

    Raises:
      TypeError: ``inner`` or ``outer`` is not an optax transformation,
        ``every`` not an int, ``compressor`` not a Compressor.
      ValueError: ``every < 1``, an unknown ``communication``, a compressor
        with another communication than ``"allreduce"``, ``error_decay``
        outside [0, 1] or not 1 without a compressor.

    Example::

        optimizer = jaxfog.optax.diloco(optax.adamw(1e-3), every=50)
        optimizer = jaxfog.optax.diloco(optax.adamw(1e-3), every=50,
                                        compressor=jaxfog.compress.quantize(4, chunk=64))
        sparseloco = jaxfog.optax.diloco(
            optax.adamw(1e-3), optax.sgd(1.0), every=50, error_decay=0.95,
            compressor=jaxfog.compress.chunked_top_k(0.03, chunk=64, bits=2))

    References:
      Douillard, Feng, Rusu, Chhaparia, Donchev, Kuncoro, Ranzato, Szlam,
      Shen. *DiLoCo: Distributed Low-Communication Training of Language
      Models*. arXiv:2311.08105, 2023 (Algorithm 1).
    """
    every = _check_common("diloco", inner, every, communication, topology, period, seed)
    if outer is None:
        outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    V.transformation("jaxfog.optax.diloco", "outer", outer)
    if compressor is not None:
        G.check_compressor("diloco", compressor)
        if communication != "allreduce":
            raise ValueError("jaxfog.optax.diloco: a compressor compresses the allreduce's "
                             "pseudo-gradients; with communication="
                             f"{communication!r} the anchors would travel dense too")
    error_decay = V.real("jaxfog.optax.diloco", "error_decay", error_decay, low=0.0, high=1.0)
    if error_decay != 1.0 and compressor is None:
        raise ValueError("jaxfog.optax.diloco: error_decay weighs the error-feedback residual "
                         "of a compressor; without a compressor there is none")
    mix = _mixer(communication, topology, period, seed, "diloco")

    def init(params: optax.Params) -> DiLoCoState:
        residual: tuple[()] | list[jax.Array] = ()
        if compressor is not None:
            plan = G.layout(None, compressor, params, groups, neighbors=False)
            residual = [jnp.zeros_like(p) for p in C.merge(params, plan.groups)]
        return DiLoCoState(inner.init(params), outer.init(params), params, residual,
                           G.agent_key(seed), jnp.zeros([], jnp.int32))

    def combine(anchor, theta, residual, key, t):
        """(mixed anchor, mixed pseudo-gradient, new residual)."""
        delta = _sub(anchor, theta)
        if compressor is not None:
            plan = G.layout(None, compressor, delta, groups, neighbors=False)
            p = [d + error_decay * e for d, e in zip(C.merge(delta, plan.groups), residual)]
            payloads = C.compress_groups(compressor, p, G.step_key(key, t))
            residual = [a - compressor.decompress(q) for a, q in zip(p, payloads)]
            mean = C.split(G.mean_of_all(compressor, payloads), delta, plan.groups)
            return anchor, mean, residual
        if communication == "allreduce":
            return anchor, mix(delta, t), residual
        anchor, delta = mix((anchor, delta), t)
        return anchor, delta, residual

    def update(grads: optax.Updates, state: DiLoCoState, params: optax.Params | None = None,
               **extra: Any) -> tuple[optax.Updates, DiLoCoState]:
        need_params("diloco", params)
        u, inner_state = inner.update(grads, state.inner, params, **extra)
        theta = optax.apply_updates(params, u)
        sync, t = _rounds(state.count, every)

        def outer_step(ops):
            theta, anchor, outer_state, residual = ops
            anchor, delta, residual = combine(anchor, theta, residual, state.key, t)
            v, outer_state = outer.update(delta, outer_state, anchor)
            anchor = optax.apply_updates(anchor, v)
            return anchor, anchor, outer_state, residual

        theta, anchor, outer_state, residual = _when(
            sync, every, outer_step, lambda ops: ops,
            (theta, state.anchor, state.outer, state.residual))
        return (_sub(theta, params),
                DiLoCoState(inner_state, outer_state, anchor, residual, state.key,
                            state.count + 1))

    return optax.GradientTransformationExtraArgs(init, update)


# --- NoLoCo --------------------------------------------------------------------------------


class NoLoCoState(NamedTuple):
    """State of :func:`noloco`."""

    #: The inner transformation's state (local).
    inner: optax.OptState
    #: :math:`\phi`, the parameters of the last outer step (``params`` after ``init``).
    anchor: Tree
    #: :math:`\delta`, the outer momentum (zeros after ``init``).
    momentum: Tree
    #: With a compressor, the public copies :math:`\hat y` of what travels
    #: (:math:`\theta`, or :math:`(\phi, \theta)` with ``gamma``), else ``()``.
    public: Any
    #: This agent's base key of the compressor (raw uint32 words).
    key: jax.Array
    #: Number of ``update`` calls so far (an int32 scalar).
    count: jax.Array  # type: ignore[assignment]  # optax's name; shadows tuple.count


@mixes_parameters
def noloco(inner: optax.GradientTransformation, *, every: int,
           learning_rate: float | optax.Schedule = 0.7,
           momentum: float = 0.3, gamma: float | None = None, communication: str = "gossip",
           topology: Any = None, period: int = 16, compressor: C.Compressor | None = None,
           groups: Any = None, seed: int = 0) -> optax.GradientTransformationExtraArgs:
    r"""NoLoCo: DiLoCo without the all-reduce, averaging with one random peer.

    As in :func:`diloco`, every agent trains alone for :math:`H - 1` steps;
    at the step that ends round :math:`t` it takes that inner step, then
    averages with its group (by default one random peer) and takes the
    paper's modified Nesterov step, whose last term pulls the anchor towards
    the group's:

    .. math::

        \Delta_i &= \phi_i - \theta_i, \\
        \bar\Delta_i &= \sum_j W_{ij} \Delta_j, \qquad
        \bar\phi_i = \sum_j W_{ij} \phi_j, \\
        \delta_i &\leftarrow \alpha\, \delta_i - \beta\, \bar\Delta_i
            - \gamma \left(\phi_i - \bar\phi_i\right), \\
        \phi_i &\leftarrow \phi_i + \delta_i, \qquad \theta_i \leftarrow \phi_i,

    with :math:`\alpha` ``momentum``, :math:`\beta` ``learning_rate``,
    :math:`\gamma` ``gamma``, :math:`\delta` the outer momentum (zero at the
    start) and :math:`W` the averaging of round :math:`t`: by default
    (``"gossip"``) the pair of :func:`random_pairs`, so :math:`\bar x_i =
    \frac12 (x_i + x_{p(i)})` with :math:`p(i)` agent :math:`i`'s peer, the
    paper's groups of two. The paper's :math:`\Delta` is the same
    "old minus new" pseudo-gradient as DiLoCo's. With :math:`\gamma = \beta`
    (the default) the two averages fold into one,
    :math:`\beta \bar\Delta_i + \gamma (\phi_i - \bar\phi_i) = \beta (\phi_i
    - \bar\theta_i)`, so only :math:`\theta` travels (one copy of the
    parameters per round, as in :func:`local_sgd`); otherwise
    :math:`(\phi, \Delta)` travel in one message.

    Where the paper is ambiguous, this implementation assumes:

    * the update is the equation above, which the paper calls a modified
      Nesterov momentum although it has no look-ahead gradient; the
      authors' code (``sparse_optimizer_c.py`` in github.com/jkolehm/noloco)
      applies it in this form, and so does this function;
    * :math:`\gamma = \beta` unless given (the authors' code uses the outer
      learning rate for both); :math:`\beta = 0.7` and :math:`\alpha = 0.3`
      are the outer learning rate and momentum of the authors' NoLoCo
      configurations;
    * groups are random perfect matchings drawn from a seed shared by all
      agents (the paper draws a random permutation per outer step), repeating
      after ``period`` rounds; with an odd number of agents one agent per
      round is alone (:math:`\bar x_i = x_i`);
    * the paper's random routing of activations between pipeline stages is
      outside an optimizer's scope and is not done.

    With a ``compressor`` :math:`C`, what travels is compressed as
    :func:`choco` compresses parameters. The anchors differ between agents,
    so the pseudo-gradient alone cannot carry the average; instead every
    agent keeps *public copies* :math:`\hat y_j` of what each of its
    in-neighbours sends (:math:`y = \theta`, or :math:`y = (\phi, \theta)`
    with ``gamma``), and sends only the compressed difference from its own:

    .. math::

        q_i &= C(y_i - \hat y_i), \qquad
        \hat y_j \leftarrow \hat y_j + q_j
        \quad \text{for } j = i \text{ and every in-neighbour } j, \\
        \bar y_i &= y_i + \sum_j W_{ij} (\hat y_j - \hat y_i),

    with :math:`\hat y = 0` after ``init`` and the key of round :math:`t`
    ``fold_in(fold_in(PRNGKey(seed), rank), t)``, folded with the group.
    :math:`\bar y` takes the place of the exact average in the equations
    above (:math:`\bar\Delta = \bar\phi - \bar\theta`). The public copies
    are the error feedback: what :math:`C` left out of :math:`q_i` stays in
    :math:`y_i - \hat y_i` and is sent later, and since :math:`\hat y_i`
    follows :math:`y_i`, that difference is one round's progress, as
    compressible as a pseudo-gradient. With a symmetric doubly stochastic
    :math:`W` the correction sums to zero over the agents, so the agents'
    mean moves as without compression; ``identity()`` gives the uncompressed
    iterates. As for :func:`choco`, copies are kept for the union of the
    in-neighbours over the schedule's period and every payload goes to the
    union of the out-neighbours each round (with ``"gossip"``, every agent
    another agent is ever paired with: all of them for ``n`` up to about
    ``period``); the price is the union graph's bandwidth. With
    ``"allreduce"`` (NoLoCo is then DiLoCo with an outer heavy-ball step)
    compress with :func:`diloco` instead.

    Args:
      inner: the local optimizer, any optax transformation; its ``update``
        receives the local gradient, its state, ``params`` and the extra
        keyword arguments given to this ``update``.
      every: :math:`H`, the inner steps per round, an int >= 1.
      learning_rate: :math:`\beta`, a number >= 0 or an optax schedule (a
        function of the round :math:`t`).
      momentum: :math:`\alpha`, in [0, 1].
      gamma: :math:`\gamma`, a number >= 0, or ``None`` (:math:`\beta`, the
        schedule's value with a schedule).
      communication: ``"gossip"`` (default: one random peer), ``"neighbor"``
        (:math:`W` of ``topology``, e.g. a one-peer schedule) or
        ``"allreduce"``.
      topology, period: as for :func:`local_sgd`.
      compressor: a :class:`jaxfog.compress.Compressor` for what travels, or
        ``None`` (dense); ``"gossip"`` and ``"neighbor"`` only.
      groups: how leaves are merged before compression, as for :func:`choco`.
      seed: as for :func:`local_sgd`, and the compressor's keys.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`NoLoCoState`; ``update(grads, state, params, **extra)`` needs
      ``params`` and returns :math:`\theta_i^{k+1} - \theta_i^k`.

    Raises:
      TypeError, ValueError: as for :func:`local_sgd`, for a
        ``learning_rate``, ``momentum`` or ``gamma`` that is not a number in
        its range, a ``compressor`` that is not a Compressor, and one with
        ``communication="allreduce"``.

    Example::

        optimizer = jaxfog.optax.noloco(optax.adamw(1e-3), every=50)
        compressed = jaxfog.optax.noloco(
            optax.adamw(1e-3), every=50, communication="neighbor",
            topology=jaxfog.topology.one_peer_exponential(8),
            compressor=jaxfog.compress.chunked_top_k(0.03, chunk=64, bits=2))

    References:
      Kolehmainen, Blagoev, Donaghy, Ersoy, Nies. *NoLoCo: No-all-reduce Low
      Communication Training Method for Large Models*. arXiv:2506.10911, 2025.
    """
    every = _check_common("noloco", inner, every, communication, topology, period, seed)
    learning_rate = V.learning_rate("jaxfog.optax.noloco", learning_rate)
    alpha = V.real("jaxfog.optax.noloco", "momentum", momentum, low=0.0, high=1.0)
    folded = gamma is None
    gamma = None if folded else V.real("jaxfog.optax.noloco", "gamma", gamma, low=0.0)
    if compressor is not None:
        G.check_compressor("noloco", compressor)
        G.check_options("noloco", groups, seed)
        if communication == "allreduce":
            raise ValueError("jaxfog.optax.noloco: with communication='allreduce' NoLoCo is "
                             "DiLoCo with an outer heavy-ball step; compress its allreduce "
                             "with jaxfog.optax.diloco(inner, optax.sgd(learning_rate, "
                             "momentum=momentum), compressor=...)")
    mix = _mixer(communication, topology, period, seed, "noloco")

    def graph():
        """The graph the public copies follow (only with a compressor)."""
        if communication == "gossip":
            return _random_pairs(runtime.size(), period, seed)
        return topology

    def sent(anchor, theta):
        """What travels: theta, or (anchor, theta) with gamma."""
        return theta if folded else (anchor, theta)

    def init(params: optax.Params) -> NoLoCoState:
        public: Any = ()
        if compressor is not None:
            plan = G.layout(graph(), compressor, sent(params, params), groups)
            links = cast(G.Links, plan.links)  # layout() with neighbors=True: never None
            public = G.copies(compressor, C.merge(sent(params, params), plan.groups),
                              G.degree(links))
        return NoLoCoState(inner.init(params), params, jax.tree.map(jnp.zeros_like, params),
                           public, G.agent_key(seed), jnp.zeros([], jnp.int32))

    def estimate(tree, public, key, t):
        """(the average of ``tree`` estimated from the public copies, the copies
        after round ``t``)."""
        plan = G.layout(graph(), compressor, tree, groups)
        links = cast(G.Links, plan.links)
        G.check_degree("noloco", public, links)
        y = C.merge(tree, plan.groups)
        differences, public = G.gossip_round(compressor, links, y, public,
                                             G.step_key(key, t), t)
        mixed = [a + m for a, m in zip(y, differences)]
        return C.split(mixed, tree, plan.groups), public

    def update(grads: optax.Updates, state: NoLoCoState, params: optax.Params | None = None,
               **extra: Any) -> tuple[optax.Updates, NoLoCoState]:
        need_params("noloco", params)
        u, inner_state = inner.update(grads, state.inner, params, **extra)
        theta = optax.apply_updates(params, u)
        sync, t = _rounds(state.count, every)

        def outer_step(ops):
            theta, anchor, m, public = ops
            beta = V.step_size(learning_rate, t)

            def cast_to(x, like):  # a schedule's value in the leaf's dtype (cond branches match)
                return jnp.asarray(x).astype(like.dtype)

            if compressor is None:
                mixed = mix(theta if folded else (anchor, _sub(anchor, theta)), t)
            else:
                mixed, public = estimate(sent(anchor, theta), public, state.key, t)
                if not folded:  # (mean phi, mean theta) -> (mean phi, mean delta)
                    mixed = (mixed[0], _sub(*mixed))
            if folded:  # beta (phi - mean theta): one copy of the parameters travels
                pull = _sub(anchor, mixed)
                m = jax.tree.map(lambda m, p: alpha * m - cast_to(beta, m) * p, m, pull)
            else:
                phi, delta = mixed
                m = jax.tree.map(lambda m, d, a, f: (alpha * m - cast_to(beta, m) * d
                                                     - gamma * (a - f)),
                                 m, delta, anchor, phi)
            anchor = _add(anchor, m)
            return anchor, anchor, m, public

        theta, anchor, m, public = _when(sync, every, outer_step, lambda ops: ops,
                                         (theta, state.anchor, state.momentum, state.public))
        return _sub(theta, params), NoLoCoState(inner_state, anchor, m, public, state.key,
                                                state.count + 1)

    return optax.GradientTransformationExtraArgs(init, update)


for _cls in (LocalSGDState, DiLoCoState, NoLoCoState):
    _cls.__module__ = "jaxfog.optax"  # documented (and exported) there


__all__ = ["DiLoCoState", "LocalSGDState", "NoLoCoState", "diloco", "local_sgd", "noloco",
           "random_pairs"]
