"""MergeComp's search for the grouping: times balanced groupings of a pytree's
leaves, one compiled exchange round each, and keeps the fastest. It measures,
so it communicates and reads the clock; the compressors and groups do not."""

from __future__ import annotations

import numbers
import time
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxfog import _validate as V
from jaxfog import runtime
from jaxfog.compress.compressors import Compressor, _check_compressor
from jaxfog.compress.groups import Groups, balanced, compress_groups, merge, per_leaf, unstack
from jaxfog.ops import allreduce, neighbor_allgather

Tree = Any

class SearchResult(NamedTuple):
    """What :func:`search` chose and what it measured."""

    #: The chosen grouping.
    groups: Groups
    #: ``(y, seconds)`` for every grouping timed, in the order timed.
    timings: tuple[tuple[int, float], ...]


_SEARCHES: dict[Any, SearchResult] = {}


def _signature(compressor: Compressor, tree: Tree) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    return (compressor.name, str(treedef),
            tuple((tuple(np.shape(x)), str(jnp.result_type(x))) for x in leaves),
            runtime.size() if runtime.is_initialized() else None)


def exchange_timer(compressor: Compressor, tree: Tree, *, repeats: int = 5,
                   fused: bool = True) -> Callable:
    """``timer(groups) -> seconds``: the median time of one compiled round of
    compressing ``tree`` in ``groups``, exchanging the payloads with the
    in-neighbours (:func:`jaxfog.neighbor_allgather`) and decompressing them.
    On MPI every rank returns the mean over ranks, so all choose alike;
    without :func:`jaxfog.init` (e.g. before a simulation) it times
    compression and decompression alone.

    ``fused=True`` sends all groups' payloads in one message per peer, as
    jaxfog's compressed optimizers do; ``fused=False`` sends one message per
    group, MergeComp's setting (each group is its own communication, so that
    it can start as soon as its gradients exist).
    """
    what = "exchange_timer"
    _check_compressor(what, compressor)
    repeats = V.integer(f"jaxfog.compress.{what}", "repeats", repeats, minimum=1)
    fused = V.flag(f"jaxfog.compress.{what}", "fused", fused)
    exchange = runtime.is_initialized()

    def timer(groups):
        def round_trip(t, key):
            payloads = compress_groups(compressor, merge(t, groups), key)
            if exchange:
                got = (neighbor_allgather(payloads) if fused
                       else [neighbor_allgather(p) for p in payloads])
                payloads = [unstack(g, p) for g, p in zip(got, payloads)]
                return [jax.vmap(compressor.decompress)(p).sum(0) for p in payloads]
            return [compressor.decompress(p) for p in payloads]

        step = jax.jit(round_trip)
        key = jax.random.key(0)
        jax.block_until_ready(step(tree, key))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(tree, key))
            times.append(time.perf_counter() - start)
        median = float(np.median(times))
        if exchange:
            median = float(allreduce(jnp.asarray([median], jnp.float32))[0])
        return median

    return timer


def search(compressor: Compressor, tree: Tree, timer: Callable[[Groups], float] | None = None,
           *, max_groups: int | None = None, alpha: float = 0.05,
           cache: bool = True) -> SearchResult:
    """MergeComp's search for the grouping of ``tree``'s leaves (Algorithm 2).

    Starting from one group, it times :func:`balanced` groupings with
    ``y = 1, 2, ...`` up to ``max_groups`` (default: the number of leaves, the
    other end) and stops at the first ``y`` that is slower than ``y - 1``
    (keeping ``y - 1``) or gains less than ``alpha`` of ``y - 1``'s time
    (keeping ``y``). The result is cached per model signature (the tree's
    structure, shapes and dtypes, the compressor and the number of agents),
    ``max_groups``, ``alpha`` and ``timer`` (the default one counts as one
    timer) for the life of the process.

    Args:
      compressor: what compresses each group; one that is not ``mergeable``
        (low-rank) gets :func:`per_leaf` groups without a search.
      tree: the pytree to be compressed (e.g. the parameters).
      timer: ``timer(groups) -> seconds`` for one step with those groups;
        default :func:`exchange_timer`. On MPI it must return the same on
        every rank (the default does).
      max_groups: ``Y`` in the paper.
      alpha: the smallest relative gain that continues the search.
      cache: look up and store the result.

    Returns:
      A :class:`SearchResult`: the groups and every ``(y, seconds)`` timed.
    """
    what = "jaxfog.compress.search"
    _check_compressor("search", compressor)
    n = len(jax.tree.leaves(tree))
    if not compressor.mergeable:
        return SearchResult(per_leaf(tree), ())
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"{what}: alpha must be a number, got {type(alpha).__name__} "
                        f"{alpha!r}")
    if not 0 < alpha < 1:
        raise ValueError(f"{what}: alpha must be in (0, 1), got {alpha!r}")
    if timer is not None:
        V.function(what, "timer", timer)
    V.flag(what, "cache", cache)
    if max_groups is not None:
        max_groups = V.integer("jaxfog.compress.search", "max_groups", max_groups, minimum=1)
    signature = (_signature(compressor, tree), max_groups, alpha, timer)
    if cache and signature in _SEARCHES:
        return _SEARCHES[signature]
    timer = exchange_timer(compressor, tree) if timer is None else timer
    best = balanced(tree, 1)
    best_time = timer(best)
    timings = [(1, best_time)]
    for y in range(2, min(n, max_groups or n) + 1):
        groups = balanced(tree, y)
        seconds = timer(groups)
        timings.append((y, seconds))
        if seconds > best_time:
            break
        gain = best_time - seconds
        best, best_time = groups, seconds
        if gain < alpha * timings[-2][1]:
            break
    result = SearchResult(best, tuple(timings))
    if cache:
        _SEARCHES[signature] = result
    return result


__all__ = ["SearchResult", "exchange_timer", "search"]
