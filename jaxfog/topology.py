"""Communication graphs and dynamic schedules for decentralized averaging.

This module is pure data: numpy only (networkx is imported lazily by the interop
functions). It knows nothing of MPI or JAX tracing, so every object here can be built,
inspected and tested anywhere, and handed to a jitted function as a static argument.

Weight-matrix convention
------------------------
``W[i, j]`` is the weight that receiver ``i`` gives to the value of sender ``j``: one
averaging step is ``x_new = W @ x``. ``W[i, i]`` is the self weight and the edge
``j -> i`` exists iff ``W[i, j] != 0`` (``i != j``). Row sums 1 means row-stochastic
(pull), column sums 1 means column-stochastic (push), both means doubly stochastic.
Unweighted graphs get uniform weights ``1 / (in_degree + 1)`` in each receiver's row,
self included.

Contents
--------
* :class:`Topology`: an immutable, hashable weight matrix with neighbour queries.
* Static graphs: :func:`exponential`, :func:`symmetric_exponential`, :func:`ring`,
  :func:`mesh_grid_2d`, :func:`star`, :func:`fully_connected`,
  :func:`metropolis_hastings`, :func:`from_weights`, :func:`from_networkx`.
* :class:`Schedule`: an immutable, hashable periodic sequence of topologies.
* Dynamic schedules: :func:`one_peer_exponential`, :func:`one_peer`,
  :func:`inner_outer_ring`, :func:`inner_outer_exponential`,
  :func:`machine_one_peer_exponential`.
* :func:`send_recv_ranks`: BlueFog-style per-rank ``(send_ranks, recv_ranks)`` generator.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections import deque
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import numpy as np

from jaxfog.errors import TopologyWarning

__all__ = [
    "Topology",
    "Schedule",
    "TopologyWarning",
    "from_weights",
    "from_networkx",
    "metropolis_hastings",
    "exponential",
    "symmetric_exponential",
    "ring",
    "mesh_grid_2d",
    "star",
    "fully_connected",
    "one_peer_exponential",
    "one_peer",
    "inner_outer_ring",
    "inner_outer_exponential",
    "machine_one_peer_exponential",
    "send_recv_ranks",
]


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


def _ceil_log2(x: int) -> int:
    """``ceil(log2(x))`` for an integer x >= 1, exactly (0 for x == 1)."""
    return (x - 1).bit_length()


def _lcm(values: Iterable[int]) -> int:
    """Least common multiple of positive integers (1 for none)."""
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


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


def _one_peer_matrix(n: int, sends: dict) -> np.ndarray:
    """W for one step where rank s sends to ``sends[s]``; receivers average 1/2-1/2.

    Raises AssertionError (internal bug) when a receiver would get two peers.
    """
    w = np.eye(n, dtype=np.float64)
    seen = set()
    for src, dst in sends.items():
        if dst == src:
            continue
        assert dst not in seen, f"rank {dst} would receive from two peers"
        seen.add(dst)
        w[dst, dst] = 0.5
        w[dst, src] = 0.5
    return w


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


def _restore_schedule(topologies: tuple, name: str) -> "Schedule":
    """Unpickling hook for :class:`Schedule`."""
    return Schedule(topologies, name=name)


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


# --------------------------------------------------------------------------------------
# Schedule
# --------------------------------------------------------------------------------------


class Schedule:
    """An immutable, hashable periodic sequence of same-size :class:`Topology` objects.

    Step ``t`` uses ``schedule.at(t) == schedule[t % period]``. Equality and hash come
    from the entries (not ``name``), so a Schedule can be a static ``jax.jit`` argument.

    Args:
      topologies: a non-empty sequence of Topology objects of one size.
      name: informational label.

    Raises:
      TypeError: an entry that is not a Topology.
      ValueError: empty, or entries of different sizes.
    """

    __slots__ = ("_topologies", "_name", "_stacked", "_hash")

    def __init__(self, topologies: Iterable[Topology], name: Optional[str] = None) -> None:
        what = "jaxfog.topology.Schedule"
        if isinstance(topologies, Topology):
            raise TypeError(f"{what}: takes a sequence of Topology objects, got a single "
                            "Topology (wrap it in a list)")
        if isinstance(topologies, (str, bytes)) or not hasattr(topologies, "__iter__"):
            raise TypeError(f"{what}: topologies must be a sequence of Topology objects, "
                            f"got {type(topologies).__name__}")
        topos = tuple(topologies)
        if not topos:
            raise ValueError(f"{what}: a Schedule needs at least one Topology")
        for k, t in enumerate(topos):
            if not isinstance(t, Topology):
                raise TypeError(f"{what}: entry {k} is a {type(t).__name__}, "
                                "not a Topology")
            if t.size != topos[0].size:
                raise ValueError(f"{what}: all topologies of a Schedule must have the same size: "
                                 f"entry 0 has size {topos[0].size}, entry {k} has "
                                 f"size {t.size}")
        stacked = np.stack([t.weights for t in topos]).astype(np.float64)
        stacked.flags.writeable = False
        object.__setattr__(self, "_topologies", topos)
        object.__setattr__(self, "_name", "schedule" if name is None else _name(name, what))
        object.__setattr__(self, "_stacked", stacked)
        object.__setattr__(self, "_hash", hash(("Schedule", topos)))

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"Schedule is immutable (cannot set {key!r})")

    def __delattr__(self, key: str) -> None:
        raise AttributeError(f"Schedule is immutable (cannot delete {key!r})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return self._topologies == other._topologies

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return (_restore_schedule, (self._topologies, self._name))

    def __repr__(self) -> str:
        return f"Schedule({self._name!r}, size={self.size}, period={self.period})"

    def __len__(self) -> int:
        return len(self._topologies)

    def __iter__(self) -> Iterator[Topology]:
        return iter(self._topologies)

    def __getitem__(self, index: Any) -> Union[Topology, tuple]:
        """Entry ``index`` of one period (plain tuple indexing; see :meth:`at`)."""
        return self._topologies[index]

    @property
    def name(self) -> str:
        """Informational label (not part of equality or hash)."""
        return self._name

    @property
    def period(self) -> int:
        """Number of distinct steps before the schedule repeats."""
        return len(self._topologies)

    @property
    def size(self) -> int:
        """Number of agents n."""
        return self._topologies[0].size

    @property
    def topologies(self) -> tuple[Topology, ...]:
        """The entries of one period."""
        return self._topologies

    @property
    def stacked_weights(self) -> np.ndarray:
        """Read-only (period, n, n) float64 array; entry ``t % period`` is step t's W."""
        return self._stacked

    def at(self, step: int) -> Topology:
        """The topology used at ``step`` (any integer; taken modulo the period)."""
        return self._topologies[_as_int(step, "step", "Schedule.at") % self.period]

    def product(self, start: int = 0, num_steps: Optional[int] = None) -> np.ndarray:
        """``W_{start+k-1} @ ... @ W_{start}``: the mixing of ``k = num_steps`` steps.

        Args:
          start: first step.
          num_steps: number of steps (default: one period).
        """
        what = "Schedule.product"
        k = self.period if num_steps is None else _as_int(num_steps, "num_steps", what)
        if k < 0:
            raise ValueError(f"{what}: num_steps must be >= 0, got {k}")
        start = _as_int(start, "start", what)
        out = np.eye(self.size)
        for t in range(start, start + k):
            out = self._stacked[t % self.period] @ out
        return out

    def union(self, *, name: Optional[str] = None) -> Topology:
        """The Topology whose W is the mean of one period's matrices.

        Its edge set is the union of the entries' edge sets, and it is row / column /
        doubly stochastic whenever every entry is.
        """
        return Topology(self._stacked.mean(axis=0),
                        name=f"union({self._name})" if name is None else name,
                        check_connected=False)


# --------------------------------------------------------------------------------------
# Built-in dynamic schedules
# --------------------------------------------------------------------------------------


def _schedule_from_sends(n: int, sends_per_step: Sequence[dict], name: str) -> Schedule:
    """Schedule of one-peer steps; ``sends_per_step[t]`` maps sender -> receiver."""
    return Schedule([Topology._from_trusted(_one_peer_matrix(n, sends), f"{name}[t={t}]")
                     for t, sends in enumerate(sends_per_step)], name=name)


def one_peer_exponential(n: int) -> Schedule:
    """Dynamic one-peer exponential graph.

    With ``tau = ceil(log2 n)``, at step t rank r sends only to
    ``(r + 2**(t mod tau)) % n``; every rank then receives from exactly one peer and
    averages 1/2-1/2 (each step is doubly stochastic). For n a power of 2 the product
    of any tau consecutive matrices is exactly ``(1/n) 11^T``. n = 1: period 1, identity.
    """
    n = _check_size(n, "jaxfog.topology.one_peer_exponential")
    tau = max(_ceil_log2(n), 1)
    steps = [{r: (r + 2 ** t) % n for r in range(n)} if n > 1 else {} for t in range(tau)]
    return _schedule_from_sends(n, steps, f"one_peer_exponential({n})")


def one_peer(topology: Topology, *, max_period: int = 4096) -> Schedule:
    """One-peer dynamic schedule over a static topology (BlueFog's
    ``GetDynamicSendRecvRanks``).

    Each rank's out-neighbours are sorted clockwise, by ``(dst - r) % n``; at step t rank
    r sends to ``sorted_out[r][t % len(sorted_out[r])]`` (a rank without out-neighbours
    sends nothing). Each receiver weights itself and its k senders of that step uniformly
    ``1 / (k + 1)`` (row-stochastic; doubly stochastic when k <= 1 everywhere, e.g. on
    circulant graphs). The period is the lcm of the nonzero out-degrees (1 if none).

    Args:
      topology: the static base graph.
      max_period: refuse (ValueError) irregular graphs whose period would exceed this.
    """
    what = "jaxfog.topology.one_peer"
    if not isinstance(topology, Topology):
        raise TypeError(f"{what}: needs a Topology, got {type(topology).__name__}")
    max_period = _as_int(max_period, "max_period", what)
    if max_period < 1:
        raise ValueError(f"{what}: max_period must be >= 1, got {max_period}")
    n = topology.size
    outs = [sorted(topology.out_neighbors(r), key=lambda d, r=r: (d - r) % n)
            for r in range(n)]
    period = _lcm(len(o) for o in outs if o)
    if period > max_period:
        raise ValueError(f"{what}: one_peer({topology.name}) would have period {period} (lcm of "
                         f"the out-degrees) > max_period={max_period}")
    name = f"one_peer({topology.name})"
    entries = []
    for t in range(period):
        senders: list[list[int]] = [[] for _ in range(n)]
        for r, o in enumerate(outs):
            if o:
                senders[o[t % len(o)]].append(r)
        entries.append(Topology._from_trusted(_uniform_rows(n, senders), f"{name}[t={t}]"))
    return Schedule(entries, name=name)


def _check_machines(n: Any, local_size: Any, what: str) -> tuple[int, int, int]:
    """Validates (n, local_size) and returns (n, local_size, num_machines)."""
    what = f"jaxfog.topology.{what}"
    n = _check_size(n, what)
    local_size = _check_size(local_size, what, "local_size")
    if n % local_size:
        raise ValueError(f"{what}: n={n} must be a multiple of local_size={local_size} "
                         "(homogeneous machines)")
    return n, local_size, n // local_size


def inner_outer_ring(n: int, local_size: int) -> Schedule:
    """Inner-ring / outer-ring dynamic schedule (BlueFog's
    ``GetInnerOuterRingDynamicSendRecvRanks``).

    Ranks are ``r = m * local_size + l`` on M = n // local_size machines; period is
    local_size. At step t, on every machine the rank with local rank ``o = t % L`` is in
    the outer ring: it sends to local rank o of machine ``(m + 1) % M`` (and receives
    from machine ``(m - 1) % M``). The other local ranks form an inner ring skipping o:
    l sends to the next local rank after l (mod L) that is not o. A rank whose target is
    itself (L = 2 inner, or M = 1 outer) does not exchange that step (identity row).
    Receivers average 1/2 own, 1/2 received; every step is doubly stochastic.

    Raises:
      ValueError: n not a multiple of local_size.
    """
    n, big_l, big_m = _check_machines(n, local_size, "inner_outer_ring")
    steps = []
    for t in range(big_l):
        o = t % big_l
        sends = {}
        for m in range(big_m):
            for l in range(big_l):
                if l == o:
                    dst = ((m + 1) % big_m) * big_l + l
                else:
                    nl = (l + 1) % big_l
                    if nl == o:
                        nl = (nl + 1) % big_l
                    dst = m * big_l + nl
                sends[m * big_l + l] = dst
        steps.append(sends)
    return _schedule_from_sends(n, steps, f"inner_outer_ring({n},{big_l})")


def inner_outer_exponential(n: int, local_size: int) -> Schedule:
    """Inner / outer one-peer exponential dynamic schedule.

    Same structure as :func:`inner_outer_ring`, with exponential jumps (this differs
    from BlueFog's ``GetInnerOuterExp2DynamicSendRecvRanks`` so that every rank receives
    from exactly one peer or none, making every step doubly stochastic):

    * outer: at step t the rank with local rank ``o = t % L`` of machine m sends to
      local rank o of machine ``(m + 2**k_out) % M`` with
      ``k_out = (t // L) % ceil(log2 M)`` (k_out advances every L steps, so each local
      rank uses each distance once); no outer exchange when M = 1.
    * inner: the K = L - 1 other local ranks, re-indexed 0..K-1 in increasing order,
      send to the inner rank at distance ``2**k_in`` (mod K) with
      ``k_in = t % ceil(log2 K)``; no inner exchange when K <= 1.

    Receivers average 1/2 own, 1/2 received. The period is
    ``lcm(L * max(ceil(log2 M), 1), max(ceil(log2 K), 1))``.

    Raises:
      ValueError: n not a multiple of local_size.
    """
    n, big_l, big_m = _check_machines(n, local_size, "inner_outer_exponential")
    tau_out = max(_ceil_log2(big_m), 1)
    k_inner = big_l - 1
    tau_in = max(_ceil_log2(k_inner), 1) if k_inner >= 1 else 1
    period = _lcm([big_l * tau_out, tau_in])
    steps = []
    for t in range(period):
        o = t % big_l
        d_out = 2 ** ((t // big_l) % tau_out)
        d_in = 2 ** (t % tau_in)
        inner = [l for l in range(big_l) if l != o]
        sends = {}
        for m in range(big_m):
            sends[m * big_l + o] = ((m + d_out) % big_m) * big_l + o
            for j, l in enumerate(inner):
                sends[m * big_l + l] = m * big_l + inner[(j + d_in) % k_inner]
        steps.append(sends)
    return _schedule_from_sends(n, steps, f"inner_outer_exponential({n},{big_l})")


def machine_one_peer_exponential(n: int, local_size: int) -> Schedule:
    """Machine-level one-peer exponential schedule.

    With M = n // L machines and ``tau_M = ceil(log2 M)``, at step t rank
    ``m * L + l`` sends to the same local rank l on machine
    ``(m + 2**(t mod tau_M)) % M``; receivers average 1/2-1/2. M = 1: period 1, identity.

    Raises:
      ValueError: n not a multiple of local_size.
    """
    n, big_l, big_m = _check_machines(n, local_size, "machine_one_peer_exponential")
    tau = max(_ceil_log2(big_m), 1)
    steps = []
    for t in range(tau):
        d = 2 ** t
        steps.append({m * big_l + l: ((m + d) % big_m) * big_l + l
                      for m in range(big_m) for l in range(big_l)} if big_m > 1 else {})
    return _schedule_from_sends(n, steps, f"machine_one_peer_exponential({n},{big_l})")


def send_recv_ranks(schedule_or_topology: Union[Schedule, Topology],
                    rank: int) -> Iterator[tuple[list[int], list[int]]]:
    """Infinite BlueFog-style generator of ``(send_ranks, recv_ranks)`` for one rank.

    Step t yields the sorted out- and in-neighbours of ``rank`` in ``schedule.at(t)``;
    for a static Topology it yields the same pair forever.

    Example:
      >>> gen = send_recv_ranks(one_peer_exponential(8), 0)
      >>> [next(gen) for _ in range(3)]
      [([1], [7]), ([2], [6]), ([4], [4])]
    """
    if isinstance(schedule_or_topology, Topology):
        entries: Sequence[Topology] = (schedule_or_topology,)
    elif isinstance(schedule_or_topology, Schedule):
        entries = schedule_or_topology.topologies
    else:
        raise TypeError("jaxfog.topology.send_recv_ranks: needs a Schedule or a Topology, "
                        f"got {type(schedule_or_topology).__name__}")
    rank = _check_rank(rank, entries[0].size, "jaxfog.topology.send_recv_ranks")
    pairs = [(t.out_neighbors(rank), t.in_neighbors(rank)) for t in entries]
    return _cycle_pairs(pairs)


def _cycle_pairs(pairs: list) -> Iterator[tuple[list[int], list[int]]]:
    """Yields fresh copies of ``pairs`` cyclically, forever."""
    while True:
        for send, recv in pairs:
            yield list(send), list(recv)
