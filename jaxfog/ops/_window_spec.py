"""What a window is, on every backend: its value's layout and who writes where.

Both backends keep a :class:`WindowSpec` per window name; the MPI backend
adds the C++ window's id, the simulation its state. The spec answers the
questions whose answers must agree between backends: the default weights of
``win_update``, which ranks may put to which, whether a value fits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxfog import topology as T


@dataclasses.dataclass(frozen=True)
class WindowSpec:
    """A window as every rank agrees on it at ``win_create``.

    Attributes:
      name: the window's name.
      treedef, avals: the value's structure and its leaves' (shape, dtype).
      with_weight: whether the window carries a push-sum weight.
      sources: ``sources[i, j]``: rank ``i`` holds a slot for rank ``j``.
      self_weight, src_weights: ``win_update``'s default weights per rank:
        the topology's row of W where a rank's sources are its in-neighbours,
        else uniform ``1 / (k + 1)`` over its ``k`` sources and itself.
    """

    name: str
    treedef: Any
    avals: tuple[tuple[tuple[int, ...], np.dtype], ...]
    with_weight: bool
    sources: np.ndarray
    self_weight: np.ndarray
    src_weights: np.ndarray

    @classmethod
    def make(cls, name: str, treedef: Any, avals: tuple, with_weight: bool,
             sources: np.ndarray, topology: T.Topology | T.Schedule) -> WindowSpec:
        n = sources.shape[0]
        self_weight, src_weights = np.zeros(n), np.zeros((n, n))
        weights = topology.weights if isinstance(topology, T.Topology) else None
        for i in range(n):
            if weights is not None and np.array_equal(
                    sources[i], (weights[i] != 0) & (np.arange(n) != i)):
                self_weight[i], src_weights[i] = weights[i, i], weights[i] * sources[i]
            else:
                self_weight[i] = 1.0 / (sources[i].sum() + 1)
                src_weights[i] = sources[i] * self_weight[i]
        for array in (sources, self_weight, src_weights):
            array.setflags(write=False)
        return cls(name, treedef, avals, with_weight, sources, self_weight, src_weights)

    def check_value(self, treedef: Any, leaves: list, what: str) -> None:
        """A clear error unless ``leaves`` have the window's structure, shapes and dtypes."""
        avals = layout(leaves)
        if treedef != self.treedef or avals != self.avals:
            raise ValueError(f"{what}: the value does not match window {self.name!r}: it has "
                             f"{[(s, str(d)) for s, d in avals]}, the window "
                             f"{[(s, str(d)) for s, d in self.avals]}")

    def check_sources(self, receivers: np.ndarray, senders: np.ndarray, what: str) -> None:
        """Every (receiver, sender) pair must be a slot of the window."""
        missing = [(int(r), int(s)) for r, s in zip(receivers, senders)
                   if not self.sources[r, s]]
        if missing:
            pairs = ", ".join(f"rank {r} holds no slot for rank {s}" for r, s in missing)
            raise ValueError(f"{what}: in window {self.name!r}, {pairs}; declare src_ranks "
                             "at win_create")


def layout(leaves: list) -> tuple[tuple[tuple[int, ...], np.dtype], ...]:
    return tuple((tuple(leaf.shape), np.dtype(leaf.dtype)) for leaf in leaves)


def describe(leaves: list, treedef: Any) -> tuple:
    """What every rank must pass identically to ``win_create`` (for the check)."""
    return str(treedef), [(shape, dtype.str) for shape, dtype in layout(leaves)]


__all__ = ["WindowSpec", "describe", "layout"]
