r"""The push-sum family, for directed and time-varying graphs:
:func:`push_sum` (SGP), :func:`async_push_sum` over one-sided windows and
:func:`push_diging`, with the column-stochastic weights of
:func:`column_stochastic`."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxfog import _validate as V
from jaxfog import runtime
from jaxfog import topology as T
from jaxfog.ops.window import win_accumulate, win_create, win_update_then_collect
from jaxfog.optax._common import Tree, average, mixes_parameters, need_params, sub


def column_stochastic(topology: T.Topology) -> T.Topology:
    r"""Column-stochastic push weights on ``topology``'s edges, for push-sum.

    Every sender keeps and sends the same share of what it has:

    .. math::

        P_{ij} = \begin{cases}
            \dfrac{1}{d_j + 1} & \text{if } i = j \text{ or } W_{ij} \ne 0, \\
            0 & \text{otherwise,}
        \end{cases}

    where :math:`W` is ``topology``'s mixing matrix (agent :math:`j` sends to
    agent :math:`i` when :math:`W_{ij} \ne 0`) and :math:`d_j` the number of
    agents :math:`j` sends to (its out-degree). Every column of :math:`P` sums
    to 1, so :math:`\sum_i x_i` is preserved by :math:`x \leftarrow P x`;
    the rows in general do not sum to 1.

    Args:
      topology: a :class:`~jaxfog.topology.Topology` (one graph; its edges are
        used, its weights are not).

    Returns:
      A :class:`~jaxfog.topology.Topology` with weights :math:`P`, named
      ``"push(<name>)"``; its connectivity is not checked.

    Example::

        P = jaxfog.optax.column_stochastic(jaxfog.topology.star(4))
        P.weights[:, 0]  # the center keeps 1/4 and sends 1/4 to each of 3 leaves
        assert P.is_column_stochastic() and not P.is_row_stochastic()
    """
    import numpy as np

    if not isinstance(topology, T.Topology):
        raise TypeError("jaxfog.optax.column_stochastic: topology must be a Topology, got "
                        f"{type(topology).__name__} {topology!r}")
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

    #: The inner transformation's state.
    inner: optax.OptState
    #: The numerator :math:`x^k` (the parameters after ``init``).
    numerator: Tree
    #: The push-sum weight :math:`w^k`, a scalar in the widest float JAX allows
    #: (float64 with ``jax_enable_x64``, else float32); 1 after ``init``.
    weight: jax.Array
    #: Number of ``update`` calls so far (an int32 scalar); picks a ``Schedule``'s entry.
    count: jax.Array  # type: ignore[assignment]  # optax's name; shadows tuple.count


@mixes_parameters
def push_sum(inner: optax.GradientTransformation, *, topology: Any = None
             ) -> optax.GradientTransformationExtraArgs:
    r"""Push-sum / stochastic gradient push: averaging on directed and time-varying graphs.

    .. math::

        x_i^{k+1} &= \sum_j P_{ij} \left( x_j^k + u_j^k \right),
        \qquad w_i^{k+1} = \sum_j P_{ij}\, w_j^k, \\
        z_i^{k+1} &= x_i^{k+1} / w_i^{k+1},
        \qquad x_i^0 = z_i^0, \quad w_i^0 = 1,

    where :math:`z_i^k` are the parameters agent :math:`i` sees (``params``),
    :math:`x_i^k` the biased numerator, :math:`w_i^k` the push-sum weight,
    :math:`u_i^k` the update of ``inner`` computed from the local gradient
    :math:`g_i^k` at :math:`z_i^k`, and :math:`P` the column-stochastic
    weights that :func:`column_stochastic` puts on ``topology``'s edges:
    sender :math:`j` gives :math:`1 / (d_j + 1)` to itself and to each of its
    :math:`d_j` out-neighbours. The columns of :math:`P` sum to 1, so the sums of
    :math:`x` and :math:`w` over the agents are preserved and :math:`z`
    de-biases the mixing; this is why it works on directed and time-varying
    graphs, where :math:`W` is not doubly stochastic. The weight travels in
    the same message as the numerator: one neighbour exchange per step. With
    ``inner=optax.sgd(a)`` this is stochastic gradient push; with zero
    updates, push-sum averaging. Its asynchronous form, over one-sided windows, is
    :func:`async_push_sum` (as a trainer,
    :func:`jaxfog.asynchrony.async_push_sum`).

    Args:
      inner: the local optimizer, any optax transformation. Its ``update``
        receives the local gradient, its state, ``params`` (:math:`z_i^k`) and
        the extra keyword arguments given to this ``update``.
      topology: the graph, whose edges (not weights) define :math:`P`: a
        :class:`~jaxfog.topology.Topology`, a :class:`~jaxfog.topology.Schedule`
        (each entry converted; entry ``k % period`` at step ``k``) or ``None``,
        the current topology (:func:`jaxfog.load_topology`, read when
        ``update`` is traced; in :func:`jaxfog.simulate`, the simulation's).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`PushSumState` (the inner state, :math:`x`, :math:`w` and the step
      counter). ``update(grads, state, params, **extra)`` needs ``params``
      (``ValueError`` without) and returns :math:`z_i^{k+1} - z_i^k`, so it
      must be the last element of a chain. The iterate lives in the state:
      pass the parameters the previous updates produced.

    Example::

        optimizer = jaxfog.optax.push_sum(
            optax.sgd(0.1), topology=jaxfog.topology.exponential(jaxfog.size()))
        opt_state = optimizer.init(params)
        # ... then the jitted train step of the module docstring

    References:
      Kempe, Dobra, Gehrke. *Gossip-Based Computation of Aggregate
      Information*. IEEE Symposium on Foundations of Computer Science (FOCS),
      2003.

      Assran, Loizou, Ballas, Rabbat. *Stochastic Gradient Push for
      Distributed Deep Learning*. ICML, 2019.
    """
    V.transformation("jaxfog.optax.push_sum", "inner", inner)
    V.topology("jaxfog.optax.push_sum", topology)

    def init(params: optax.Params) -> PushSumState:
        return PushSumState(inner.init(params), params, _unit_weight(),
                            jnp.zeros([], jnp.int32))

    def update(grads: optax.Updates, state: PushSumState, params: optax.Params | None = None,
               **extra: Any) -> tuple[optax.Updates, PushSumState]:
        need_params("push_sum", params)
        u, inner_state = inner.update(grads, state.inner, params, **extra)
        numerator = optax.apply_updates(state.numerator, u)
        numerator, weight = average((numerator, state.weight), _push_topology(topology),
                                     state.count, "push_sum")
        z = jax.tree.map(lambda x: x / weight.astype(x.dtype), numerator)
        return sub(z, params), PushSumState(inner_state, numerator, weight, state.count + 1)

    return optax.GradientTransformationExtraArgs(init, update)


def _push_shares(graph: T.Topology) -> tuple[np.ndarray, np.ndarray]:
    """Asynchronous push-sum's split of each agent's mass: an equal share kept
    and sent to each out-neighbour, as rank-indexed tables (every backend
    takes its rank's row): ``(self[i], push[i, k])``."""
    n = graph.size
    edges = (graph.weights != 0) & ~np.eye(n, dtype=bool)  # edges[k, i]: i sends to k
    share = 1.0 / (edges.sum(axis=0) + 1)
    return share, np.where(edges.T, share[:, None], 0.0)


class AsyncPushSumState(NamedTuple):
    """State of :func:`async_push_sum`."""

    #: The inner transformation's state.
    inner: optax.OptState
    #: The numerator :math:`x` (the parameters after ``init``), in float32 or
    #: wider (:func:`mass_dtype`): what is pushed and collected.
    numerator: Tree
    #: The push-sum weight :math:`p` (1 after ``init``), a scalar.
    weight: jax.Array


def mass_dtype(dtype: Any) -> np.dtype:
    """The dtype push-sum mass of a ``dtype`` leaf travels in: floats of
    fewer than 32 bits (bfloat16, float16) widen to float32, whose exponent
    range keeps small shares representable and which MPI can accumulate."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.inexact) and dtype.itemsize < 4:
        return np.dtype(np.float32)
    return dtype


def min_push_weight(dtypes: Any) -> float:
    """The push-sum weight below which :func:`async_push_sum` gives nothing away:
    ``sqrt(tiny)`` of the narrowest of ``dtypes`` (about 1e-19 in float32),
    so that a weight and ``weight * z`` stay normal numbers for every
    ``|z| >= sqrt(tiny)``."""
    return max(float(np.sqrt(jnp.finfo(d).tiny)) for d in dtypes
               if jnp.issubdtype(d, jnp.inexact))


@mixes_parameters
def async_push_sum(inner: optax.GradientTransformation, *, name: str = "jaxfog.push_sum",
                   topology: T.Topology | None = None
                   ) -> optax.GradientTransformationExtraArgs:
    r"""Asynchronous push-sum / SGP over a one-sided window: nobody waits.

    Agent :math:`i` with out-degree :math:`d_i` and share
    :math:`a_i = 1 / (d_i + 1)`, numerator :math:`x_i` and weight :math:`p_i`:

    .. math::

        x_i &\leftarrow x_i + p_i u_i, \\
        g_i &= [p_i \ge p_{\min}], \\
        \text{for each out-neighbour } k:\quad s_{k,i} &\mathrel{+}= g_i\, a_i (x_i, p_i)
        \quad (\texttt{win\_accumulate}), \\
        (x_i, p_i) &\leftarrow (1 - g_i d_i a_i) (x_i, p_i) + \textstyle\sum_j s_{i,j},
        \quad s_{i,j} \leftarrow 0 \quad (\texttt{win\_update\_then\_collect}), \\
        z_i &= x_i / p_i,

    where :math:`s_{i,j}` is the slot agent :math:`j` accumulates into on
    agent :math:`i`, :math:`u_i` the inner update from the gradient at
    :math:`z_i` (``params``), scaled by :math:`p_i` so that :math:`z_i` moves
    by :math:`u_i` however much mass the agent holds (a fast agent's weight
    shrinks while a slow neighbour has not collected; unscaled, its steps
    would grow by :math:`1/p_i` and diverge). Each step is column-stochastic
    (what an agent gives away it no longer holds), so the sums of :math:`x`
    and :math:`p` over agents and slots never change: whatever has not yet
    been collected is still in a slot. A slow agent's slots fill up and are
    drained at its next step; the fast agents never wait for it. Accumulates
    and collects hold the receiver's mutex, so a push is collected exactly
    once, wholly. With every agent stepping together (or zero delays in the
    simulation) this is :func:`push_sum` (on a graph where every :math:`p_i`
    stays 1, e.g. a regular one; otherwise it differs by the scaling of the
    update).

    **Stragglers cannot drive the weights to zero.** An agent that steps
    :math:`m` times while its out-neighbours never collect would hold
    :math:`a_i^m` of its mass (underflow: 0/0 = NaN after about 80 steps in
    float32, 650 in float64). So an agent whose weight is below
    :math:`p_{\min}` (:func:`min_push_weight`, about 1e-19 in float32) keeps
    its share (:math:`g_i = 0`) and trains on its own until mass comes back;
    then :math:`p_i \ge a_i p_{\min}` always. Keeping a share is still a
    column-stochastic step, so the average stays exact. The numerator and the
    weight are kept in float32 or wider (:func:`mass_dtype`; bfloat16 or
    float16 parameters get float32 mass, cast back for ``params``).

    ``init`` creates the window ``name`` (collective) over
    ``(numerator, weight)``: call it once per agent, and
    ``jaxfog.win_free(name)`` at the end. What has landed but is not yet
    collected is collected by
    ``win_update_then_collect((state.numerator, state.weight), name)``
    (every agent's sum over numerators and weights is then the exact total).
    ``topology`` must be a static :class:`~jaxfog.topology.Topology`
    (default: the current one, read at every call; its window is made for
    the graph ``init`` sees).

    Example::

        optimizer = jaxfog.optax.async_push_sum(optax.sgd(0.1), name="sgp")
        opt_state = optimizer.init(params)  # creates the window "sgp"
        updates, opt_state = optimizer.update(grads, opt_state, params)  # waits for nobody
        params = optax.apply_updates(params, updates)
        jaxfog.win_free("sgp")  # at the end

    References:
      Assran, Loizou, Ballas, Rabbat. *Stochastic Gradient Push for
      Distributed Deep Learning*. ICML, 2019 (asynchronous variant).

      Ying et al. *BlueFog*, 2021 (section IV, asynchronous push-sum).
    """
    what = "jaxfog.optax.async_push_sum"
    V.transformation(what, "inner", inner)
    V.text(what, "name", name)
    V.topology(what, topology, schedule=False)

    def graph():
        graph = runtime.load_topology() if topology is None else topology
        if not isinstance(graph, T.Topology):
            raise TypeError("jaxfog.optax.async_push_sum: needs a static Topology, got "
                            f"{type(graph).__name__}")
        return graph

    def init(params: optax.Params) -> AsyncPushSumState:
        n = graph().size
        numerator = jax.tree.map(lambda v: jnp.asarray(v, mass_dtype(jnp.result_type(v))),
                                 params)
        weight = jnp.ones([], jax.dtypes.canonicalize_dtype(jnp.float64))
        win_create((numerator, weight), name, zero_init=True,
                   src_ranks=None if topology is None else range(n))
        return AsyncPushSumState(inner.init(params), numerator, weight)

    def update(grads: optax.Updates, state: AsyncPushSumState, params: optax.Params | None = None,
               **extra: Any) -> tuple[optax.Updates, AsyncPushSumState]:
        need_params("async_push_sum", params)
        u, inner_state = inner.update(grads, state.inner, params, **extra)
        p = state.weight
        x = jax.tree.map(lambda v, d: v + p.astype(v.dtype) * d.astype(v.dtype),
                         state.numerator, u)
        mass = (x, p)
        floor = min_push_weight([jnp.result_type(v) for v in jax.tree.leaves(mass)])
        give = p >= floor
        # Nothing (zeros) is pushed below the floor; the whole mass is then kept.
        pushed = jax.tree.map(lambda v: jnp.where(give, v, jnp.zeros_like(v)), mass)
        # Rank-indexed tables: every backend takes this rank's row.
        self_share, push_shares = _push_shares(graph())
        kept = win_accumulate(pushed, name, self_weight=self_share, dst_weights=push_shares,
                              require_mutex=True)
        kept = jax.tree.map(lambda k, v: jnp.where(give, k, v), kept, mass)
        x, p = win_update_then_collect(kept, name)
        z = jax.tree.map(lambda v, w: (v / p.astype(v.dtype)).astype(w.dtype), x, params)
        return sub(z, params), AsyncPushSumState(inner_state, x, p)

    return optax.GradientTransformationExtraArgs(init, update)


class PushDigingState(NamedTuple):
    """State of :func:`push_diging`."""

    #: The numerator :math:`x^k` (the parameters after ``init``).
    numerator: Tree
    #: The push-sum weight :math:`w^k` (see :class:`PushSumState`); 1 after ``init``.
    weight: jax.Array
    #: The tracker :math:`y^{k-1}` of the last step (zeros after ``init``).
    tracker: Tree
    #: The gradient :math:`g^{k-1}` of the last step (zeros after ``init``).
    prev_grads: Tree
    #: Number of ``update`` calls so far (an int32 scalar); picks a ``Schedule``'s entry.
    count: jax.Array  # type: ignore[assignment]  # optax's name; shadows tuple.count


@mixes_parameters
def push_diging(learning_rate: float | optax.Schedule, *, topology: Any = None
                ) -> optax.GradientTransformationExtraArgs:
    r"""Push-DIGing: gradient tracking with push-sum weights, for directed graphs.

    .. math::

        y_i^k &= \sum_j P_{ij} \left( y_j^{k-1} + g_j^k - g_j^{k-1} \right),
        \qquad y^{-1} = g^{-1} = 0, \\
        x_i^{k+1} &= \sum_j P_{ij} \left( x_j^k - a\, y_j^k \right),
        \qquad w_i^{k+1} = \sum_j P_{ij}\, w_j^k, \\
        z_i^{k+1} &= x_i^{k+1} / w_i^{k+1},
        \qquad x_i^0 = z_i^0, \quad w_i^0 = 1,

    where :math:`z_i^k` are the parameters agent :math:`i` sees (``params``),
    :math:`g_i^k` its local gradient at :math:`z_i^k`, :math:`y_i^k` the
    tracker, :math:`x_i^k` the numerator, :math:`w_i^k` the push-sum weight,
    :math:`a` the learning rate and :math:`P` the column-stochastic weights
    of :func:`column_stochastic` on ``topology``'s edges, as in
    :func:`push_sum` (the paper writes :math:`u, v, x` for :math:`x, w, z`).
    :math:`P` preserves the sums over the agents, so the trackers' sum is the
    sum of the gradients, and on a strongly connected graph the iterates
    converge to the exact optimum of :math:`\sum_i f_i` with a constant step
    size. As in :func:`gradient_tracking`, the tracker is mixed after the
    gradient correction is added (the paper adds it after mixing). Two
    neighbour exchanges per step (:math:`y`, then :math:`x` and :math:`w` in
    one message).

    Args:
      learning_rate: the step size :math:`a`: a number, or an optax schedule
        (a function of the step count :math:`k`).
      topology: as for :func:`push_sum`.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`PushDigingState` (:math:`x`, :math:`w`, the tracker, the last
      gradient and the step counter). ``update(grads, state, params)`` needs
      ``params`` (``ValueError`` without), ignores extra keyword arguments and
      returns :math:`z_i^{k+1} - z_i^k`. The iterate lives in the state: pass
      the parameters the previous updates produced. Use it alone or after
      gradient-only transformations such as clipping.

    Example::

        optimizer = jaxfog.optax.push_diging(
            0.01, topology=jaxfog.topology.exponential(jaxfog.size()))  # directed
        opt_state = optimizer.init(params)
        # ... then the jitted train step of the module docstring

    References:
      Nedić, Olshevsky, Shi. *Achieving Geometric Convergence for Distributed
      Optimization over Time-Varying Graphs*. SIAM Journal on Optimization,
      2017.

      Ying, Yuan, Hu, Chen, Yin. *BlueFog: Make Decentralized Algorithms
      Practical for Optimization and Deep Learning*. arXiv:2111.04287, 2021,
      appendix B.
    """
    learning_rate = V.learning_rate("jaxfog.optax.push_diging", learning_rate)
    V.topology("jaxfog.optax.push_diging", topology)
    def init(params: optax.Params) -> PushDigingState:
        zeros = jax.tree.map(jnp.zeros_like, params)
        return PushDigingState(params, _unit_weight(), zeros, zeros,
                               jnp.zeros([], jnp.int32))

    def update(grads: optax.Updates, state: PushDigingState, params: optax.Params | None = None,
               **extra: Any) -> tuple[optax.Updates, PushDigingState]:
        need_params("push_diging", params)
        push = _push_topology(topology)
        y = average(jax.tree.map(lambda y, g, h: y + g - h, state.tracker, grads,
                                  state.prev_grads), push, state.count, "push_diging")
        lr = V.step_size(learning_rate, state.count)
        stepped = jax.tree.map(lambda u, t: u - lr * t, state.numerator, y)
        numerator, weight = average((stepped, state.weight), push, state.count, "push_diging")
        x = jax.tree.map(lambda u: u / weight.astype(u.dtype), numerator)
        return sub(x, params), PushDigingState(numerator, weight, y, grads, state.count + 1)

    return optax.GradientTransformationExtraArgs(init, update)


__all__ = ["AsyncPushSumState", "PushDigingState", "PushSumState", "async_push_sum",
           "column_stochastic", "mass_dtype", "min_push_weight", "push_diging", "push_sum"]
