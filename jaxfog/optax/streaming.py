r"""Streaming DiLoCo as an optax transformation (exported by :mod:`jaxfog.optax`).

DiLoCo (:func:`jaxfog.optax.diloco`) with the parameters split into fragments
that are synchronised in turn, each fragment's exchange overlapping the next
inner steps: the pseudo-gradient's mean is started with
:func:`jaxfog.allreduce_nonblocking` at one step, carried in the optimizer's
state as a :class:`jaxfog.Handle`, and waited for ``delay`` steps later.

How the handles live in the state. The state holds one :class:`jaxfog.Handle`
per fragment, always, so that its pytree structure is the same at every step
(``lax.scan`` carries it, ``jit`` compiles one step). At every step and for
every fragment a ``lax.switch`` on the step counter picks one of three
branches, the same on every rank since the counter is:

* nothing: the handle passes through;
* start (the fragment's sync step): a new exchange is started, its handle
  replaces the old one;
* finish (``delay`` steps later): the handle is waited for, the outer step
  and the merge are taken, and an idle handle takes its place.

All three branches return a handle of one structure: the result's treedef,
shapes and dtypes are those of the fragment, whatever the branch. A slot
with no exchange in flight (before the fragment's first sync, and after each
finish) holds an *idle* handle: the structure of the start's handle, from
``jax.eval_shape`` (which starts nothing), with zero arrays: ticket 0 on MPI
processes, which waits for nothing and gives zeros, and zeros on simulated
agents. So every handle in the state is either in flight or idle, never one
already waited for: :func:`jaxfog.wait_all` on the state is safe (it drops
the exchanges in flight). A boolean per fragment, ``pending``, says whether
an exchange is in flight; the finish branch runs only when it is set, which
makes :meth:`StreamingDiLoCo.finish` (wait for everything in flight now and
take those outer steps, e.g. at the end of training or before a checkpoint)
safe to call and to train on after. Every started handle is waited for once:
by the step ``delay`` later, or by ``finish``.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxfog import _validate as V
from jaxfog import compress as C
from jaxfog.ops import allgather, allgather_nonblocking, allreduce, allreduce_nonblocking, wait
from jaxfog.optax import _gossip as G
from jaxfog.optax._common import mixes_parameters, need_params

Tree = Any
_WHAT = "jaxfog.optax.streaming_diloco"


class StreamingDiLoCoState(NamedTuple):
    """State of :func:`streaming_diloco`."""

    #: The inner transformation's state (local: never averaged nor reset).
    inner: optax.OptState
    #: One outer state per fragment (each changes at its fragment's outer steps).
    outer: tuple
    #: :math:`\phi`, the global parameters: fragment :math:`p`'s part is the
    #: result of its last outer step (``params`` after ``init``).
    anchor: Tree
    #: One :class:`jaxfog.Handle` per fragment: its exchange in flight, or an
    #: idle handle (ticket 0, zeros) when none is; ``()`` with ``delay=0``.
    handles: tuple
    #: Whether fragment :math:`p`'s exchange is in flight (bool, one per fragment).
    pending: jax.Array
    #: The error-feedback residual per fragment (a list per group of leaves),
    #: or ``()`` without a compressor.
    residual: tuple
    #: This agent's base key of the compressor (raw uint32 words).
    key: jax.Array
    #: Number of ``update`` calls so far (an int32 scalar).
    count: jax.Array


class StreamingDiLoCo(optax.GradientTransformationExtraArgs):
    """What :func:`streaming_diloco` returns: an optax transformation with a
    :meth:`finish` method."""

    __slots__ = ()

    def finish(self, state: StreamingDiLoCoState, params: Tree
               ) -> tuple[Tree, StreamingDiLoCoState]:
        """Waits for every exchange in flight and takes its outer step and merge
        now, without an inner step.

        Returns ``(updates, state)`` as ``update`` does (apply the updates to
        ``params``). Call it, with the same ``params`` the next ``update``
        would get, at the end of training (on MPI processes a handle never
        waited for is reported at :func:`jaxfog.shutdown`) or before saving
        the state (a handle names an exchange of this process, it cannot be
        restored). Training may go on after it: a fragment it finished skips
        its scheduled finish step. Runs the same waits on every rank; jittable.
        (``jaxfog.wait_all(state)`` also leaves nothing in flight, but drops
        those exchanges instead of taking their outer steps.)
        """
        return self.update.finish(state, params)


# --- fragments -------------------------------------------------------------------


def streaming_offsets(every: int, fragments: int) -> tuple[int, ...]:
    r"""When each fragment of :func:`streaming_diloco` syncs: the offsets
    :math:`o_p = \lfloor (p + 1) H / P \rfloor`, fragment :math:`p` starting
    its exchange at the steps :math:`t = o_p, o_p + H, o_p + 2H, \dots`
    (steps counted from 1: the ``update`` call that ends step :math:`t` is the
    :math:`t`-th). The last fragment syncs at :math:`t = H, 2H, \dots`, as
    :func:`diloco` does.

    Example: ``streaming_offsets(12, 4) == (3, 6, 9, 12)``.
    """
    every = V.integer("jaxfog.optax.streaming_offsets", "every", every, minimum=1)
    fragments = V.integer("jaxfog.optax.streaming_offsets", "fragments", fragments, minimum=1)
    return tuple((p + 1) * every // fragments for p in range(fragments))


def _assignment(params: Tree, fragments: int, fragment_of: Any) -> tuple[tuple[int, ...], ...]:
    """The leaf indices (in ``jax.tree.leaves`` order) of each fragment."""
    leaves = jax.tree.leaves(params)
    n = len(leaves)
    if n < fragments:
        raise ValueError(f"{_WHAT}: fragments={fragments} but the parameters have only "
                         f"{n} leaves (a fragment is made of whole leaves)")
    if fragment_of is None:
        return tuple(tuple(range(a, b)) for a, b in C.balanced(params, fragments))
    given = fragment_of(params) if callable(fragment_of) else fragment_of
    try:
        labels = jax.tree.leaves(given)
        same = jax.tree.structure(given) == jax.tree.structure(params)
    except Exception:  # noqa: BLE001 (any failure to read the tree is the same mistake)
        labels, same = [], False
    if not same or len(labels) != n:
        raise ValueError(f"{_WHAT}: fragment_of must give one int per leaf of the "
                         f"parameters (a pytree of their structure), got {given!r}")
    out: list[list[int]] = [[] for _ in range(fragments)]
    for i, label in enumerate(labels):
        if isinstance(label, bool) or not isinstance(label, numbers.Integral):
            raise TypeError(f"{_WHAT}: fragment_of must give Python ints (a leaf's "
                            f"fragment, fixed when the step is traced), got "
                            f"{type(label).__name__} {label!r} for leaf {i}")
        if not 0 <= label < fragments:
            raise ValueError(f"{_WHAT}: fragment_of gave {label} for leaf {i}; fragments "
                             f"are numbered 0 to {fragments - 1}")
        out[int(label)].append(i)
    empty = [p for p, f in enumerate(out) if not f]
    if empty:
        raise ValueError(f"{_WHAT}: fragment_of leaves fragment(s) {empty} without leaves")
    return tuple(tuple(f) for f in out)


def _take(leaves: list, indices: tuple[int, ...]) -> list:
    return [leaves[i] for i in indices]


def _put(leaves: list, indices: tuple[int, ...], values: list) -> None:
    for i, v in zip(indices, values):
        leaves[i] = v


def _idle(start: Callable, like: Any) -> Any:
    """A handle of the structure ``start(x)`` returns for an ``x`` shaped like
    ``like``, with zero arrays; it stands in a fragment's slot before its first
    exchange and is never waited for. Tracing ``start`` under ``eval_shape``
    starts nothing."""
    shapes = jax.eval_shape(start, like)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


# --- the transformation ------------------------------------------------------------


@mixes_parameters
def streaming_diloco(inner: optax.GradientTransformation,
                     outer: optax.GradientTransformation | None = None, *, every: int,
                     fragments: int, delay: int = 1, alpha: float = 0.5,
                     fragment_of: Any = None, compressor: C.Compressor | None = None,
                     groups: Any = None, seed: int = 0, phase: str = "start"
                     ) -> StreamingDiLoCo:
    r"""Streaming DiLoCo: DiLoCo's outer step fragment by fragment, each
    fragment's exchange overlapping ``delay`` inner steps.

    The parameters are split into :math:`P` fragments (``fragments``) of
    whole leaves. Every agent keeps :math:`\phi_i`, the global parameters
    (``params`` after ``init``), and trains alone, :math:`\theta_i
    \leftarrow \theta_i + u_i` at every step. Fragment :math:`p` is
    synchronised every :math:`H` (``every``) steps, at the steps :math:`t =
    o_p, o_p + H, \dots` (counting steps from 1, :math:`o_p = \lfloor (p +
    1) H / P \rfloor`: the fragments' syncs are spread evenly over the
    :math:`H` steps). At its sync step :math:`t`, after the inner step, the
    agent starts the mean of its pseudo-gradient,

    .. math::

        \Delta_{i,p} = \phi_{i,p} - \theta_{i,p}^{t}, \qquad
        \bar\Delta_p = \frac1n \sum_j \Delta_{j,p}
            \quad \text{(started at step } t\text{)},

    and keeps training; :math:`\tau` (``delay``) steps later, after the inner
    step of step :math:`t + \tau`, it receives :math:`\bar\Delta_p` and
    takes the outer step and the merge:

    .. math::

        (v_p, s_{i,p}) &= \mathrm{outer.update}(\bar\Delta_p, s_{i,p},
            \phi_{i,p}), \qquad \phi_{i,p} \leftarrow \phi_{i,p} + v_p, \\
        \theta_{i,p}^{t+\tau} &\leftarrow \alpha\, \theta_{i,p}^{t+\tau}
            + (1 - \alpha)\, \phi_{i,p},

    with :math:`s_{i,p}` fragment :math:`p`'s outer state and :math:`\alpha`
    (``alpha``) the mixing factor: :math:`\alpha = 0` replaces the local
    fragment by the global one, as DiLoCo does; :math:`\alpha > 0` keeps
    part of what the agent learned during the :math:`\tau` overlapped steps.
    Only :math:`\Delta_p` travels (start every agent from the same
    parameters: the :math:`\phi_i` stay equal, as in :func:`diloco`), so the
    peak bytes of a step are one fragment's, :math:`1/P` of DiLoCo's with
    equal fragments, for the same total. With ``fragments=1, delay=0,
    alpha=0`` this is :func:`diloco` (the same iterates).

    The exchange is :func:`jaxfog.allreduce_nonblocking` (the mean) started
    at step :math:`t` and :func:`jaxfog.wait`-ed at step :math:`t + \tau`: on
    MPI processes the messages move on the communication thread while the
    :math:`\tau` inner steps compute; on simulated agents the mean is computed
    at the start. Its handle lives in the state between the two steps (see
    the module's docstring), so the ``update`` of every step runs the same
    communication on every rank. The steps with no sync and no finish run no
    communication op.

    Fragments: by default the leaves (in ``jax.tree.leaves`` order) in
    :math:`P` contiguous runs of about equal numbers of entries
    (:func:`jaxfog.compress.balanced`: the paper's *sequential* pattern of
    layers); a fragment is made of whole leaves, so the largest leaf bounds
    the peak. ``fragment_of`` chooses: a pytree of ints with the parameters'
    structure (leaf's fragment, ``0`` to ``P - 1``), or a function of the
    parameters returning one (it may read their structure and shapes only:
    under ``jit`` it sees tracers). The paper's *strided* pattern, leaf
    :math:`k` in fragment :math:`k \bmod P`, is::

        def strided(params):
            leaves, tree = jax.tree.flatten(params)
            return jax.tree.unflatten(tree, [k % P for k in range(len(leaves))])

    With a ``compressor`` :math:`C`, fragment :math:`p`'s pseudo-gradient is
    sent compressed with error feedback, as :func:`diloco` does
    (:math:`q = \Delta_{i,p} + e_{i,p}`, :math:`e_{i,p} \leftarrow q - C(q)`,
    :math:`\bar\Delta_p` the mean of the decompressed payloads; one
    :func:`jaxfog.allgather_nonblocking` per sync, key
    ``fold_in(fold_in(PRNGKey(seed), rank), r P + p)`` at fragment
    :math:`p`'s sync number :math:`r`).

    Args:
      inner: the local optimizer, any optax transformation; its ``update``
        receives the local gradient, its state, ``params`` and the extra
        keyword arguments given to this ``update``.
      outer: the outer optimizer, applied to each fragment's
        :math:`\bar\Delta_p` as a gradient with its own state (``None``:
        Nesterov SGD, learning rate 0.7, momentum 0.9, as :func:`diloco`).
      every: :math:`H`, the steps between two syncs of a fragment, an int >= 1.
      fragments: :math:`P`, an int in ``[1, every]`` (two fragments never
        start on the same step) and at most the number of leaves.
      delay: :math:`\tau`, the inner steps an exchange overlaps, an int in
        ``[0, every)``: a fragment's exchange is finished before its next
        one starts (``0``: the mean is waited for in the step that starts it).
      alpha: :math:`\alpha`, the merge's weight of the local fragment, in
        ``[0, 1]``; the paper studies :math:`\alpha \in \{0, 0.5\}`.
      fragment_of: ``None`` (contiguous runs of leaves), a pytree of ints or
        a function of the parameters returning one (above).
      compressor: a :class:`jaxfog.compress.Compressor` for the
        pseudo-gradients, or ``None``.
      groups: how a fragment's leaves are merged before compression, as for
        :func:`choco` (with a compressor).
      seed: seeds the compressor's keys.
      phase: where the ``delay`` steps fall around a fragment's sync step
        :math:`t = o_p + kH`. ``"start"`` (the default, as MaxText): the
        exchange starts at :math:`t` and is merged at :math:`t + \tau`, the
        equations above. ``"merge"`` (as torchft): it starts at
        :math:`t - \tau` and is merged at :math:`t`, so the last fragment is
        merged at the steps :math:`H, 2H, \dots`, as :func:`diloco` does; it
        needs :math:`\tau < \lfloor H / P \rfloor` (the first exchange
        starts at step :math:`o_0 - \tau \ge 1`), as torchft does. The two
        differ only in when each exchange runs: a configuration ported from
        torchft keeps its iterates with ``phase="merge"``.

    Returns:
      A :class:`StreamingDiLoCo`, an ``optax.GradientTransformationExtraArgs``
      whose state is a :class:`StreamingDiLoCoState`;
      ``update(grads, state, params, **extra)`` needs ``params`` and returns
      :math:`\theta_i^{k+1} - \theta_i^k` (last in a chain). Its
      ``finish(state, params)`` waits for the exchanges in flight: call it
      at the end of training and before saving the state. ``init`` builds
      the idle handles for the backend that runs: call it after
      :func:`jaxfog.init` or inside :func:`jaxfog.simulate`, like the ops.

    Raises:
      TypeError: ``inner`` or ``outer`` is not an optax transformation,
        ``every``, ``fragments`` or ``delay`` not an int, ``alpha`` not a
        number, ``compressor`` not a Compressor; ``fragment_of`` giving
        something else than ints.
      ValueError: ``every < 1``, ``fragments`` outside ``[1, every]``,
        ``delay`` outside ``[0, every)`` (with ``phase="merge"``: outside
        ``[0, every // fragments)``), ``alpha`` outside ``[0, 1]``, ``phase``
        neither ``"start"`` nor ``"merge"``;
        at ``init``, more fragments than leaves, or a ``fragment_of`` that
        does not give each leaf a fragment in ``[0, fragments)`` or leaves a
        fragment empty.

    Example::

        optimizer = jaxfog.optax.streaming_diloco(optax.adamw(1e-3), every=100,
                                                  fragments=4, delay=2, alpha=0.5)
        opt_state = optimizer.init(params)
        ...  # params, opt_state = step(params, opt_state, batch), as with diloco
        updates, opt_state = optimizer.finish(opt_state, params)
        params = optax.apply_updates(params, updates)

    References:
      Douillard, Donchev, Rush, Kale, Charles, Garrett, Teston, Lacey,
      McIlroy, Shen, Ramé, Szlam, Ranzato, Barham. *Streaming DiLoCo with
      overlapping communication: Towards a Distributed Free Lunch*.
      arXiv:2501.18512, 2025.

      Douillard et al. *DiLoCo: Distributed Low-Communication Training of
      Language Models*. arXiv:2311.08105, 2023.
    """
    V.transformation(_WHAT, "inner", inner)
    every = V.integer(_WHAT, "every", every, minimum=1)
    fragments = V.integer(_WHAT, "fragments", fragments, minimum=1)
    if fragments > every:
        raise ValueError(f"{_WHAT}: fragments must be in [1, every={every}] (one fragment "
                         f"starts its exchange per step at most), got {fragments}")
    delay = V.integer(_WHAT, "delay", delay, minimum=0)
    if delay >= every:
        raise ValueError(f"{_WHAT}: delay must be in [0, every={every}) (a fragment's "
                         f"exchange must finish before its next one starts), got {delay}")
    alpha = V.real(_WHAT, "alpha", alpha, low=0.0, high=1.0)
    if phase not in ("start", "merge"):
        raise ValueError(f"{_WHAT}: phase must be 'start' (the exchange starts at the sync "
                         f"step) or 'merge' (it is merged at the sync step), got {phase!r}")
    if phase == "merge" and delay >= every // fragments:
        raise ValueError(f"{_WHAT}: phase='merge' needs delay < every // fragments = "
                         f"{every // fragments} (the first exchange starts delay steps "
                         f"before the first sync step, {every // fragments}), got {delay}")
    if outer is None:
        outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
    V.transformation(_WHAT, "outer", outer)
    if compressor is not None:
        G.check_compressor("streaming_diloco", compressor)
        G.check_options("streaming_diloco", groups, seed)
    else:
        V.integer(_WHAT, "seed", seed)
    # The steps (mod every) at which each fragment starts its exchange.
    starts = tuple(o - delay if phase == "merge" else o
                   for o in streaming_offsets(every, fragments))

    def plan(part):
        return G.layout(None, compressor, part, groups, neighbors=False).groups

    def begin(part_delta, residual, key, r, p):
        """(what to send, new residual): the dense pseudo-gradient, or its
        payloads with error feedback."""
        if compressor is None:
            return part_delta, residual
        groups_p = plan(part_delta)
        q = [d + e for d, e in zip(C.merge(part_delta, groups_p), residual)]
        payloads = C.compress_groups(compressor, q, G.step_key(key, r * fragments + p))
        return payloads, [a - compressor.decompress(b) for a, b in zip(q, payloads)]

    def start(message):
        if compressor is None:
            return allreduce_nonblocking(message, name=_WHAT)
        return allgather_nonblocking(message, name=_WHAT)

    def mean_of(received, message, like):
        """The mean pseudo-gradient from what the exchange gave."""
        if compressor is None:
            return received
        parts = [jax.vmap(compressor.decompress)(C.unstack(g, q)).mean(0)
                 for g, q in zip(received, message)]
        return C.split(parts, like, plan(like))

    def blocking(message):
        if compressor is None:
            return allreduce(message, name=_WHAT)
        return allgather(message, name=_WHAT)

    def outer_step(mean, theta_p, anchor_p, outer_state):
        v, outer_state = outer.update(mean, outer_state, anchor_p)
        anchor_p = optax.apply_updates(anchor_p, v)
        if alpha == 0.0:
            theta_p = list(anchor_p)
        else:
            theta_p = [alpha * a + (1.0 - alpha) * b for a, b in zip(theta_p, anchor_p)]
        return theta_p, anchor_p, outer_state

    def message_like(part, residual):
        """A message's structure (for the idle handle and the decompression)."""
        return jax.eval_shape(lambda d, e: begin(d, e, jax.random.PRNGKey(0), 0, 0)[0],
                              part, residual)

    def init(params):
        frags = _assignment(params, fragments, fragment_of)
        leaves = jax.tree.leaves(params)
        parts = [_take(leaves, f) for f in frags]
        residual = ()
        if compressor is not None:
            residual = tuple([jnp.zeros_like(g) for g in C.merge(part, plan(part))]
                             for part in parts)
        handles = ()
        if delay:
            handles = tuple(_idle(start, message_like(part, residual[p] if residual else ()))
                            for p, part in enumerate(parts))
        return StreamingDiLoCoState(
            inner.init(params), tuple(outer.init(part) for part in parts), params, handles,
            jnp.zeros([fragments], jnp.bool_), residual, G.agent_key(seed),
            jnp.zeros([], jnp.int32))

    def fragment_steps(theta, state, *, inner_step: bool):
        """Runs every fragment's branch for this step (``inner_step``) or, for
        ``finish``, the finish branch of every fragment in flight."""
        frags = _assignment(theta, fragments, fragment_of)
        th, treedef = jax.tree.flatten(theta)
        an = jax.tree.leaves(state.anchor)
        t = state.count + 1 if inner_step else state.count  # steps taken, counted from 1
        outer_states, handles = list(state.outer), list(state.handles)
        residuals = list(state.residual)
        pending = [state.pending[p] for p in range(fragments)]
        for p, f in enumerate(frags):
            o = starts[p]
            ops = (_take(th, f), _take(an, f), outer_states[p],
                   handles[p] if delay else (), pending[p],
                   residuals[p] if compressor is not None else ())
            r = (t - o) // every  # the fragment's sync number at a sync step

            def nothing(ops):
                return ops

            def sync_now(ops, r=r, p=p):  # delay == 0: start, wait and step at once
                theta_p, anchor_p, outer_state, handle, flag, res = ops
                delta = [a - b for a, b in zip(anchor_p, theta_p)]
                message, res = begin(delta, res, state.key, r, p)
                mean = mean_of(blocking(message), message, delta)
                theta_p, anchor_p, outer_state = outer_step(mean, theta_p, anchor_p,
                                                            outer_state)
                return theta_p, anchor_p, outer_state, handle, flag, res

            def begin_exchange(ops, r=r, p=p):
                theta_p, anchor_p, outer_state, _, _, res = ops
                delta = [a - b for a, b in zip(anchor_p, theta_p)]
                message, res = begin(delta, res, state.key, r, p)
                return (theta_p, anchor_p, outer_state, start(message), jnp.array(True),
                        res)

            def end_exchange(ops):
                theta_p, anchor_p, outer_state, handle, _, res = ops
                like = [jnp.zeros_like(a) for a in anchor_p]
                message = message_like(like, res)
                mean = mean_of(wait(handle), message, like)
                theta_p, anchor_p, outer_state = outer_step(mean, theta_p, anchor_p,
                                                            outer_state)
                return (theta_p, anchor_p, outer_state, _idle(start, message),
                        jnp.array(False), res)

            if not inner_step:  # finish: every fragment in flight, now
                if delay:  # with delay 0 nothing is ever in flight
                    ops = lax.cond(pending[p], end_exchange, nothing, ops)
            elif delay == 0:
                sync = (t - o) % every == 0
                ops = sync_now(ops) if every == 1 else lax.cond(sync, sync_now, nothing, ops)
            else:
                sync = (t - o) % every == 0
                due = (t - delay >= o) & ((t - delay - o) % every == 0) & pending[p]
                branch = jnp.where(sync, 1, jnp.where(due, 2, 0))
                ops = lax.switch(branch, [nothing, begin_exchange, end_exchange], ops)
            theta_p, anchor_p, outer_states[p], handle, pending[p], res = ops
            _put(th, f, theta_p)
            _put(an, f, anchor_p)
            if delay:
                handles[p] = handle
            if compressor is not None:
                residuals[p] = res
        anchor = jax.tree.unflatten(treedef, an)
        new_state = state._replace(outer=tuple(outer_states), anchor=anchor,
                                   handles=tuple(handles), pending=jnp.stack(pending),
                                   residual=tuple(residuals))
        return jax.tree.unflatten(treedef, th), new_state

    def update(grads, state, params=None, **extra):
        need_params("streaming_diloco", params)
        u, inner_state = inner.update(grads, state.inner, params, **extra)
        theta = optax.apply_updates(params, u)
        theta, state = fragment_steps(theta, state, inner_step=True)
        updates = jax.tree.map(lambda a, b: a - b, theta, params)
        return updates, state._replace(inner=inner_state, count=state.count + 1)

    def finish(state, params):
        need_params("streaming_diloco", params)
        theta, state = fragment_steps(params, state, inner_step=False)
        return jax.tree.map(lambda a, b: a - b, theta, params), state

    update.finish = finish
    return StreamingDiLoCo(init, update)


for _cls in (StreamingDiLoCoState, StreamingDiLoCo):
    _cls.__module__ = "jaxfog.optax"  # documented (and exported) there


__all__ = ["StreamingDiLoCo", "StreamingDiLoCoState", "streaming_diloco", "streaming_offsets"]
