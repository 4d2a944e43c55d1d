"""Independent references for the ops tests: plain numpy on the global matrix X
(row r = rank r's value), built the same way on every rank from a seed."""

from __future__ import annotations

import numpy as np


def global_values(n: int, shape=(7,), seed: int = 0, dtype=np.float64) -> np.ndarray:
    """X with X[r] the value of rank r: distinct, irrational-looking numbers."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, *shape)).astype(dtype)


def local_view_matrix(n: int, self_w, src, dst) -> np.ndarray:
    """The W of BlueFog's local view: W[i, j] = src_i[j] * dst_j.get(i, 1.0).

    self_w[i]: float; src[i]: {j: w}; dst[j]: {i: w}.
    """
    w = np.zeros((n, n))
    for i in range(n):
        w[i, i] = self_w[i]
        for j, s in src[i].items():
            w[i, j] += s * dst[j].get(i, 1.0)
    return w


def random_push_pull(n: int, seed: int):
    """A random directed graph with random weights, some ranks sending or
    receiving nothing, as per-rank (self, src, dst) dicts."""
    rng = np.random.default_rng(seed)
    edges = [(j, i) for i in range(n) for j in range(n) if i != j and rng.random() < 0.5]
    src = [{j: float(rng.uniform(0.1, 1.0)) for j, i2 in edges if i2 == i} for i in range(n)]
    dst = [{i: float(rng.uniform(0.5, 2.0)) for j2, i in edges if j2 == j} for j in range(n)]
    self_w = [float(rng.uniform(0.1, 1.0)) for _ in range(n)]
    return self_w, src, dst


def rank_setup(seed: int = 0, shape=(7,)):
    """A multi-rank test body's start (a body with ``@mpi_test(x64=True)``:
    float64), jaxfog initialised; jaxfog, this rank, the size and every rank's
    :func:`global_values` (the body's inputs)."""
    import jax

    assert jax.config.jax_enable_x64, "a body calling rank_setup runs with @mpi_test(x64=True)"
    import jaxfog as jf

    jf.init()
    return jf, jf.rank(), jf.size(), global_values(jf.size(), shape, seed)
