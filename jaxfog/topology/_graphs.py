"""Static communication graphs: :class:`Topology` (an immutable weight matrix
with neighbour queries) and the built-in graphs and constructors.

Numpy only (networkx is imported lazily by the interop functions); the
weight-matrix convention is in :mod:`jaxfog.topology`'s docstring. The
checks and the uniform-row builder here are shared with ``_schedules.py``.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections import deque
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from jaxfog.errors import TopologyWarning


# --------------------------------------------------------------------------------------
# Small private helpers
# --------------------------------------------------------------------------------------


def _as_int(value: Any, name: str, what: str = "jaxfog.topology") -> int:
    """Returns ``value`` as a Python int; TypeError for bools and non-integers.
    Messages start with ``what``, the function the user called."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what}: {name} must be an integer, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{what}: {name} must be an integer, got {type(value).__name__} {value!r}"
        ) from None


def _name(name: Any, what: str) -> str:
    """An informational label: a str."""
    if not isinstance(name, str):
        raise TypeError(f"{what}: name must be a str or None, got {type(name).__name__} "
                        f"{name!r}")
    return name


def _check_size(n: Any, what: str, name: str = "n") -> int:
    """Validates a number of agents: an integer >= 1."""
    n = _as_int(n, name, what)
    if n < 1:
        raise ValueError(f"{what}: {name} must be >= 1, got {n}")
    return n


def _check_base(base: Any, what: str) -> int:
    """Validates an exponential base: an integer >= 2."""
    base = _as_int(base, "base", what)
    if base < 2:
        raise ValueError(f"{what}: base must be an integer >= 2, got {base}")
    return base


def _check_rank(rank: Any, size: int, what: str) -> int:
    """Validates a rank index in ``[0, size)``."""
    rank = _as_int(rank, "rank", what)
    if not 0 <= rank < size:
        raise ValueError(f"{what}: rank {rank} is out of range for a topology of size {size}")
    return rank


def _is_power_of(x: int, base: int) -> bool:
    """Exact integer test: is ``x == base**k`` for some k >= 0."""
    if x < 1:
        return False
    while x % base == 0:
        x //= base
    return x == 1


def _uniform_rows(n: int, senders: Sequence[Iterable[int]]) -> np.ndarray:
    """W where receiver i weights itself and each of ``senders[i]`` by ``1/(k+1)``."""
    w = np.zeros((n, n), dtype=np.float64)
    for i in range(n):
        srcs = sorted(set(int(s) for s in senders[i]) - {i})
        weight = 1.0 / (len(srcs) + 1)
        w[i, i] = weight
        w[i, srcs] = weight
    return w


def _circulant_uniform(n: int, offsets: Iterable[int]) -> np.ndarray:
    """W where rank i sends to ``(i + d) % n`` for each offset d, uniform rows."""
    offs = sorted({d % n for d in offsets} - {0})
    return _uniform_rows(n, [[(i - d) % n for d in offs] for i in range(n)])


def _reachable(adj: Sequence[Sequence[int]], start: int) -> np.ndarray:
    """Boolean mask of the nodes reachable from ``start`` (BFS over adjacency lists)."""
    seen = np.zeros(len(adj), dtype=bool)
    seen[start] = True
    queue = deque([start])
    while queue:
        u = queue.popleft()
        for v in adj[u]:
            if not seen[v]:
                seen[v] = True
                queue.append(v)
    return seen


_WHAT = "jaxfog.topology.Topology"


def _validate_weights(weights: Any) -> np.ndarray:
    """Converts ``weights`` to a clean float64 (n, n) array or raises a clear error."""
    if isinstance(weights, Topology):
        return np.array(weights.weights, dtype=np.float64)
    try:
        arr = np.asarray(weights)
    except Exception as e:  # ragged lists and the like
        raise ValueError(f"{_WHAT}: weights could not be converted to an array: {e}") from e
    if arr.dtype == np.bool_:
        raise TypeError(f"{_WHAT}: weights must be real numbers, got a boolean array "
                        "(use metropolis_hastings() for an adjacency matrix)")
    if np.issubdtype(arr.dtype, np.complexfloating):
        raise TypeError(f"{_WHAT}: weights must be real numbers, got a complex array")
    if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise TypeError(f"{_WHAT}: weights must be real numbers, got an array of dtype {arr.dtype}")
    if arr.ndim != 2:
        raise ValueError(f"{_WHAT}: weights must be a 2-D (n, n) matrix, got shape {arr.shape}")
    if arr.shape[0] != arr.shape[1]:
        raise ValueError(f"{_WHAT}: weights must be square, got shape {arr.shape}")
    if arr.shape[0] == 0:
        raise ValueError(f"{_WHAT}: weights must not be empty (n must be >= 1)")
    w = np.array(arr, dtype=np.float64) + 0.0  # copy; turns -0.0 into 0.0
    bad = ~np.isfinite(w)
    if bad.any():
        i, j = (int(v) for v in np.argwhere(bad)[0])
        raise ValueError(f"{_WHAT}: weights must be finite: W[{i}, {j}] = {w[i, j]} "
                         f"({int(bad.sum())} non-finite entries)")
    neg = w < 0
    if neg.any():
        i, j = (int(v) for v in np.argwhere(neg)[0])
        raise ValueError(f"{_WHAT}: weights must be non-negative: W[{i}, {j}] = {w[i, j]:g} "
                         f"({int(neg.sum())} negative entries)")
    empty = ~w.any(axis=1)
    if empty.any():
        rows = [int(r) for r in np.flatnonzero(empty)]
        raise ValueError(f"{_WHAT}: receiver row(s) {rows} of W are all zero: every receiver "
                         "needs a non-zero self weight or at least one sender")
    return w


def _restore_topology(data: bytes, n: int, name: str) -> "Topology":
    """Unpickling hook: rebuilds a Topology from trusted, already validated bytes."""
    return Topology._from_trusted(np.frombuffer(data, np.float64).reshape(n, n), name)


# --------------------------------------------------------------------------------------
# Topology
# --------------------------------------------------------------------------------------


class Topology:
    """An immutable, hashable communication graph given by its weight matrix.

    ``W[i, j]`` is the weight receiver ``i`` gives to sender ``j`` (``x_new = W @ x``).
    Equality and hash depend only on the weights (bytes and shape), never on ``name``,
    so a Topology can be a static argument of ``jax.jit`` or a dict key.

    Args:
      weights: a real, non-negative, finite (n, n) matrix, n >= 1, with no all-zero
        row. It is copied and stored as read-only float64. Non-stochastic matrices are
        allowed (push-sum / push-pull); see :meth:`is_row_stochastic` and friends.
      name: informational label, not part of equality or hash.
      check_connected: warn with :class:`TopologyWarning` when the graph is not strongly
        connected (set False for the per-step graphs of a dynamic schedule).

    Raises:
      TypeError: for boolean, complex or non-numeric weights.
      ValueError: for a wrong shape, empty, non-finite or negative weights, or a row of
        zeros; the message says where.
    """

    __slots__ = ("_weights", "_bytes", "_name", "_hash")
    # The slots' types (set once, in _init, through object.__setattr__).
    _weights: np.ndarray
    _bytes: bytes
    _name: str
    _hash: int

    def __init__(self, weights: Any, *, name: Optional[str] = None,
                 check_connected: bool = True) -> None:
        w = _validate_weights(weights)
        self._init(w, "from_weights" if name is None else _name(name, _WHAT))
        if check_connected and not self.is_strongly_connected():
            warnings.warn(f"{self!r} is not strongly connected: "
                          f"{self._disconnection_hint()}; averaging will not reach "
                          "consensus", TopologyWarning, stacklevel=3)

    def _init(self, w: np.ndarray, name: str) -> None:
        data = np.ascontiguousarray(w, dtype=np.float64).tobytes()
        # A view of immutable bytes: its WRITEABLE flag can never be turned back on.
        arr = np.frombuffer(data, dtype=np.float64).reshape(w.shape)
        object.__setattr__(self, "_bytes", data)
        object.__setattr__(self, "_weights", arr)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_hash", hash((w.shape, data)))

    @classmethod
    def _from_trusted(cls, w: np.ndarray, name: str) -> "Topology":
        """Builds without validation or warnings (for matrices built in this module)."""
        obj = cls.__new__(cls)
        obj._init(np.asarray(w, dtype=np.float64) + 0.0, name)
        return obj

    # -- immutability, equality, hashing, pickling ------------------------------------

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"Topology is immutable (cannot set {key!r})")

    def __delattr__(self, key: str) -> None:
        raise AttributeError(f"Topology is immutable (cannot delete {key!r})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Topology):
            return NotImplemented
        return self._weights.shape == other._weights.shape and self._bytes == other._bytes

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return (_restore_topology, (self._bytes, self.size, self._name))

    def __repr__(self) -> str:
        return f"Topology({self._name!r}, size={self.size}, edges={self.num_edges})"

    # -- basic attributes ---------------------------------------------------------------

    @property
    def weights(self) -> np.ndarray:
        """The read-only (n, n) float64 weight matrix ``W``."""
        return self._weights

    @property
    def size(self) -> int:
        """Number of agents n."""
        return self._weights.shape[0]

    @property
    def name(self) -> str:
        """Informational label (not part of equality or hash)."""
        return self._name

    @property
    def num_edges(self) -> int:
        """Number of directed edges ``j -> i`` with ``i != j`` (self loops excluded)."""
        off = self._weights != 0
        return int(off.sum() - np.count_nonzero(np.diag(off)))

    # -- neighbourhoods ---------------------------------------------------------------

    def in_neighbors(self, rank: int) -> list[int]:
        """Sorted ranks that send to ``rank`` (nonzeros of row ``rank``, self excluded)."""
        r = _check_rank(rank, self.size, "Topology.in_neighbors")
        return [int(j) for j in np.flatnonzero(self._weights[r]) if j != r]

    def out_neighbors(self, rank: int) -> list[int]:
        """Sorted ranks that ``rank`` sends to (nonzeros of column ``rank``, self excluded)."""
        r = _check_rank(rank, self.size, "Topology.out_neighbors")
        return [int(i) for i in np.flatnonzero(self._weights[:, r]) if i != r]

    def in_degree(self, rank: int) -> int:
        """Number of in-neighbours of ``rank`` (self excluded)."""
        return len(self.in_neighbors(rank))

    def out_degree(self, rank: int) -> int:
        """Number of out-neighbours of ``rank`` (self excluded)."""
        return len(self.out_neighbors(rank))

    def recv_weights(self, rank: int) -> tuple[float, dict[int, float]]:
        """The receiver's view: ``(W[r, r], {src: W[r, src]})`` over in-neighbours."""
        r = _check_rank(rank, self.size, "Topology.recv_weights")
        row = self._weights[r]
        return float(row[r]), {j: float(row[j]) for j in self.in_neighbors(r)}

    def send_weights(self, rank: int) -> tuple[float, dict[int, float]]:
        """The sender's view: ``(W[r, r], {dst: W[dst, r]})`` over out-neighbours."""
        r = _check_rank(rank, self.size, "Topology.send_weights")
        col = self._weights[:, r]
        return float(col[r]), {i: float(col[i]) for i in self.out_neighbors(r)}

    # -- predicates -------------------------------------------------------------------

    def is_row_stochastic(self, atol: float = 1e-12) -> bool:
        """True when every row sums to 1 within ``atol`` (pull averaging)."""
        return bool(np.allclose(self._weights.sum(axis=1), 1.0, rtol=0.0, atol=atol))

    def is_column_stochastic(self, atol: float = 1e-12) -> bool:
        """True when every column sums to 1 within ``atol`` (push averaging)."""
        return bool(np.allclose(self._weights.sum(axis=0), 1.0, rtol=0.0, atol=atol))

    def is_doubly_stochastic(self, atol: float = 1e-12) -> bool:
        """True when both rows and columns sum to 1 within ``atol``."""
        return self.is_row_stochastic(atol) and self.is_column_stochastic(atol)

    def is_symmetric(self, atol: float = 0.0) -> bool:
        """True when ``W == W.T`` (within ``atol``); implies an undirected edge set."""
        return bool(np.allclose(self._weights, self._weights.T, rtol=0.0, atol=atol))

    def _adjacency(self, transpose: bool = False) -> list[list[int]]:
        """Out-adjacency lists (``transpose=True``: in-adjacency lists)."""
        w = self._weights if transpose else self._weights.T
        return [[int(v) for v in np.flatnonzero(w[u]) if v != u] for u in range(self.size)]

    def is_strongly_connected(self) -> bool:
        """True when every rank can reach every other along directed edges."""
        return bool(_reachable(self._adjacency(), 0).all()
                    and _reachable(self._adjacency(transpose=True), 0).all())

    def _disconnection_hint(self) -> str:
        fwd = _reachable(self._adjacency(), 0)
        if not fwd.all():
            return f"rank {int(np.flatnonzero(~fwd)[0])} cannot be reached from rank 0"
        bwd = _reachable(self._adjacency(transpose=True), 0)
        return f"rank 0 cannot be reached from rank {int(np.flatnonzero(~bwd)[0])}"

    def spectral_gap(self) -> float:
        """``1 - |lambda_2|``, one minus the second-largest eigenvalue modulus of ``W``.

        The eigenvalues of W are sorted by modulus, ``|l_1| >= |l_2| >= ...``; for a
        stochastic, strongly connected, aperiodic W, ``|l_1| = 1`` and the consensus error
        shrinks roughly like ``|l_2|**k``. For n = 1 the gap is 1.0. Repeated moduli
        count separately (a disconnected doubly stochastic W has gap 0). No clipping:
        for a non-stochastic W the value is still ``1 - |l_2|``.
        """
        if self.size == 1:
            return 1.0
        moduli = np.sort(np.abs(np.linalg.eigvals(self._weights)))[::-1]
        return float(1.0 - moduli[1])

    # -- networkx interop -------------------------------------------------------------

    def to_networkx(self):
        """A ``networkx.DiGraph`` with BlueFog's convention.

        Nodes are 0..n-1; each nonzero ``W[i, j]`` (i != j) becomes an edge ``j -> i``
        with ``weight=W[i, j]``, and each nonzero ``W[i, i]`` a self-loop with that
        weight. Hence ``nx.to_numpy_array(G)[j, i] == W[i, j]`` (the transpose of W).
        """
        import networkx as nx

        g = nx.DiGraph(name=self._name)
        g.add_nodes_from(range(self.size))
        rows, cols = np.nonzero(self._weights)
        g.add_weighted_edges_from(
            (int(j), int(i), float(self._weights[i, j])) for i, j in zip(rows, cols))
        return g


# --------------------------------------------------------------------------------------
# Generic constructors
# --------------------------------------------------------------------------------------


def from_weights(weights: Any, *, name: Optional[str] = None,
                 check_connected: bool = True) -> Topology:
    """Builds a :class:`Topology` from a weight matrix ``W`` (``W[i, j]``: i from j).

    Args:
      weights: real, finite, non-negative (n, n) array-like (or a Topology), no zero row.
      name: informational label.
      check_connected: warn (:class:`TopologyWarning`) if not strongly connected.

    Raises:
      TypeError / ValueError: see :class:`Topology`.
    """
    return Topology(weights, name=name, check_connected=check_connected)


def _check_nx_nodes(graph: Any) -> int:
    """Checks that a networkx graph's nodes are exactly 0..n-1 and returns n."""
    if graph.is_multigraph():
        raise TypeError("multigraphs are not supported; use a Graph or a DiGraph")
    nodes = list(graph.nodes)
    n = len(nodes)
    if n == 0:
        raise ValueError("the graph has no nodes (n must be >= 1)")
    if any(isinstance(u, (bool, np.bool_)) for u in nodes) or set(nodes) != set(range(n)):
        shown = sorted(map(repr, nodes))[:8]
        raise ValueError(f"graph nodes must be exactly the integers 0..{n - 1}, got "
                         f"{', '.join(shown)}{', ...' if n > 8 else ''}")
    return n


def from_networkx(graph: Any, weight: str = "weight", *,
                  name: Optional[str] = None) -> Topology:
    """Builds a :class:`Topology` from a networkx ``Graph`` or ``DiGraph``.

    An edge ``j -> i`` means i receives from j (BlueFog convention); an undirected
    ``Graph`` means edges both ways. If every edge (self-loops included) carries the
    ``weight`` attribute, the weights are used as given: ``W[i, j]`` = weight of
    ``j -> i`` and ``W[i, i]`` = weight of the self-loop (0 if absent). If no edge
    carries it, each receiver's row is uniform ``1 / (in_degree + 1)`` over itself and
    its predecessors (self-loops do not count in the degree).

    Args:
      graph: networkx graph whose nodes are exactly the integers 0..n-1.
      weight: edge attribute holding the weight.
      name: informational label (default: the graph's ``name`` or "from_networkx").

    Raises:
      ValueError: bad node labels, or some but not all edges weighted.
      TypeError: multigraphs.
    """
    if not (hasattr(graph, "is_directed") and hasattr(graph, "edges")):
        raise TypeError("jaxfog.topology.from_networkx: graph must be a networkx Graph or "
                        f"DiGraph, got {type(graph).__name__}")
    n = _check_nx_nodes(graph)
    directed = graph.is_directed()
    edges = list(graph.edges(data=True))
    has = [weight in data for _, _, data in edges]
    if name is None:
        name = str(getattr(graph, "name", "") or "from_networkx")
    if edges and all(has):
        w = np.zeros((n, n), dtype=np.float64)
        for u, v, data in edges:
            try:
                value = float(data[weight])
            except (TypeError, ValueError):
                raise TypeError(f"edge {u} -> {v} has a non-numeric {weight!r}: "
                                f"{data[weight]!r}") from None
            w[v, u] = value
            if not directed:
                w[u, v] = value
        return Topology(w, name=name)
    if any(has):
        missing = next((u, v) for (u, v, _), h in zip(edges, has) if not h)
        raise ValueError(f"some edges have a {weight!r} attribute and some do not "
                         f"(e.g. edge {missing[0]} -> {missing[1]}); weight all or none")
    senders: list[set] = [set() for _ in range(n)]
    for u, v, _ in edges:
        senders[v].add(u)
        if not directed:
            senders[u].add(v)
    return Topology(_uniform_rows(n, senders), name=name)


_MH = "jaxfog.topology.metropolis_hastings"


def _support_from_graph(graph: Any) -> np.ndarray:
    """Off-diagonal boolean support ``S[i, j]`` (edge j -> i) of a graph-like object."""
    if isinstance(graph, Topology):
        s = graph.weights != 0
    elif hasattr(graph, "is_directed") and hasattr(graph, "edges"):
        n = _check_nx_nodes(graph)
        s = np.zeros((n, n), dtype=bool)
        for u, v in graph.edges():
            s[v, u] = True
            if not graph.is_directed():
                s[u, v] = True
    else:
        arr = np.asarray(graph)
        if np.issubdtype(arr.dtype, np.complexfloating):
            raise TypeError(f"{_MH}: adjacency must be boolean or 0/1, got a complex array")
        if not (arr.dtype == np.bool_ or np.issubdtype(arr.dtype, np.number)):
            raise TypeError(f"{_MH}: adjacency must be boolean or 0/1, got dtype {arr.dtype}")
        if arr.ndim != 2 or arr.shape[0] != arr.shape[1] or arr.shape[0] == 0:
            raise ValueError(f"{_MH}: adjacency must be a non-empty square matrix, "
                             f"got shape {arr.shape}")
        if arr.dtype != np.bool_ and not np.isin(arr, (0, 1)).all():
            i, j = (int(v) for v in np.argwhere(~np.isin(arr, (0, 1)))[0])
            raise ValueError(f"{_MH}: adjacency must contain only 0/1, got A[{i}, {j}] = "
                             f"{arr[i, j]}")
        s = arr.astype(bool)
    s = s.copy()
    np.fill_diagonal(s, False)
    return s


def metropolis_hastings(graph: Any, *, name: Optional[str] = None) -> Topology:
    """Metropolis-Hastings weights on an undirected graph.

    ``w_ij = 1 / max(deg_i, deg_j)`` for each edge, where degrees count self
    (``deg = number of neighbours + 1``), and ``w_ii = 1 - sum_{j != i} w_ij``. The
    result is symmetric and doubly stochastic.

    Args:
      graph: a networkx graph (nodes 0..n-1), a :class:`Topology`, or a square
        boolean / 0-1 adjacency array; its edge set must be symmetric (self-loops and the
        diagonal are ignored).
      name: informational label.

    Raises:
      ValueError: an asymmetric edge set or a malformed adjacency.
      TypeError: a complex or non-numeric adjacency.
    """
    s = _support_from_graph(graph)
    asym = s & ~s.T
    if asym.any():
        i, j = (int(v) for v in np.argwhere(asym)[0])
        raise ValueError(f"{_MH}: needs an undirected (symmetric) graph: "
                         f"edge {j} -> {i} exists but {i} -> {j} does not")
    n = s.shape[0]
    deg = s.sum(axis=1) + 1
    w = np.zeros((n, n), dtype=np.float64)
    rows, cols = np.nonzero(s)
    w[rows, cols] = 1.0 / np.maximum(deg[rows], deg[cols])
    w[np.arange(n), np.arange(n)] = 1.0 - w.sum(axis=1)
    return Topology(w, name="metropolis_hastings" if name is None else name)


# --------------------------------------------------------------------------------------
# Built-in static graphs
# --------------------------------------------------------------------------------------


def exponential(n: int, base: int = 2) -> Topology:
    """Exponential graph: rank i sends to ``(i + base**k) % n`` for every ``base**k < n``.

    Each receiver's row, self included, is uniform ``1 / (deg + 1)``, deg being the
    number of offsets (so W is circulant and doubly stochastic). ``exponential(1)`` is
    ``[[1]]``.

    Args:
      n: number of agents (>= 1).
      base: integer >= 2.
    """
    what = "jaxfog.topology.exponential"
    n, base = _check_size(n, what), _check_base(base, what)
    offsets, p = [], 1
    while p < n:
        offsets.append(p)
        p *= base
    name = f"exponential({n})" if base == 2 else f"exponential({n}, base={base})"
    return Topology._from_trusted(_circulant_uniform(n, offsets), name)


def symmetric_exponential(n: int, base: int = 4) -> Topology:
    """Symmetric exponential graph: i and ``(i + d) % n`` are linked for each offset
    d in 1..n-1 with ``min(d, n - d)`` a power of ``base`` (``base**0 = 1`` included).

    Uniform weights ``1 / (deg + 1)``; W is symmetric and doubly stochastic.

    Args:
      n: number of agents (>= 1).
      base: integer >= 2.
    """
    what = "jaxfog.topology.symmetric_exponential"
    n, base = _check_size(n, what), _check_base(base, what)
    offsets = [d for d in range(1, n) if _is_power_of(min(d, n - d), base)]
    name = (f"symmetric_exponential({n})" if base == 4
            else f"symmetric_exponential({n}, base={base})")
    return Topology._from_trusted(_circulant_uniform(n, offsets), name)


def ring(n: int, style: int = 0) -> Topology:
    """Ring graph.

    Args:
      n: number of agents (>= 1). n = 1 gives ``[[1]]`` and n = 2 gives all entries 1/2,
        whatever the style.
      style: 0: bidirectional, rank i weights itself, i-1 and i+1 by 1/3 each;
        1: i receives from i+1 (1/2 own, 1/2 received);
        2: i receives from i-1 (1/2 own, 1/2 received).
    """
    what = "jaxfog.topology.ring"
    n = _check_size(n, what)
    style = _as_int(style, "style", what)
    if style not in (0, 1, 2):
        raise ValueError(f"{what}: style must be 0 (both ways), 1 (receive from i+1) or "
                         f"2 (receive from i-1), got {style}")
    name = f"ring({n})" if style == 0 else f"ring({n},style={style})"
    if n == 1:
        return Topology._from_trusted(np.ones((1, 1)), name)
    if n == 2:
        return Topology._from_trusted(np.full((2, 2), 0.5), name)
    offsets = {0: (1, -1), 1: (-1,), 2: (1,)}[style]  # i sends to i + d
    return Topology._from_trusted(_circulant_uniform(n, offsets), name)


def _default_grid_shape(n: int) -> tuple[int, int]:
    """(rows, cols) with rows the largest factor of n that is <= sqrt(n)."""
    rows = math.isqrt(n)
    while n % rows:
        rows -= 1
    return rows, n // rows


def mesh_grid_2d(n: int, shape: Optional[tuple[int, int]] = None) -> Topology:
    """2-D 4-neighbour grid without wrap-around, Metropolis-Hastings weights.

    Node index is ``row * cols + col``. By default ``rows`` is the largest factor of n
    that is <= sqrt(n) and ``cols = n // rows`` (a prime n gives a path). Weights are
    those of :func:`metropolis_hastings`.

    Args:
      n: number of agents (>= 1).
      shape: optional ``(rows, cols)`` with ``rows * cols == n``.
    """
    what = "jaxfog.topology.mesh_grid_2d"
    n = _check_size(n, what)
    if shape is None:
        rows, cols = _default_grid_shape(n)
    else:
        if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
            raise TypeError(f"{what}: shape must be a pair (rows, cols), got "
                            f"{type(shape).__name__} {shape!r}")
        try:
            rows, cols = (_as_int(v, "shape entry", what) for v in shape)
        except ValueError:
            raise ValueError(f"{what}: shape must be a pair (rows, cols), got {shape!r}") from None
        if rows < 1 or cols < 1 or rows * cols != n:
            raise ValueError(f"{what}: shape {shape!r} does not match n={n} "
                             f"(need positive rows * cols == n)")
    adj = np.zeros((n, n), dtype=bool)
    for i in range(n):
        r, c = divmod(i, cols)
        if c + 1 < cols:
            adj[i, i + 1] = adj[i + 1, i] = True
        if r + 1 < rows:
            adj[i, i + cols] = adj[i + cols, i] = True
    return metropolis_hastings(adj, name=f"mesh_grid_2d({n},{rows}x{cols})")


def star(n: int, center: int = 0) -> Topology:
    """Star graph: the centre averages everyone with weight 1/n; a leaf keeps
    ``1 - 1/n`` and takes ``1/n`` from the centre (doubly stochastic).

    Args:
      n: number of agents (>= 1); ``star(1)`` is ``[[1]]``.
      center: the centre rank, in ``[0, n)``.
    """
    what = "jaxfog.topology.star"
    n = _check_size(n, what)
    center = _as_int(center, "center", what)
    if not 0 <= center < n:
        raise ValueError(f"{what}: center {center} is out of range for n={n}")
    w = np.eye(n) * (1.0 - 1.0 / n)
    w[:, center] = 1.0 / n
    w[center, :] = 1.0 / n
    name = f"star({n})" if center == 0 else f"star({n},center={center})"
    return Topology._from_trusted(w, name)


def fully_connected(n: int) -> Topology:
    """Complete graph with all weights 1/n (one step reaches the exact average)."""
    n = _check_size(n, "jaxfog.topology.fully_connected")
    return Topology._from_trusted(np.full((n, n), 1.0 / n), f"fully_connected({n})")
