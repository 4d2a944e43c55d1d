"""A pytree compressed in groups of its leaves (MergeComp): each group's leaves
are flattened into one vector and compressed as one."""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxfog import _validate as V
from jaxfog.compress.compressors import Array, Compressor, Payload, _check_compressor

Tree = Any

Groups = tuple[tuple[int, int], ...]


def per_leaf(tree: Tree) -> Groups:
    """One group per leaf: ``y = number of leaves``."""
    return tuple((i, i + 1) for i in range(len(jax.tree.leaves(tree))))


def balanced(tree: Tree, y: int) -> Groups:
    """``y`` contiguous groups of leaves with about equal numbers of entries.

    MergeComp's cost model (its Assumption 5: compression and communication
    times linear in a group's size) makes every partition into ``y`` groups
    cost the same; balanced groups are the one jaxfog times, since top-k's
    cost grows faster than linearly with the group's size.
    """
    sizes = [math.prod(np.shape(leaf)) for leaf in jax.tree.leaves(tree)]
    n = len(sizes)
    if n == 0:
        raise ValueError("jaxfog.compress.balanced: the tree has no leaves")
    y = V.integer("jaxfog.compress.balanced", "y", y)
    if not 1 <= y <= n:
        raise ValueError(f"jaxfog.compress.balanced: y must be in [1, {n}], got {y!r}")
    total, groups, start, done = sum(sizes), [], 0, 0
    for g in range(y):
        stop = start + 1
        done += sizes[start]
        # Extend while the group stays under its share and leaves remain for the rest.
        while stop < n - (y - g - 1) and done + sizes[stop] / 2 <= total * (g + 1) / y:
            done += sizes[stop]
            stop += 1
        if g == y - 1:
            done += sum(sizes[stop:])
            stop = n
        groups.append((start, stop))
        start = stop
    return tuple(groups)


def check_groups(compressor: Compressor, tree: Tree, groups: Groups) -> Groups:
    """``groups`` if they cover ``tree``'s leaves in order and suit ``compressor``."""
    _check_compressor("check_groups", compressor)
    leaves = jax.tree.leaves(tree)
    try:
        groups = tuple((V.integer("jaxfog.compress", "a group's start", a),
                        V.integer("jaxfog.compress", "a group's stop", b)) for a, b in groups)
    except (TypeError, ValueError) as e:
        if str(e).startswith("jaxfog.compress"):
            raise
        raise TypeError(f"jaxfog.compress: groups must be a sequence of (start, stop) "
                        f"pairs of leaf indices, got {groups!r}") from None
    starts = [a for a, _ in groups]
    if (not groups or starts[0] != 0 or groups[-1][1] != len(leaves)
            or any(b <= a for a, b in groups)
            or any(b != a for (_, b), (a, _) in zip(groups, groups[1:]))):
        raise ValueError(f"jaxfog.compress: groups {groups} do not cover the {len(leaves)} "
                         "leaves in contiguous, non-empty runs")
    for a, b in groups:
        if b - a > 1 and not compressor.mergeable:
            raise ValueError(f"jaxfog.compress: {compressor.name} compresses leaf by leaf; "
                             "it cannot merge leaves (use per_leaf groups)")
        dtypes = {jnp.result_type(leaf) for leaf in leaves[a:b]}
        if len(dtypes) > 1:
            raise ValueError(f"jaxfog.compress: group {(a, b)} mixes dtypes "
                             f"{sorted(map(str, dtypes))}; a merged group has one")
    return groups


def merge(tree: Tree, groups: Groups) -> list[Array]:
    """The groups of ``tree``'s leaves: a lone leaf as it is, several flattened
    and concatenated into one vector."""
    leaves = [jnp.asarray(leaf) for leaf in jax.tree.leaves(tree)]
    return [leaves[a] if b - a == 1 else jnp.concatenate([leaf.reshape(-1) for leaf in leaves[a:b]])
            for a, b in groups]


def split(parts: Sequence[Array], like: Tree, groups: Groups) -> Tree:
    """The inverse of :func:`merge`: a tree shaped like ``like``."""
    leaves, treedef = jax.tree.flatten(like)
    out = []
    for part, (a, b) in zip(parts, groups):
        if b - a == 1:
            out.append(part.reshape(np.shape(leaves[a])))
            continue
        offset = 0
        for leaf in leaves[a:b]:
            size = math.prod(np.shape(leaf))
            out.append(part[offset:offset + size].reshape(np.shape(leaf)))
            offset += size
    return jax.tree.unflatten(treedef, out)


def compress_groups(compressor: Compressor, parts: Sequence[Array], key: Array,
                    warm: Sequence[Payload] | None = None) -> list[Payload]:
    """Compresses each group with its own key, ``fold_in(key, group)``."""
    return [compressor.compress(part, jax.random.fold_in(key, g),
                                None if warm is None else warm[g])
            for g, part in enumerate(parts)]


def compress_tree(compressor: Compressor, tree: Tree, key: Array,
                  groups: Groups | None = None) -> list[Payload]:
    """``tree``'s payloads, one per group (default :func:`per_leaf`)."""
    _check_compressor("compress_tree", compressor)
    groups = check_groups(compressor, tree, per_leaf(tree) if groups is None else groups)
    return compress_groups(compressor, merge(tree, groups), key)


def decompress_tree(compressor: Compressor, payloads: Sequence[Payload], like: Tree,
                    groups: Groups | None = None) -> Tree:
    """The tree :func:`compress_tree`'s payloads stand for, shaped like ``like``."""
    _check_compressor("decompress_tree", compressor)
    groups = per_leaf(like) if groups is None else groups
    return split([compressor.decompress(p) for p in payloads], like, groups)


def tree_bytes(compressor: Compressor, tree: Tree, groups: Groups | None = None) -> int:
    """Bytes of one message carrying ``tree``'s payloads."""
    _check_compressor("tree_bytes", compressor)
    groups = check_groups(compressor, tree, per_leaf(tree) if groups is None else groups)
    shapes = jax.eval_shape(lambda t: merge(t, groups), tree)
    return sum(compressor.bytes(s) for s in shapes)


def unstack(gathered: Payload, like: Payload) -> Payload:
    """A gathered payload (``k`` payloads shaped like ``like`` concatenated on
    axis 0, as :func:`jaxfog.neighbor_allgather` returns them) as one batched
    on a new leading axis of size ``k``; ``jax.vmap(decompress)`` then
    decompresses all ``k``."""
    k = gathered.arrays[0].shape[0] // like.arrays[0].shape[0]
    return Payload(tuple(a.reshape(k, *b.shape) for a, b in zip(gathered.arrays, like.arrays)),
                   like.shape, like.dtype)


__all__ = ["Groups", "balanced", "check_groups", "compress_groups", "compress_tree",
           "decompress_tree", "merge", "per_leaf", "split", "tree_bytes", "unstack"]
