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
``jax.eval_shape`` (which starts nothing), with zero arrays: handle id 0 on MPI
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

import dataclasses
import functools
import numbers
from typing import Any, Callable, NamedTuple, cast

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
    #: idle handle (handle id 0, zeros) when none is; ``()`` with ``delay=0``.
    handles: tuple
    #: Whether fragment :math:`p`'s exchange is in flight (bool, one per fragment).
    pending: jax.Array
    #: The error-feedback residual per fragment (a list per group of leaves),
    #: or ``()`` without a compressor.
    residual: tuple
    #: This agent's base key of the compressor (raw uint32 words).
    key: jax.Array
    #: Number of ``update`` calls so far (an int32 scalar).
    count: jax.Array  # type: ignore[assignment]  # optax's name; shadows tuple.count


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
        structure: Any = jax.tree.structure(given)  # jaxlib 0.10 gives no stubs for PyTreeDef
        same = structure == jax.tree.structure(params)
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
        if not 0 <= cast(int, label) < fragments:  # an Integral: typeshed's has no __ge__
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



# --- one fragment's step -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The arguments of :func:`streaming_diloco`, checked, and the steps (mod
    ``every``) at which each fragment starts its exchange."""

    inner: optax.GradientTransformation
    outer: optax.GradientTransformation
    every: int
    fragments: int
    delay: int
    alpha: float
    fragment_of: Any
    compressor: C.Compressor | None
    groups: Any
    seed: int
    starts: tuple[int, ...]


class _Fragment(NamedTuple):
    r"""What one fragment's branch reads and returns (the operands of its
    ``lax.switch``): its leaves of :math:`\theta` and :math:`\phi`, its outer
    state, its handle (``()`` with ``delay=0``), whether its exchange is in
    flight, and its residual (``()`` without a compressor)."""

    theta: list
    anchor: list
    outer: optax.OptState
    handle: Any
    pending: jax.Array
    residual: Any


def _plan(compressor: C.Compressor, groups: Any, part: list) -> Any:
    return G.layout(None, compressor, part, groups, neighbors=False).groups


def _message(s: _Settings, delta: list, residual: Any, key: jax.Array, r: Any, p: int
             ) -> tuple[Any, Any]:
    """(what to send, new residual): the dense pseudo-gradient, or its payloads
    with error feedback (key of sync number ``r`` of fragment ``p``)."""
    if s.compressor is None:
        return delta, residual
    q = [d + e for d, e in zip(C.merge(delta, _plan(s.compressor, s.groups, delta)), residual)]
    payloads = C.compress_groups(s.compressor, q, G.step_key(key, r * s.fragments + p))
    return payloads, [a - s.compressor.decompress(b) for a, b in zip(q, payloads)]


def _start(s: _Settings, message: Any) -> Any:
    if s.compressor is None:
        return allreduce_nonblocking(message, name=_WHAT)
    return allgather_nonblocking(message, name=_WHAT)


def _blocking(s: _Settings, message: Any) -> Any:
    if s.compressor is None:
        return allreduce(message, name=_WHAT)
    return allgather(message, name=_WHAT)


def _mean(s: _Settings, received: Any, message: Any, like: list) -> list:
    """The mean pseudo-gradient from what the exchange gave."""
    if s.compressor is None:
        return received
    parts = [jax.vmap(s.compressor.decompress)(C.unstack(g, q)).mean(0)
             for g, q in zip(received, message)]
    return C.split(parts, like, _plan(s.compressor, s.groups, like))


def _message_like(s: _Settings, part: list, residual: Any) -> Any:
    """A message's structure (for the idle handle and the decompression)."""
    return jax.eval_shape(lambda d, e: _message(s, d, e, jax.random.PRNGKey(0), 0, 0)[0],
                          part, residual)


def _outer_step(s: _Settings, mean: list, frag: _Fragment) -> _Fragment:
    r"""The outer step on :math:`\phi_p` and the merge into :math:`\theta_p`."""
    v, outer_state = s.outer.update(mean, frag.outer, frag.anchor)
    anchor = optax.apply_updates(frag.anchor, v)
    if s.alpha == 0.0:
        theta = list(anchor)
    else:
        theta = [s.alpha * a + (1.0 - s.alpha) * b for a, b in zip(frag.theta, anchor)]
    return frag._replace(theta=theta, anchor=anchor, outer=outer_state)


def _nothing(frag: _Fragment) -> _Fragment:
    return frag


def _sync_now(s: _Settings, key: jax.Array, r: Any, p: int, frag: _Fragment) -> _Fragment:
    """``delay=0``: the exchange started, waited for and its outer step taken at once."""
    delta = [a - b for a, b in zip(frag.anchor, frag.theta)]
    message, residual = _message(s, delta, frag.residual, key, r, p)
    mean = _mean(s, _blocking(s, message), message, delta)
    return _outer_step(s, mean, frag._replace(residual=residual))


def _begin_exchange(s: _Settings, key: jax.Array, r: Any, p: int, frag: _Fragment
                    ) -> _Fragment:
    """The start branch: the exchange of the pseudo-gradient started, its handle kept."""
    delta = [a - b for a, b in zip(frag.anchor, frag.theta)]
    message, residual = _message(s, delta, frag.residual, key, r, p)
    return frag._replace(handle=_start(s, message), pending=jnp.array(True),
                         residual=residual)


def _end_exchange(s: _Settings, frag: _Fragment) -> _Fragment:
    """The finish branch: the handle waited for, the outer step taken, an idle
    handle in its place."""
    like = [jnp.zeros_like(a) for a in frag.anchor]
    message = _message_like(s, like, frag.residual)
    mean = _mean(s, wait(frag.handle), message, like)
    frag = _outer_step(s, mean, frag)
    return frag._replace(handle=_idle(functools.partial(_start, s), message),
                         pending=jnp.array(False))


def _fragment_step(s: _Settings, frag: _Fragment, p: int, t: jax.Array, key: jax.Array
                   ) -> _Fragment:
    """Fragment ``p``'s branch at step ``t`` (counted from 1): nothing, start or
    finish (``delay=0``: nothing or sync)."""
    o = s.starts[p]
    r = (t - o) // s.every  # the fragment's sync number at a sync step
    sync = (t - o) % s.every == 0
    if s.delay == 0:
        sync_now = functools.partial(_sync_now, s, key, r, p)
        return sync_now(frag) if s.every == 1 else lax.cond(sync, sync_now, _nothing, frag)
    due = (t - s.delay >= o) & ((t - s.delay - o) % s.every == 0) & frag.pending
    branch = jnp.where(sync, 1, jnp.where(due, 2, 0))
    return lax.switch(branch, [_nothing, functools.partial(_begin_exchange, s, key, r, p),
                               functools.partial(_end_exchange, s)], frag)


def _fragment_finish(s: _Settings, frag: _Fragment) -> _Fragment:
    """:meth:`StreamingDiLoCo.finish`'s branch: the finish of an exchange in flight."""
    if not s.delay:  # with delay 0 nothing is ever in flight
        return frag
    return lax.cond(frag.pending, functools.partial(_end_exchange, s), _nothing, frag)


def _all_fragments(s: _Settings, theta: Tree, state: StreamingDiLoCoState, *,
                   inner_step: bool) -> tuple[Tree, StreamingDiLoCoState]:
    """Runs every fragment's branch for this step (``inner_step``) or, for
    ``finish``, the finish branch of every fragment in flight."""
    frags = _assignment(theta, s.fragments, s.fragment_of)
    th, treedef = jax.tree.flatten(theta)
    an = jax.tree.leaves(state.anchor)
    t = state.count + 1 if inner_step else state.count  # steps taken, counted from 1
    done = []
    for p, f in enumerate(frags):
        frag = _Fragment(_take(th, f), _take(an, f), state.outer[p],
                         state.handles[p] if s.delay else (), state.pending[p],
                         state.residual[p] if s.compressor is not None else ())
        frag = (_fragment_step(s, frag, p, t, state.key) if inner_step
                else _fragment_finish(s, frag))
        _put(th, f, frag.theta)
        _put(an, f, frag.anchor)
        done.append(frag)
    new_state = state._replace(
        outer=tuple(d.outer for d in done), anchor=jax.tree.unflatten(treedef, an),
        handles=tuple(d.handle for d in done) if s.delay else state.handles,
        pending=jnp.stack([d.pending for d in done]),
        residual=(tuple(d.residual for d in done) if s.compressor is not None
                  else state.residual))
    return jax.tree.unflatten(treedef, th), new_state


# --- init, update and finish ---------------------------------------------------------


def _init(s: _Settings, params: Tree) -> StreamingDiLoCoState:
    leaves = jax.tree.leaves(params)
    parts = [_take(leaves, f) for f in _assignment(params, s.fragments, s.fragment_of)]
    residual: tuple[list[jax.Array], ...] = ()
    if s.compressor is not None:
        residual = tuple([jnp.zeros_like(g)
                          for g in C.merge(part, _plan(s.compressor, s.groups, part))]
                         for part in parts)
    handles = ()
    if s.delay:
        handles = tuple(_idle(functools.partial(_start, s),
                              _message_like(s, part, residual[p] if residual else ()))
                        for p, part in enumerate(parts))
    return StreamingDiLoCoState(
        s.inner.init(params), tuple(s.outer.init(part) for part in parts), params, handles,
        jnp.zeros([s.fragments], jnp.bool_), residual, G.agent_key(s.seed),
        jnp.zeros([], jnp.int32))


class _Update:
    """:func:`streaming_diloco`'s ``update``, with the ``finish`` that
    :meth:`StreamingDiLoCo.finish` calls."""

    def __init__(self, settings: _Settings):
        self.settings = settings

    def __call__(self, grads: Tree, state: StreamingDiLoCoState, params: Tree = None,
                 **extra: Any) -> tuple[Tree, StreamingDiLoCoState]:
        s = self.settings
        need_params("streaming_diloco", params)
        u, inner_state = s.inner.update(grads, state.inner, params, **extra)
        theta = optax.apply_updates(params, u)
        theta, state = _all_fragments(s, theta, state, inner_step=True)
        updates = jax.tree.map(lambda a, b: a - b, theta, params)
        return updates, state._replace(inner=inner_state, count=state.count + 1)

    def finish(self, state: StreamingDiLoCoState, params: Tree
               ) -> tuple[Tree, StreamingDiLoCoState]:
        need_params("streaming_diloco", params)
        theta, state = _all_fragments(self.settings, params, state, inner_step=False)
        return jax.tree.map(lambda a, b: a - b, theta, params), state


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
    starts = tuple(o - delay if phase == "merge" else o
                   for o in streaming_offsets(every, fragments))
    settings = _Settings(inner, outer, every, fragments, delay, alpha, fragment_of,
                         compressor, groups, seed, starts)
    return StreamingDiLoCo(functools.partial(_init, settings), _Update(settings))


for _cls in (StreamingDiLoCoState, StreamingDiLoCo):
    _cls.__module__ = "jaxfog.optax"  # documented (and exported) there


__all__ = ["StreamingDiLoCo", "StreamingDiLoCoState", "streaming_diloco", "streaming_offsets"]
