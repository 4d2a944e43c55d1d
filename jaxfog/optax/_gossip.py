r"""What the compressed optimizers share (private): who talks to whom, the
public copies and their mixing, argument checks, keys, and error feedback.

:mod:`jaxfog.optax.compressed` (CHOCO, BEER), :mod:`jaxfog.optax.diffusion`
(``awc`` and ``gradient_allreduce`` with a compressor) and
:mod:`jaxfog.optax.local_sgd` (DiLoCo with a compressor) build on these.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxfog import _validate as V
from jaxfog import compress as C
from jaxfog import runtime
from jaxfog import topology as T
from jaxfog.ops import allgather, neighbor_allgather

Tree = Any
Parts = list  # one array per group of leaves (jaxfog.compress.merge)

# --- who talks to whom --------------------------------------------------------


class Links(NamedTuple):
    """The union graph of a topology or schedule, and its weights per step."""

    #: ``sources[i]``: agent i's in-neighbours over the period, ascending.
    sources: list[list[int]]
    #: ``dests[i]``: its out-neighbours over the period.
    dests: list[list[int]]
    #: ``weights[t, i, m] = W_t[i, sources[i][m]]``, padded with zeros to the
    #: largest in-degree (simulated agents pad their sources with themselves).
    weights: np.ndarray


def links(topology: Any) -> Links:
    graph = runtime.load_topology() if topology is None else topology
    entries = list(graph) if isinstance(graph, T.Schedule) else [graph]
    if not entries or not all(isinstance(t, T.Topology) for t in entries):
        raise TypeError(f"expected a Topology or Schedule, got {type(graph).__name__}")
    n = entries[0].size
    edges = np.zeros((n, n), bool)
    for t in entries:
        edges |= t.weights != 0
    np.fill_diagonal(edges, False)
    sources = [list(np.flatnonzero(edges[i])) for i in range(n)]
    dests = [list(np.flatnonzero(edges[:, i])) for i in range(n)]
    k = max(1, max(len(s) for s in sources))
    weights = np.zeros((len(entries), n, k))
    for p, t in enumerate(entries):
        for i in range(n):
            weights[p, i, :len(sources[i])] = t.weights[i, sources[i]]
    return Links([[int(j) for j in s] for s in sources], [[int(j) for j in d] for d in dests],
                 weights)


def degree(links: Links) -> int:
    """How many neighbour copies every agent keeps (the largest in-degree;
    an agent with fewer pads with copies of itself, weight 0)."""
    return links.weights.shape[2]


def row(links: Links, count: jax.Array) -> jax.Array:
    """This agent's weights for its copies at step ``count``."""
    table = links.weights
    return jnp.asarray(table)[count % table.shape[0], runtime.rank()]


def sources_table(links: Links) -> np.ndarray:
    """Rank-indexed (n, k) table: row i lists agent i's sources, padded with i."""
    k = links.weights.shape[2]
    return np.array([s + [i] * (k - len(s)) for i, s in enumerate(links.sources)],
                    dtype=np.int32)


def exchange(links: Links, payloads: Sequence[C.Payload]) -> list[C.Payload]:
    """The in-neighbours' payloads, each batched on a leading axis (one
    message per peer for all groups; padding entries are the agent's own)."""
    got = neighbor_allgather(list(payloads), src_ranks=sources_table(links))
    return [C.unstack(g, p) for g, p in zip(got, payloads)]


# --- public copies ---------------------------------------------------------------


class PublicCopies(NamedTuple):
    """Public copies of one compressed quantity, per group of leaves (in the
    state of :func:`choco` and :func:`beer`)."""

    #: :math:`\hat x_i`, this agent's public copy.
    own: Parts
    #: :math:`\hat x_j` of the in-neighbours, stacked on axis 0 per group.
    neighbors: Parts
    #: The last payloads sent (warm start of low-rank), else ``()``.
    warm: tuple


def copies(compressor: C.Compressor, parts: Parts, k: int) -> PublicCopies:
    zeros = [jnp.zeros_like(p) for p in parts]
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    # A zero warm payload: low-rank then starts cold from its key.
    warm = (tuple(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                               jax.eval_shape(compressor.compress, z, key)) for z in zeros)
            if compressor.warm_start else ())
    return PublicCopies(zeros, [jnp.zeros((k, *p.shape), p.dtype) for p in parts], warm)


def compress(compressor: C.Compressor, target: Parts, state: PublicCopies, key: jax.Array
             ) -> list[C.Payload]:
    """Payloads of ``target - own copy``, group by group."""
    diff = [t - h for t, h in zip(target, state.own)]
    return C.compress_groups(compressor, diff, key, state.warm or None)


def receive(compressor: C.Compressor, state: PublicCopies, mine: Sequence[C.Payload],
            theirs: Sequence[C.Payload]) -> PublicCopies:
    """Adds every decompressed difference to its copy."""
    own = [h + compressor.decompress(p) for h, p in zip(state.own, mine)]
    neighbors = [h + jax.vmap(compressor.decompress)(p)
                 for h, p in zip(state.neighbors, theirs)]
    return PublicCopies(own, neighbors, tuple(mine) if state.warm else ())


def weighted_differences(weights: jax.Array, own: Parts, neighbors: Parts) -> Parts:
    r""":math:`\sum_j W_{ij} (\hat x_j - \hat x_i)` per group, the in-neighbours'
    values stacked on axis 0 of each group."""
    return [jnp.tensordot(weights.astype(h.dtype), n, axes=1) - jnp.sum(weights).astype(h.dtype) * h
            for h, n in zip(own, neighbors)]


def mixing(state: PublicCopies, weights: jax.Array) -> Parts:
    r""":math:`\sum_j W_{ij} (\hat x_j - \hat x_i)` over the public copies."""
    return weighted_differences(weights, state.own, state.neighbors)


def gossip_round(compressor: C.Compressor, links_: Links, target: Parts, state: PublicCopies,
                 key: jax.Array, count: jax.Array) -> tuple[Parts, PublicCopies]:
    r"""One round of CHOCO's gossip: ``C(target - own copy)`` sent to the
    out-neighbours, every copy updated, then :math:`\sum_j W_{ij} (\hat x_j -
    \hat x_i)` with step ``count``'s weights, and the new copies."""
    mine = compress(compressor, target, state, key)
    state = receive(compressor, state, mine, exchange(links_, mine))
    return mixing(state, row(links_, count)), state



# --- argument checks ----------------------------------------------------------------


def check_compressor(what: str, compressor: Any) -> C.Compressor:
    if not isinstance(compressor, C.Compressor):
        raise TypeError(f"jaxfog.optax.{what}: compressor must be a jaxfog.compress "
                        f"Compressor, got {type(compressor).__name__}")
    return compressor


def check_gamma(what: str, gamma: Any) -> float:
    return V.real(f"jaxfog.optax.{what}", "gamma", gamma, low=0.0, high=1.0, low_open=True)


def check_options(what: str, groups: Any, seed: Any) -> None:
    """``groups`` (None, an int >= 1, a SearchResult or a sequence of (start,
    stop) pairs) and ``seed`` (an int), checked when a transformation is made."""
    what = f"jaxfog.optax.{what}"
    V.integer(what, "seed", seed)
    if isinstance(groups, numbers.Integral) or isinstance(groups, (bool, np.bool_)):
        V.integer(what, "groups", groups, minimum=1)
    elif groups is not None and not isinstance(groups, C.SearchResult) and (
            isinstance(groups, (str, bytes)) or not hasattr(groups, "__iter__")):
        raise TypeError(f"{what}: groups must be None, a number of groups, a "
                        "jaxfog.compress.SearchResult or a sequence of (start, stop) pairs, "
                        f"got {type(groups).__name__} {groups!r}")


def resolve_groups(compressor: C.Compressor, tree: Tree, groups: Any) -> C.Groups:
    """``None``: one group per leaf; an int ``y``: :func:`~jaxfog.compress.balanced`;
    else the groups themselves (e.g. :func:`~jaxfog.compress.search`'s)."""
    if groups is None:
        groups = C.per_leaf(tree)
    elif isinstance(groups, int) and not isinstance(groups, bool):
        groups = C.balanced(tree, groups)
    elif isinstance(groups, C.SearchResult):
        groups = groups.groups
    return C.check_groups(compressor, tree, groups)


class Layout(NamedTuple):
    """How a transformation's compressed values travel for one ``params``
    structure: the groups of leaves, and the graph (``None`` for the
    allreduce)."""

    groups: C.Groups
    links: Links | None


def layout(topology: Any, compressor: C.Compressor, params: Tree, groups: Any,
           *, neighbors: bool = True) -> Layout:
    """The groups for ``params``' structure and, unless ``neighbors=False``,
    the links of ``topology`` (``None``: the current one). Worked out from the
    arguments at every call (at trace time under ``jit``), so ``init`` and
    ``update`` keep nothing between calls."""
    return Layout(resolve_groups(compressor, params, groups),
                  links(topology) if neighbors else None)


def check_degree(what: str, copies_: PublicCopies, links_: Links) -> None:
    """The state's copies were made for the graph of ``links_``: a topology
    that changed since ``init`` (``topology=None`` follows the runtime's) is
    an error, not a shape mismatch deep in the update."""
    held = copies_.neighbors[0].shape[0] if copies_.neighbors else degree(links_)
    if held != degree(links_):
        raise ValueError(f"jaxfog.optax.{what}: the state holds copies of {held} "
                         f"in-neighbours but the topology now has {degree(links_)}; the "
                         "topology changed since init(): call init() again")


def agent_key(seed: int) -> jax.Array:
    """This agent's base key (raw uint32 words): ``fold_in(PRNGKey(seed), rank)``."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), runtime.rank())


def step_key(key: jax.Array, count: jax.Array) -> jax.Array:
    return jax.random.fold_in(key, count)


# --- error feedback for gradient_allreduce and awc ---------------------------------------


class ErrorFeedbackState(NamedTuple):
    """State of :func:`~jaxfog.optax.gradient_allreduce` and
    :func:`~jaxfog.optax.awc` with a compressor."""

    #: The wrapped transformation's state.
    inner: optax.OptState
    #: The residual :math:`e` (what compression left out so far), per group.
    residual: Parts
    #: This agent's base key (raw uint32 words).
    key: jax.Array
    #: Number of ``update`` calls so far (an int32 scalar).
    count: jax.Array  # type: ignore[assignment]  # optax's name; shadows tuple.count


def feedback(compressor: C.Compressor, groups: C.Groups, value: Tree,
             state: ErrorFeedbackState) -> tuple[list[C.Payload], Parts]:
    r"""EF: :math:`p = v + e`, payload :math:`C(p)`, new residual :math:`p - C(p)`."""
    p = [v + e for v, e in zip(C.merge(value, groups), state.residual)]
    payloads = C.compress_groups(compressor, p, step_key(state.key, state.count))
    residual = [a - compressor.decompress(q) for a, q in zip(p, payloads)]
    return payloads, residual


def feedback_init(groups: C.Groups, params: Tree, inner_state: Any, seed: int
                  ) -> ErrorFeedbackState:
    """The state after ``init``: zero residuals, one per group."""
    zeros = [jnp.zeros_like(p) for p in C.merge(params, groups)]
    return ErrorFeedbackState(inner_state, zeros, agent_key(seed), jnp.zeros([], jnp.int32))


def mean_of_all(compressor: C.Compressor, payloads: list[C.Payload]) -> Parts:
    """The average over all agents of the decompressed payloads (one allgather)."""
    got = allgather(payloads)
    return [jax.vmap(compressor.decompress)(C.unstack(g, p)).mean(0)
            for g, p in zip(got, payloads)]


def neighbor_mix(compressor: C.Compressor, graph: Links, payloads: list[C.Payload],
                 count: jax.Array) -> Parts:
    r""":math:`\sum_j W_{ij} (\hat y_j - \hat y_i)` with :math:`\hat y = C(\cdot)`
    decompressed, over ``graph``'s sources."""
    theirs = exchange(graph, payloads)
    return weighted_differences(row(graph, count),
                                [compressor.decompress(p) for p in payloads],
                                [jax.vmap(compressor.decompress)(p) for p in theirs])
