"""Tests for jaxfog.topology: every expected matrix is written by hand or built by an
independent loop from the documented semantics, never by the implementation."""

import copy
import math
import pickle
import re
import warnings

import networkx as nx
import numpy as np
import pytest

import jaxfog.topology as T

SIZES = [1, 2, 3, 4, 5, 7, 8, 12, 16]


# ---------------------------------------------------------------------------------------
# Independent reference builders (straight from the semantics in the docs)
# ---------------------------------------------------------------------------------------


def uniform_from_edges(n, edges):
    """Receiver i: 1/(k+1) to itself and each of its k distinct senders; edges (src, dst)."""
    w = np.zeros((n, n))
    for i in range(n):
        srcs = {s for s, d in edges if d == i and s != i}
        w[i, i] = 1.0 / (len(srcs) + 1)
        for s in srcs:
            w[i, s] = 1.0 / (len(srcs) + 1)
    return w


def half_half(n, sends):
    """One-peer step: sends = {src: dst}; receivers average 1/2-1/2; no-op if dst == src."""
    w = np.eye(n)
    for s, d in sends.items():
        if s != d:
            assert w[d, d] == 1.0, "test bug: two senders to one receiver"
            w[d, d] = 0.5
            w[d, s] = 0.5
    return w


def ref_gap(w):
    moduli = sorted(abs(complex(v)) for v in np.linalg.eigvals(w))
    return 1.0 if len(moduli) == 1 else 1.0 - moduli[-2]


def ref_exponential(n, base):
    edges, p = [], 1
    while p < n:
        edges += [(i, (i + p) % n) for i in range(n)]
        p *= base
    return uniform_from_edges(n, edges)


def ref_symmetric_exponential(n, base):
    def is_pow(x):
        p = 1
        while p < x:
            p *= base
        return p == x

    edges = [(i, (i + d) % n) for i in range(n) for d in range(1, n) if is_pow(min(d, n - d))]
    return uniform_from_edges(n, edges)


def ref_metropolis(n, undirected_edges):
    nbrs = {i: set() for i in range(n)}
    for a, b in undirected_edges:
        nbrs[a].add(b)
        nbrs[b].add(a)
    w = np.zeros((n, n))
    for i in range(n):
        for j in nbrs[i]:
            w[i, j] = 1.0 / max(len(nbrs[i]) + 1, len(nbrs[j]) + 1)
        w[i, i] = 1.0 - w[i].sum()
    return w


def ref_grid_edges(rows, cols):
    edges = []
    for r in range(rows):
        for c in range(cols):
            if c + 1 < cols:
                edges.append((r * cols + c, r * cols + c + 1))
            if r + 1 < rows:
                edges.append((r * cols + c, (r + 1) * cols + c))
    return edges


def assert_w(topo, expected, atol=1e-15):
    assert isinstance(topo, T.Topology)
    assert topo.weights.shape == np.shape(expected)
    np.testing.assert_allclose(topo.weights, expected, rtol=0, atol=atol)


def assert_schedule(sched, expected_list, atol=1e-15):
    assert isinstance(sched, T.Schedule)
    assert sched.period == len(expected_list)
    for t, exp in enumerate(expected_list):
        assert_w(sched.at(t), exp, atol)


# ---------------------------------------------------------------------------------------
# Static built-ins against hand-written matrices
# ---------------------------------------------------------------------------------------


def test_exponential_by_hand():
    assert_w(T.exponential(1), [[1.0]])
    assert_w(T.exponential(2), np.full((2, 2), 0.5))
    assert_w(T.exponential(3), np.full((3, 3), 1 / 3))  # offsets 1, 2: complete
    t = 1 / 3  # n=4: offsets 1, 2, receiver i hears i-1, i-2
    assert_w(T.exponential(4), [[t, 0, t, t], [t, t, 0, t], [t, t, t, 0], [0, t, t, t]])
    q = 1 / 4  # n=5: offsets 1, 2, 4; receiver i hears i-1, i-2, i-4 (misses i-3)
    assert_w(T.exponential(5), [[q, q, 0, q, q], [q, q, q, 0, q], [q, q, q, q, 0],
                                [0, q, q, q, q], [q, 0, q, q, q]])
    h = 1 / 3  # base 3, n=4: offsets 1, 3
    assert_w(T.exponential(4, base=3), [[h, h, 0, h], [h, h, h, 0], [0, h, h, h],
                                        [h, 0, h, h]])


@pytest.mark.parametrize("n", SIZES + [9, 10, 27])
@pytest.mark.parametrize("base", [2, 3, 4])
def test_exponential_loop(n, base):
    topo = T.exponential(n, base=base)
    assert_w(topo, ref_exponential(n, base))
    assert topo.is_doubly_stochastic()
    assert topo.is_strongly_connected()
    assert topo.out_neighbors(0) == sorted({base ** k % n for k in range(n) if base ** k < n}
                                           - {0})


def test_symmetric_exponential_by_hand():
    q = 1 / 4  # n=8, base 4: offsets d with min(d, 8-d) in {1, 4}: d = 1, 4, 7
    row0 = [q, q, 0, 0, q, 0, 0, q]
    assert_w(T.symmetric_exponential(8), [np.roll(row0, i) for i in range(8)])
    f = 1 / 5  # n=12: min(d, 12-d) in {1, 4}: d = 1, 4, 8, 11
    row0 = [f, f, 0, 0, f, 0, 0, 0, f, 0, 0, f]
    assert_w(T.symmetric_exponential(12), [np.roll(row0, i) for i in range(12)])
    assert_w(T.symmetric_exponential(1), [[1.0]])
    assert_w(T.symmetric_exponential(2), np.full((2, 2), 0.5))


@pytest.mark.parametrize("n", SIZES + [17, 20])
@pytest.mark.parametrize("base", [2, 4])
def test_symmetric_exponential_loop(n, base):
    topo = T.symmetric_exponential(n, base)
    assert_w(topo, ref_symmetric_exponential(n, base))
    assert topo.is_symmetric() and topo.is_doubly_stochastic()


def test_ring_by_hand():
    t = 1 / 3
    assert_w(T.ring(4), [[t, t, 0, t], [t, t, t, 0], [0, t, t, t], [t, 0, t, t]])
    # style 1: i receives from i+1
    assert_w(T.ring(4, style=1), [[.5, .5, 0, 0], [0, .5, .5, 0], [0, 0, .5, .5],
                                  [.5, 0, 0, .5]])
    # style 2: i receives from i-1
    assert_w(T.ring(4, style=2), [[.5, 0, 0, .5], [.5, .5, 0, 0], [0, .5, .5, 0],
                                  [0, 0, .5, .5]])
    assert_w(T.ring(3), np.full((3, 3), t))
    for style in (0, 1, 2):
        assert_w(T.ring(1, style), [[1.0]])
        assert_w(T.ring(2, style), np.full((2, 2), 0.5))


@pytest.mark.parametrize("n", [3, 5, 8, 16])
def test_ring_loop(n):
    exp0 = uniform_from_edges(n, [(i, (i + 1) % n) for i in range(n)]
                              + [(i, (i - 1) % n) for i in range(n)])
    exp1 = uniform_from_edges(n, [((i + 1) % n, i) for i in range(n)])
    exp2 = uniform_from_edges(n, [((i - 1) % n, i) for i in range(n)])
    for style, exp in enumerate([exp0, exp1, exp2]):
        topo = T.ring(n, style)
        assert_w(topo, exp)
        assert topo.is_doubly_stochastic() and topo.is_strongly_connected()
    assert T.ring(n, 1).in_neighbors(0) == [1]
    assert T.ring(n, 2).in_neighbors(0) == [n - 1]


def test_mesh_grid_2d_by_hand():
    a, b, c = 5 / 12, 1 / 4, 1 / 3  # 2x3 grid: corners have degree 3 (self counted)
    assert_w(T.mesh_grid_2d(6), [[a, b, 0, c, 0, 0],
                                 [b, b, b, 0, b, 0],
                                 [0, b, a, 0, 0, c],
                                 [c, 0, 0, a, b, 0],
                                 [0, b, 0, b, b, b],
                                 [0, 0, c, 0, b, a]], atol=1e-15)
    t = 1 / 3  # 2x2 grid
    assert_w(T.mesh_grid_2d(4), [[t, t, t, 0], [t, t, 0, t], [t, 0, t, t], [0, t, t, t]])
    # prime n: a path; explicit shape (1, 4) likewise
    path4 = [[2 / 3, 1 / 3, 0, 0], [1 / 3, 1 / 3, 1 / 3, 0], [0, 1 / 3, 1 / 3, 1 / 3],
             [0, 0, 1 / 3, 2 / 3]]
    assert_w(T.mesh_grid_2d(4, shape=(1, 4)), path4)
    assert_w(T.mesh_grid_2d(1), [[1.0]])
    assert_w(T.mesh_grid_2d(2), [[.5, .5], [.5, .5]])


@pytest.mark.parametrize("n, rows", [(1, 1), (2, 1), (5, 1), (6, 2), (8, 2), (12, 3),
                                     (16, 4), (18, 3), (36, 6)])
def test_mesh_grid_2d_loop(n, rows):
    cols = n // rows
    topo = T.mesh_grid_2d(n)
    assert_w(topo, ref_metropolis(n, ref_grid_edges(rows, cols)), atol=1e-14)
    assert topo.is_symmetric() and topo.is_doubly_stochastic()
    # explicit transposed shape
    assert_w(T.mesh_grid_2d(n, shape=(cols, rows)),
             ref_metropolis(n, ref_grid_edges(cols, rows)), atol=1e-14)


def test_star_and_fully_connected_by_hand():
    q = 1 / 4
    assert_w(T.star(4), [[q, q, q, q], [q, .75, 0, 0], [q, 0, .75, 0], [q, 0, 0, .75]])
    assert_w(T.star(3, center=2), [[2 / 3, 0, 1 / 3], [0, 2 / 3, 1 / 3],
                                   [1 / 3, 1 / 3, 1 / 3]])
    assert_w(T.star(1), [[1.0]])
    assert_w(T.star(2), np.full((2, 2), 0.5))
    for n in SIZES:
        assert np.array_equal(T.fully_connected(n).weights, np.full((n, n), 1.0 / n))
        assert T.star(n).is_doubly_stochastic()
        assert T.star(n).in_degree(0) == n - 1
        assert all(T.star(n).in_neighbors(r) == [0] for r in range(1, n))


def all_builtins(n):
    out = [T.exponential(n), T.exponential(n, 3), T.symmetric_exponential(n),
           T.symmetric_exponential(n, 2), T.ring(n), T.ring(n, 1), T.ring(n, 2),
           T.mesh_grid_2d(n), T.star(n), T.star(n, n - 1), T.fully_connected(n)]
    if n > 1:
        path = nx.path_graph(n)
        out.append(T.metropolis_hastings(path))
    return out


@pytest.mark.parametrize("n", SIZES)
def test_builtins_are_doubly_stochastic_connected(n):
    for topo in all_builtins(n):
        assert topo.is_row_stochastic(), topo
        assert topo.is_column_stochastic(), topo
        assert topo.is_doubly_stochastic(), topo
        assert topo.is_strongly_connected(), topo
        assert np.all(topo.weights >= 0)
        assert topo.size == n


@pytest.mark.parametrize("n", SIZES)
def test_spectral_gaps_against_eigvals(n):
    for topo in all_builtins(n):
        assert topo.spectral_gap() == pytest.approx(ref_gap(np.array(topo.weights)),
                                                    abs=1e-10), topo
    for sched in all_schedules(n):
        for topo in sched:
            assert topo.spectral_gap() == pytest.approx(ref_gap(np.array(topo.weights)),
                                                        abs=1e-10)


def test_spectral_gap_analytic_values():
    for n in (1, 2, 3, 8, 16):
        assert T.fully_connected(n).spectral_gap() == pytest.approx(1.0, abs=1e-12)
    for n in (4, 6, 8, 16):  # ring: eigenvalues (1 + 2 cos(2 pi k / n)) / 3
        assert T.ring(n).spectral_gap() == pytest.approx(
            1 - (1 + 2 * math.cos(2 * math.pi / n)) / 3, abs=1e-12)
        # directed ring: |(1 + e^{2 pi i / n}) / 2| = cos(pi / n)
        assert T.ring(n, 1).spectral_gap() == pytest.approx(1 - math.cos(math.pi / n),
                                                            abs=1e-12)
    assert T.star(8).spectral_gap() == pytest.approx(1 / 8, abs=1e-12)
    assert T.ring(1).spectral_gap() == 1.0
    # two disconnected components: second eigenvalue 1, gap 0
    with pytest.warns(T.TopologyWarning):
        topo = T.from_weights(np.eye(2))
    assert topo.spectral_gap() == pytest.approx(0.0, abs=1e-12)


# ---------------------------------------------------------------------------------------
# Topology object: neighbours, views, immutability, hashing, pickling
# ---------------------------------------------------------------------------------------


def test_neighbors_and_local_views():
    w = [[0.5, 0.2, 0.0, 0.3],
         [0.0, 1.0, 0.0, 0.0],
         [0.1, 0.0, 0.4, 0.0],
         [0.0, 0.0, 0.6, 0.7]]
    with pytest.warns(T.TopologyWarning):  # rank 1 never hears anyone
        topo = T.from_weights(w, name="custom")
    assert topo.in_neighbors(0) == [1, 3]
    assert topo.out_neighbors(0) == [2]
    assert topo.in_neighbors(1) == [] and topo.out_neighbors(1) == [0]
    assert topo.out_neighbors(2) == [3] and topo.in_degree(0) == 2
    assert topo.out_degree(3) == 1 and topo.in_degree(3) == 1
    assert topo.recv_weights(0) == (0.5, {1: 0.2, 3: 0.3})
    assert topo.recv_weights(1) == (1.0, {})
    assert topo.send_weights(2) == (0.4, {3: 0.6})
    assert topo.send_weights(0) == (0.5, {2: 0.1})
    assert topo.num_edges == 4
    assert not topo.is_row_stochastic() and not topo.is_column_stochastic()
    assert not topo.is_symmetric() and not topo.is_strongly_connected()
    assert topo.name == "custom" and "custom" in repr(topo)
    with pytest.raises(ValueError, match="rank 4 is out of range"):
        topo.in_neighbors(4)
    with pytest.raises(ValueError, match="out of range"):
        topo.recv_weights(-1)
    with pytest.raises(TypeError, match="integer"):
        topo.out_neighbors(1.0)


def test_stochasticity_predicates():
    row = T.from_weights([[0.5, 0.5], [0.25, 0.75]])
    assert row.is_row_stochastic() and not row.is_column_stochastic()
    col = T.from_weights([[0.5, 0.25], [0.5, 0.75]])
    assert col.is_column_stochastic() and not col.is_row_stochastic()
    assert not col.is_doubly_stochastic()
    assert T.from_weights([[0.5, 0.5 + 1e-9], [0.5, 0.5]]).is_row_stochastic(atol=1e-6)
    assert not T.from_weights([[0.5, 0.5 + 1e-9], [0.5, 0.5]]).is_row_stochastic()
    assert T.ring(5).is_symmetric() and not T.ring(5, 1).is_symmetric()


def test_immutability():
    topo = T.exponential(8)
    w = topo.weights
    assert w.dtype == np.float64 and not w.flags.writeable
    with pytest.raises(ValueError):
        w[0, 0] = 1.0
    with pytest.raises(ValueError):
        w.flags.writeable = True
    with pytest.raises(AttributeError):
        topo.name = "other"
    with pytest.raises(AttributeError):
        topo.foo = 1
    with pytest.raises(AttributeError):
        del topo._weights
    # the input array is copied
    src = np.full((3, 3), 1 / 3)
    topo = T.from_weights(src)
    src[0, 0] = 5.0
    assert topo.weights[0, 0] == 1 / 3


def test_hash_and_equality():
    a, b = T.exponential(8), T.exponential(8)
    assert a is not b and a == b and hash(a) == hash(b)
    assert a != T.exponential(9) and a != T.ring(8)
    # name is not part of equality; the weights are
    c = T.from_weights(np.array(a.weights), name="another name")
    assert c == a and hash(c) == hash(a)
    # integer input converts to float64; -0.0 and 0.0 are equal
    assert T.from_weights([[1]]) == T.fully_connected(1)
    assert T.from_weights([[-0.0, 1.0], [1.0, 0.0]]) == T.from_weights([[0.0, 1], [1, 0]])
    d = {a: "exp", T.ring(8): "ring"}
    assert d[T.exponential(8)] == "exp" and d[T.ring(8)] == "ring"
    assert len({T.star(4), T.star(4), T.star(4, 1)}) == 2
    assert a != "exponential(8)"


def test_pickle_and_copy():
    for topo in (T.exponential(12), T.ring(1), T.mesh_grid_2d(6)):
        back = pickle.loads(pickle.dumps(topo))
        assert back == topo and hash(back) == hash(topo) and back.name == topo.name
        assert not back.weights.flags.writeable
        assert copy.deepcopy(topo) == topo and copy.copy(topo) == topo
    sched = T.inner_outer_ring(8, 4)
    back = pickle.loads(pickle.dumps(sched))
    assert back == sched and hash(back) == hash(sched) and back.name == sched.name


# ---------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("weights, exc, pattern", [
    ([[True, False], [False, True]], TypeError, "boolean"),
    (np.eye(2, dtype=complex), TypeError, "complex"),
    ([["a", "b"], ["c", "d"]], TypeError, "real numbers"),
    ([[1.0, None], [0.0, 1.0]], TypeError, "real numbers"),
    ([1.0, 0.0], ValueError, "2-D"),
    (np.ones((2, 2, 2)), ValueError, "2-D"),
    (np.ones((2, 3)), ValueError, "square"),
    (np.zeros((0, 0)), ValueError, "empty"),
    ([[0.5, np.nan], [0.5, 0.5]], ValueError, re.escape("W[0, 1] = nan")),
    ([[0.5, 0.5], [np.inf, 0.5]], ValueError, re.escape("W[1, 0] = inf")),
    ([[0.5, 0.5, 0], [0, 0.5, 0.5], [0.6, 0.5, -0.1]], ValueError,
     re.escape("W[2, 2] = -0.1")),
    ([[1.0, 0.0], [0.0, 0.0]], ValueError, r"row\(s\) \[1\].*all zero"),
])
def test_from_weights_bad_input(weights, exc, pattern):
    with pytest.raises(exc, match=pattern):
        T.from_weights(weights)


def test_negative_weight_location():
    w = np.full((4, 4), 0.25)
    w[2, 3] = -0.1
    with pytest.raises(ValueError, match=re.escape("W[2, 3] = -0.1")):
        T.Topology(w)


def test_disconnected_graph_warns():
    with pytest.warns(T.TopologyWarning, match="not strongly connected"):
        T.from_weights(np.eye(3))
    with pytest.warns(T.TopologyWarning, match="not strongly connected"):
        T.from_weights([[1.0, 0.0], [0.5, 0.5]])  # 0 -> 1 only
    with pytest.warns(T.TopologyWarning):
        T.from_networkx(nx.empty_graph(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        T.from_weights(np.eye(3), check_connected=False)
        T.from_weights([[1.0]])
        T.from_weights(T.ring(4).weights)
        for n in SIZES:
            all_builtins(n)
            all_schedules(n)


@pytest.mark.parametrize("fn, args, exc, pattern", [
    (T.exponential, (0,), ValueError, "n must be >= 1"),
    (T.exponential, (-3,), ValueError, "n must be >= 1"),
    (T.exponential, (4.0,), TypeError, "n must be an integer"),
    (T.exponential, (True,), TypeError, "bool"),
    (T.exponential, (4, 1), ValueError, "base must be an integer >= 2"),
    (T.exponential, (4, 2.5), TypeError, "base must be an integer"),
    (T.symmetric_exponential, (0,), ValueError, "n must be >= 1"),
    (T.symmetric_exponential, (8, 0), ValueError, "base"),
    (T.ring, (4, 3), ValueError, "style must be 0"),
    (T.ring, (4, -1), ValueError, "style"),
    (T.ring, (4, "left"), TypeError, "style must be an integer"),
    (T.ring, (0,), ValueError, "n must be >= 1"),
    (T.mesh_grid_2d, (6, (4, 2)), ValueError, "does not match n=6"),
    (T.mesh_grid_2d, (6, (3, 2, 1)), ValueError, "pair"),
    (T.mesh_grid_2d, (0,), ValueError, "n must be >= 1"),
    (T.star, (4, 4), ValueError, "center 4 is out of range"),
    (T.star, (4, -1), ValueError, "out of range"),
    (T.fully_connected, (0,), ValueError, "n must be >= 1"),
    (T.fully_connected, ("8",), TypeError, "integer"),
    (T.one_peer_exponential, (0,), ValueError, "n must be >= 1"),
    (T.inner_outer_ring, (8, 3), ValueError, "multiple of local_size=3"),
    (T.inner_outer_ring, (8, 0), ValueError, "local_size must be >= 1"),
    (T.inner_outer_exponential, (10, 4), ValueError, "multiple"),
    (T.machine_one_peer_exponential, (9, 2), ValueError, "multiple"),
    (T.one_peer, (np.eye(2),), TypeError, "needs a Topology"),
])
def test_constructor_bad_input(fn, args, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fn(*args)


# ---------------------------------------------------------------------------------------
# networkx interop and Metropolis-Hastings
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_networkx_round_trip(n):
    for topo in all_builtins(n):
        g = topo.to_networkx()
        assert isinstance(g, nx.DiGraph) and sorted(g.nodes) == list(range(n))
        # BlueFog's convention: to_numpy_array(G)[j, i] is the weight i gives to j
        np.testing.assert_array_equal(nx.to_numpy_array(g, nodelist=range(n)).T,
                                      topo.weights)
        assert T.from_networkx(g) == topo


def test_to_networkx_edges():
    g = T.ring(4, style=2).to_networkx()  # i receives from i-1: edges i-1 -> i
    assert set(g.edges) == {(0, 1), (1, 2), (2, 3), (3, 0), (0, 0), (1, 1), (2, 2), (3, 3)}
    assert g[3][0]["weight"] == 0.5 and g[0][0]["weight"] == 0.5
    with pytest.warns(T.TopologyWarning):
        g = T.from_weights([[0.0, 1.0], [0.0, 1.0]]).to_networkx()  # no self weight at 0
    assert set(g.edges) == {(1, 0), (1, 1)}


def test_from_networkx_weighted_digraph():
    g = nx.DiGraph()
    g.add_nodes_from([0, 1, 2])
    g.add_edge(0, 1, weight=0.3)   # 1 receives 0.3 from 0
    g.add_edge(1, 0, weight=0.4)   # 0 receives 0.4 from 1
    g.add_edge(1, 2, weight=0.5)
    g.add_edge(2, 0, weight=0.1)
    g.add_edge(0, 0, weight=0.5)
    g.add_edge(1, 1, weight=0.7)
    g.add_edge(2, 2, weight=0.5)
    assert_w(T.from_networkx(g), [[0.5, 0.4, 0.1], [0.3, 0.7, 0.0], [0.0, 0.5, 0.5]])
    # a custom attribute name
    h = nx.DiGraph()
    h.add_edge(0, 1, w=1.0)
    h.add_edge(1, 0, w=1.0)
    assert_w(T.from_networkx(h, weight="w"), [[0.0, 1.0], [1.0, 0.0]])


def test_from_networkx_unweighted():
    # undirected path 0 - 1 - 2: uniform 1/(deg+1)
    assert_w(T.from_networkx(nx.path_graph(3)), [[.5, .5, 0], [1 / 3, 1 / 3, 1 / 3],
                                                 [0, .5, .5]])
    # directed cycle 0 -> 1 -> 2 -> 0; self-loops are ignored for the degree
    g = nx.DiGraph([(0, 1), (1, 2), (2, 0), (1, 1)])
    assert_w(T.from_networkx(g), [[.5, 0, .5], [.5, .5, 0], [0, .5, .5]])
    # the complete graph gives fully_connected
    assert T.from_networkx(nx.complete_graph(5)) == T.fully_connected(5)
    # weighted undirected Graph: both directions
    u = nx.Graph()
    u.add_edge(0, 1, weight=0.25)
    u.add_edge(0, 0, weight=0.75)
    u.add_edge(1, 1, weight=0.75)
    assert_w(T.from_networkx(u), [[.75, .25], [.25, .75]])
    # single node
    assert_w(T.from_networkx(nx.empty_graph(1)), [[1.0]])


def test_from_networkx_bad_input():
    with pytest.raises(ValueError, match="exactly the integers 0..1"):
        T.from_networkx(nx.relabel_nodes(nx.path_graph(2), {0: 0, 1: 2}))
    with pytest.raises(ValueError, match="exactly the integers"):
        T.from_networkx(nx.relabel_nodes(nx.path_graph(2), {0: "a", 1: "b"}))
    with pytest.raises(ValueError, match="no nodes"):
        T.from_networkx(nx.DiGraph())
    g = nx.DiGraph()
    g.add_edge(0, 1, weight=0.5)
    g.add_edge(1, 0)
    with pytest.raises(ValueError, match="some edges have a 'weight'"):
        T.from_networkx(g)
    with pytest.raises(TypeError, match="multigraph"):
        T.from_networkx(nx.MultiDiGraph([(0, 1), (1, 0)]))
    bad = nx.DiGraph()
    bad.add_edge(0, 1, weight=-1.0)
    bad.add_edge(1, 0, weight=1.0)
    with pytest.raises(ValueError, match="non-negative"):
        T.from_networkx(bad)


def test_metropolis_hastings_path_by_hand():
    t = 1 / 3
    path4 = [[2 * t, t, 0, 0], [t, t, t, 0], [0, t, t, t], [0, 0, t, 2 * t]]
    assert_w(T.metropolis_hastings(nx.path_graph(4)), path4)
    adj = np.array([[0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1], [0, 0, 1, 0]])
    assert_w(T.metropolis_hastings(adj), path4)
    assert_w(T.metropolis_hastings(adj.astype(bool)), path4)
    assert_w(T.metropolis_hastings(T.from_networkx(nx.path_graph(4))), path4)
    assert_w(T.metropolis_hastings(nx.path_graph(3)), [[2 * t, t, 0], [t, t, t], [0, t, 2 * t]])
    # star with centre 0 and 3 leaves: centre degree 4, leaves 2
    q = 1 / 4
    assert_w(T.metropolis_hastings(nx.star_graph(3)),
             [[q, q, q, q], [q, .75, 0, 0], [q, 0, .75, 0], [q, 0, 0, .75]])
    assert_w(T.metropolis_hastings(np.zeros((1, 1))), [[1.0]])
    # a symmetric DiGraph is fine, with the diagonal ignored
    assert_w(T.metropolis_hastings(nx.DiGraph([(0, 1), (1, 0), (0, 0)])), [[.5, .5], [.5, .5]])


def test_metropolis_hastings_random_graph():
    g = nx.gnp_random_graph(10, 0.4, seed=3)
    topo = T.metropolis_hastings(g)
    assert_w(topo, ref_metropolis(10, list(g.edges)), atol=1e-15)
    assert topo.is_symmetric() and topo.is_doubly_stochastic()


def test_metropolis_hastings_bad_input():
    with pytest.raises(ValueError, match="undirected.*edge 0 -> 1 exists"):
        T.metropolis_hastings(nx.DiGraph([(0, 1), (1, 2), (2, 1)]))
    with pytest.raises(ValueError, match="undirected"):
        T.metropolis_hastings(np.array([[0, 1], [0, 0]]))
    with pytest.raises(ValueError, match="undirected"):
        T.metropolis_hastings(T.ring(4, 1))
    with pytest.raises(ValueError, match=re.escape("only 0/1, got A[0, 1] = 2")):
        T.metropolis_hastings(np.array([[0, 2], [2, 0]]))
    with pytest.raises(ValueError, match="square"):
        T.metropolis_hastings(np.ones((2, 3)))
    with pytest.raises(TypeError, match="complex"):
        T.metropolis_hastings(np.ones((2, 2), dtype=complex))


# ---------------------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------------------


def all_schedules(n):
    out = [T.one_peer_exponential(n), T.one_peer(T.exponential(n)), T.one_peer(T.ring(n))]
    for local in (1, 2, 3, 4):
        if n % local == 0:
            out += [T.inner_outer_ring(n, local), T.inner_outer_exponential(n, local),
                    T.machine_one_peer_exponential(n, local)]
    return out


def test_schedule_object():
    a, b = T.ring(4), T.exponential(4)
    s = T.Schedule([a, b], name="mine")
    assert s.period == len(s) == 2 and s.size == 4 and s.name == "mine"
    assert s.at(0) == a and s.at(1) == b and s.at(7) == b and s.at(np.int64(4)) == a
    assert s.at(-1) == b
    assert s[0] == a and s[-1] == b and list(s) == [a, b] and s.topologies == (a, b)
    st = s.stacked_weights
    assert st.shape == (2, 4, 4) and st.dtype == np.float64 and not st.flags.writeable
    np.testing.assert_array_equal(st[1], b.weights)
    with pytest.raises(ValueError):
        st[0, 0, 0] = 1.0
    # equality / hash from the entries, not the name
    assert s == T.Schedule((a, b)) and hash(s) == hash(T.Schedule([a, b], name="x"))
    assert s != T.Schedule([b, a]) and s != a
    assert {s: 1}[T.Schedule([T.ring(4), T.exponential(4)])] == 1
    with pytest.raises(AttributeError):
        s.name = "y"
    # product over one period and from an offset
    np.testing.assert_allclose(s.product(), b.weights @ a.weights, atol=1e-15)
    np.testing.assert_allclose(s.product(1, 3), b.weights @ a.weights @ b.weights,
                               atol=1e-15)
    np.testing.assert_array_equal(s.product(0, 0), np.eye(4))
    # union: mean of the entries
    np.testing.assert_allclose(s.union().weights, (a.weights + b.weights) / 2, atol=1e-15)
    with pytest.raises(TypeError, match="integer"):
        s.at(1.5)


def test_schedule_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        T.Schedule([])
    with pytest.raises(ValueError, match="entry 0 has size 4, entry 1 has size 5"):
        T.Schedule([T.ring(4), T.ring(5)])
    with pytest.raises(TypeError, match="entry 1 is a ndarray"):
        T.Schedule([T.ring(4), np.eye(4)])
    with pytest.raises(TypeError, match="single"):
        T.Schedule(T.ring(4))


def test_one_peer_exponential_by_hand():
    assert_schedule(T.one_peer_exponential(1), [[[1.0]]])
    assert_schedule(T.one_peer_exponential(2), [np.full((2, 2), 0.5)])
    # n = 4: tau = 2, offsets 1 then 2
    assert_schedule(T.one_peer_exponential(4), [
        [[.5, 0, 0, .5], [.5, .5, 0, 0], [0, .5, .5, 0], [0, 0, .5, .5]],
        [[.5, 0, .5, 0], [0, .5, 0, .5], [.5, 0, .5, 0], [0, .5, 0, .5]],
    ])
    # n = 5: tau = 3, offsets 1, 2, 4
    sched = T.one_peer_exponential(5)
    assert_schedule(sched, [half_half(5, {r: (r + d) % 5 for r in range(5)})
                            for d in (1, 2, 4)])


@pytest.mark.parametrize("n", SIZES + [6, 9, 32])
def test_one_peer_exponential_loop(n):
    tau = max(1, math.ceil(math.log2(n))) if n > 1 else 1
    sched = T.one_peer_exponential(n)
    if n == 1:
        expected = [np.eye(1)]
    else:
        expected = [half_half(n, {r: (r + 2 ** t) % n for r in range(n)}) for t in range(tau)]
    assert_schedule(sched, expected)
    for topo in sched:
        assert topo.is_doubly_stochastic()
        assert all(topo.in_degree(r) == (1 if n > 1 else 0) for r in range(n))


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_one_peer_exponential_exact_average(n):
    sched = T.one_peer_exponential(n)
    tau = int(math.log2(n))
    assert sched.period == tau
    target = np.full((n, n), 1.0 / n)
    for start in range(0, 2 * tau + 1):
        prod = np.eye(n)
        for t in range(start, start + tau):
            prod = np.asarray(sched.at(t).weights) @ prod
        assert np.array_equal(prod, target), (n, start)
        # one step fewer is not yet exact
        if tau > 1:
            partial = np.eye(n)
            for t in range(start, start + tau - 1):
                partial = np.asarray(sched.at(t).weights) @ partial
            assert not np.allclose(partial, target)


def test_one_peer_exponential8_by_hand():
    # exponential(8): out-neighbours r+1, r+2, r+4 (clockwise), so step t sends to r + 2**t
    expected = [half_half(8, {r: (r + d) % 8 for r in range(8)}) for d in (1, 2, 4)]
    assert_schedule(T.one_peer(T.exponential(8)), expected)
    assert T.one_peer(T.exponential(8)) == T.one_peer_exponential(8)
    gen = T.send_recv_ranks(T.one_peer(T.exponential(8)), 3)
    assert [next(gen) for _ in range(4)] == [([4], [2]), ([5], [1]), ([7], [7]), ([4], [2])]


def test_one_peer_irregular_by_hand():
    # edges: 0->1, 0->2, 1->2, 2->0, 2->3, 3->0 (strongly connected: 0->1->2->3->0)
    g = nx.DiGraph([(0, 1), (0, 2), (1, 2), (2, 0), (2, 3), (3, 0)])
    sched = T.one_peer(T.from_networkx(g))
    # clockwise out-lists: 0: [1, 2]; 1: [2]; 2: [3, 0]; 3: [0]; period lcm(2, 1, 2, 1) = 2
    t = 1 / 3
    step0 = [[.5, 0, 0, .5], [.5, .5, 0, 0], [0, .5, .5, 0], [0, 0, .5, .5]]  # 0>1 1>2 2>3 3>0
    step1 = [[t, 0, t, t], [0, 1, 0, 0], [t, t, t, 0], [0, 0, 0, 1]]          # 0>2 1>2 2>0 3>0
    assert_schedule(sched, [step0, step1])
    assert sched.at(0).is_doubly_stochastic()
    assert sched.at(1).is_row_stochastic() and not sched.at(1).is_column_stochastic()
    gen = T.send_recv_ranks(sched, 2)
    assert [next(gen) for _ in range(3)] == [([3], [1]), ([0], [0, 1]), ([3], [1])]


def test_one_peer_degrees_and_period():
    # receivers' rows: 0 <- {1, 2}; 1 <- {0}; 2 <- {0, 1}; 3 <- {0, 2}
    w = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 1, 1]], dtype=float)
    w /= w.sum(axis=1, keepdims=True)
    with pytest.warns(T.TopologyWarning):  # rank 3 sends to nobody
        base = T.from_weights(w)
    # clockwise out-lists: 0: [1, 2, 3]; 1: [2, 0]; 2: [3, 0]; 3: []  -> period lcm(3, 2, 2)
    assert [base.out_neighbors(r) for r in range(4)] == [[1, 2, 3], [0, 2], [0, 3], []]
    sched = T.one_peer(base)
    assert sched.period == 6
    sends = {0: [1, 2, 3, 1, 2, 3], 1: [2, 0, 2, 0, 2, 0], 2: [3, 0, 3, 0, 3, 0]}
    for t in range(6):
        topo = sched.at(t)
        for r, seq in sends.items():
            assert topo.out_neighbors(r) == [seq[t]]
        assert topo.out_neighbors(3) == []
        assert topo.is_row_stochastic()
    t3 = 1 / 3  # step 1: 0 -> 2, 1 -> 0, 2 -> 0
    assert_w(sched.at(1), [[t3, t3, t3, 0], [0, 1, 0, 0], [.5, 0, .5, 0], [0, 0, 0, 1]])
    with pytest.raises(ValueError, match="max_period=5"):
        T.one_peer(base, max_period=5)


def test_inner_outer_ring_8_4_by_hand():
    sends = [
        {0: 4, 4: 0, 1: 2, 2: 3, 3: 1, 5: 6, 6: 7, 7: 5},  # outer local rank 0
        {1: 5, 5: 1, 0: 2, 2: 3, 3: 0, 4: 6, 6: 7, 7: 4},  # outer local rank 1
        {2: 6, 6: 2, 0: 1, 1: 3, 3: 0, 4: 5, 5: 7, 7: 4},
        {3: 7, 7: 3, 0: 1, 1: 2, 2: 0, 4: 5, 5: 6, 6: 4},
    ]
    sched = T.inner_outer_ring(8, 4)
    assert_schedule(sched, [half_half(8, s) for s in sends])
    for t, s in enumerate(sends):
        gen_pairs = [next(T.send_recv_ranks(sched.at(t), r)) for r in range(8)]
        assert gen_pairs == [([s[r]], [src for src, d in s.items() if d == r])
                             for r in range(8)]


def test_inner_outer_ring_6_3_and_local_size_2():
    sends = [{0: 3, 3: 0, 1: 2, 2: 1, 4: 5, 5: 4},
             {1: 4, 4: 1, 0: 2, 2: 0, 3: 5, 5: 3},
             {2: 5, 5: 2, 0: 1, 1: 0, 3: 4, 4: 3}]
    assert_schedule(T.inner_outer_ring(6, 3), [half_half(6, s) for s in sends])
    # local_size 2, 3 machines: only the outer rank exchanges, the inner one idles
    assert_schedule(T.inner_outer_ring(6, 2), [half_half(6, {0: 2, 2: 4, 4: 0}),
                                               half_half(6, {1: 3, 3: 5, 5: 1})])
    # local_size 2, 2 machines
    assert_schedule(T.inner_outer_ring(4, 2), [half_half(4, {0: 2, 2: 0}),
                                               half_half(4, {1: 3, 3: 1})])
    # one machine: the outer rank idles, the inner ring skips it
    assert_schedule(T.inner_outer_ring(3, 3), [half_half(3, {1: 2, 2: 1}),
                                               half_half(3, {0: 2, 2: 0}),
                                               half_half(3, {0: 1, 1: 0})])
    # local_size 1: a ring over machines (receive from i - 1)
    assert_schedule(T.inner_outer_ring(4, 1), [np.array(T.ring(4, 2).weights)])
    assert_schedule(T.inner_outer_ring(1, 1), [np.eye(1)])


def test_inner_outer_exponential_8_4_by_hand():
    sends = [
        {0: 4, 4: 0, 1: 2, 2: 3, 3: 1, 5: 6, 6: 7, 7: 5},  # inner [1,2,3], distance 1
        {1: 5, 5: 1, 0: 3, 2: 0, 3: 2, 4: 7, 6: 4, 7: 6},  # inner [0,2,3], distance 2
        {2: 6, 6: 2, 0: 1, 1: 3, 3: 0, 4: 5, 5: 7, 7: 4},  # inner [0,1,3], distance 1
        {3: 7, 7: 3, 0: 2, 1: 0, 2: 1, 4: 6, 5: 4, 6: 5},  # inner [0,1,2], distance 2
    ]
    assert_schedule(T.inner_outer_exponential(8, 4), [half_half(8, s) for s in sends])


def test_inner_outer_exponential_16_4():
    sched = T.inner_outer_exponential(16, 4)  # M=4: outer distances 1, 2 every 4 steps
    assert sched.period == 8
    for t in range(8):
        o, d_out = t % 4, (1, 2)[t // 4]
        topo = sched.at(t)
        assert topo.is_doubly_stochastic()
        for m in range(4):
            assert topo.out_neighbors(4 * m + o) == [4 * ((m + d_out) % 4) + o]
            assert topo.in_neighbors(4 * m + o) == [4 * ((m - d_out) % 4) + o]
        for r in range(16):
            assert topo.in_degree(r) == 1 and topo.out_degree(r) == 1
    # the product over a period averages much better than any step
    assert ref_gap(sched.product()) > 0.5
    # local_size 2 and one machine: degenerate parts idle
    assert_schedule(T.inner_outer_exponential(4, 2), [half_half(4, {0: 2, 2: 0}),
                                                      half_half(4, {1: 3, 3: 1})])
    assert_schedule(T.inner_outer_exponential(4, 4), [
        half_half(4, {1: 2, 2: 3, 3: 1}), half_half(4, {0: 3, 2: 0, 3: 2}),
        half_half(4, {0: 1, 1: 3, 3: 0}), half_half(4, {0: 2, 1: 0, 2: 1})])


def test_machine_one_peer_exponential():
    # n=8, L=2: M=4, machine distances 1, 2 -> rank distances 2, 4
    assert_schedule(T.machine_one_peer_exponential(8, 2),
                    [half_half(8, {r: (r + 2) % 8 for r in range(8)}),
                     half_half(8, {r: (r + 4) % 8 for r in range(8)})])
    # n=6, L=2: M=3, tau=2, machine distances 1, 2
    assert_schedule(T.machine_one_peer_exponential(6, 2),
                    [half_half(6, {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}),
                     half_half(6, {0: 4, 1: 5, 2: 0, 3: 1, 4: 2, 5: 3})])
    assert_schedule(T.machine_one_peer_exponential(4, 4), [np.eye(4)])
    # product of one period averages each local rank across machines exactly (M = 4)
    prod = T.machine_one_peer_exponential(8, 2).product()
    expected = np.zeros((8, 8))
    for i in range(8):
        for j in range(8):
            if i % 2 == j % 2:
                expected[i, j] = 0.25
    assert np.array_equal(prod, expected)


@pytest.mark.parametrize("n", SIZES)
def test_schedules_stochastic(n):
    for sched in all_schedules(n):
        assert sched.size == n and sched.stacked_weights.shape == (sched.period, n, n)
        for topo in sched:
            assert topo.is_row_stochastic(), sched
            if not sched.name.startswith("one_peer(ring"):
                assert topo.is_doubly_stochastic(), sched


def test_send_recv_ranks():
    sched = T.inner_outer_ring(8, 4)
    for rank in range(8):
        gen = T.send_recv_ranks(sched, rank)
        for t in range(10):
            send, recv = next(gen)
            assert send == sched.at(t).out_neighbors(rank)
            assert recv == sched.at(t).in_neighbors(rank)
    gen = T.send_recv_ranks(T.exponential(8), 0)
    for _ in range(3):
        assert next(gen) == ([1, 2, 4], [4, 6, 7])
    gen = T.send_recv_ranks(T.one_peer_exponential(8), 0)
    assert [next(gen) for _ in range(4)] == [([1], [7]), ([2], [6]), ([4], [4]), ([1], [7])]
    # the yielded lists are fresh copies
    gen = T.send_recv_ranks(T.ring(4), 0)
    first = next(gen)
    first[0].append(99)
    assert next(gen) == ([1, 3], [1, 3])
    with pytest.raises(ValueError, match="out of range"):
        T.send_recv_ranks(T.ring(4), 4)
    with pytest.raises(TypeError, match="Schedule or a Topology"):
        T.send_recv_ranks(np.eye(4), 0)


def test_module_is_pure_numpy():
    """jaxfog.topology (graphs and schedules) imports neither jax, mpi4py nor
    (eagerly) networkx."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import jaxfog.topology as mod\n"
        "mod.one_peer_exponential(8); mod.exponential(5).spectral_gap()\n"
        "bad = [m for m in ('jax', 'mpi4py', 'networkx') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
