"""Window test cases shared by the MPI and simulated tests: a numpy model of
the windows (docs/architecture.rst, "Windows") and seeded random op sequences that the
same per-agent code runs on both backends."""

from __future__ import annotations

import numpy as np


class WindowModel:
    """Every rank's window, in numpy, following the semantics in docs/architecture.rst."""

    def __init__(self, X: np.ndarray, sources: np.ndarray, *, zero_init: bool = False):
        n = X.shape[0]
        self.sources = sources
        self.published = X.copy()
        fill = 0.0 if zero_init else 1.0
        # [i, j]: j's slot on i
        self.slots = np.where(sources[..., None], fill * X[:, None, :], 0.0)
        self.versions = np.zeros((n, n), int)
        self.p = np.ones(n)
        self.slot_p = np.where(sources, fill, 0.0)

    def put(self, X, D, self_weights, accumulate: bool):
        """Every rank i puts X[i] to the ranks k with D[i, k] != 0 (weight D[i, k])."""
        p = self.p.copy()
        for i, k in zip(*np.nonzero(D)):
            assert self.sources[k, i], (k, i)
            value, mass = D[i, k] * X[i], D[i, k] * p[i]
            if accumulate:
                self.slots[k, i] += value
                self.slot_p[k, i] += mass
            else:
                self.slots[k, i] = value
                self.slot_p[k, i] = mass
                self.versions[k, i] += 1
        self.published = X.copy()
        self.p = self_weights * p
        return self_weights[:, None] * X

    def get(self, G):
        """Every rank i reads each j with G[i, j] != 0 into its slot (weight G[i, j])."""
        published, p = self.published.copy(), self.p.copy()
        for i, j in zip(*np.nonzero(G)):
            self.slots[i, j] = G[i, j] * published[j]
            self.slot_p[i, j] = G[i, j] * p[j]
            self.versions[i, j] += 1

    def update(self, X, self_weights, U, reset: bool):
        """y_i = a_i X[i] + sum_j U[i, j] slot[i, j] over the sources j with U[i, j] != 0."""
        used = (U != 0) & self.sources
        Y = self_weights[:, None] * X + np.einsum("ij,ijk->ik", U * used, self.slots)
        self.p = self_weights * self.p + (U * used * self.slot_p).sum(axis=1)
        self.published = Y.copy()
        self.versions[used] = 0
        if reset:
            self.slots[used] = 0.0
            self.slot_p[used] = 0.0
        return Y


def random_sequence(seed: int, sources: np.ndarray, steps: int) -> list[tuple]:
    """Seeded steps ``(op, matrix, self_weights, reset)``; every rank runs the
    same op per step with its own row of the matrix."""
    rng = np.random.default_rng(seed)
    n = sources.shape[0]
    sequence = []
    for _ in range(steps):
        op = rng.choice(["put", "accumulate", "get", "update", "update"])
        chosen = sources & (rng.random((n, n)) < 0.7)
        weights = np.round(rng.uniform(0.25, 2.0, (n, n)) * 4) / 4  # dyadic: exact sums
        M = np.where(chosen, weights, 0.0)
        if op in ("put", "accumulate"):
            M = M.T  # M[i, k]: i sends to k, which must hold a slot for i
        self_weights = np.round(rng.uniform(0.0, 1.0, n) * 4) / 4
        sequence.append((str(op), M, self_weights, bool(rng.random() < 0.5)))
    return sequence


def model_outputs(X: np.ndarray, sources: np.ndarray, sequence) -> np.ndarray:
    """What every rank's updates return along ``sequence``, stacked [step, rank]."""
    model, x, outs = WindowModel(X, sources), X.copy(), []
    for op, M, a, reset in sequence:
        if op == "get":
            model.get(M)
        elif op == "update":
            x = model.update(x, a, M, reset)
        else:
            x = model.put(x, M, a, accumulate=op == "accumulate")
        outs.append(np.concatenate([x, model.versions, model.p[:, None]], axis=1))
    return np.stack(outs)


def agent_sequence(x, sequence, name: str = "seq"):
    """The per-agent code of ``sequence`` (identical on MPI and simulated agents):
    each step's own value, versions and push-sum weight, stacked."""
    import jax.numpy as jnp

    import jaxfog as jf
    from jaxfog.ops import window as W

    n, r = jf.size(), jf.rank()
    W.win_create(x, name, with_weight=True)
    outs = []
    for op, M, a, reset in sequence:
        row, a_r = jnp.asarray(M)[r], jnp.asarray(a)[r]
        if op == "get":
            W.win_get(name, src_weights=row)
        elif op == "update":
            x = W.win_update(x, name, self_weight=a_r if not isinstance(r, int) else float(a_r),
                             src_weights=row, reset=reset)
        else:
            put = W.win_accumulate if op == "accumulate" else W.win_put
            x = put(x, name, self_weight=a_r if not isinstance(r, int) else float(a_r),
                    dst_weights=row)
        jf.barrier()  # every rank's op has landed before anyone's next one
        versions = W.win_version(name)
        jf.barrier()  # and every rank has read its versions before the next op lands
        outs.append(jnp.concatenate([x, jnp.asarray([versions.get(j, 0) for j in range(n)],
                                                    x.dtype), jnp.reshape(W.win_weight(name),
                                                                          (1,)).astype(x.dtype)]))
    W.win_free(name)
    return jnp.stack(outs)
