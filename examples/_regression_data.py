"""Decentralized ridge regression on scikit-learn's diabetes data (no download).

    minimise  sum_i f_i(x),  f_i(x) = 1/2 ||A_i x - b_i||^2 + ridge / (2 n) ||x||^2

Rows are sorted by target and dealt to agents in contiguous blocks, so every
agent sees a different part of the problem (heterogeneous data). Blocks are
padded with zero rows to one length (which changes no f_i), so simulated
agents can be stacked. The small ridge term (total weight RIDGE) keeps the
problem well conditioned enough for the examples to converge in a few
thousand iterations.
"""

from __future__ import annotations

import numpy as np

RIDGE = 30.0


def _all_rows() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_diabetes

    features, target = load_diabetes(return_X_y=True)
    features = (features - features.mean(0)) / features.std(0)
    a = np.hstack([features, np.ones((len(features), 1))])
    b = (target - target.mean()) / target.std()
    order = np.argsort(b, kind="stable")
    return a[order], b[order]


def load(rank: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(A_rank, b_rank, x_star): this agent's rows and the centralized minimiser."""
    a, b = _all_rows()
    x_star = np.linalg.solve(a.T @ a + RIDGE * np.eye(a.shape[1]), a.T @ b)
    blocks = np.array_split(np.arange(len(b)), size)
    rows = max(len(block) for block in blocks)
    a_i = np.zeros((rows, a.shape[1]))
    b_i = np.zeros(rows)
    mine = blocks[rank]
    a_i[:len(mine)], b_i[:len(mine)] = a[mine], b[mine]
    return a_i, b_i, x_star


def gradient(a, b, x, size: int):
    """grad f_i(x) (numpy or jax arrays)."""
    return a.T @ (a @ x - b) + (RIDGE / size) * x


def smoothness(size: int) -> float:
    """max_i L_i, with L_i the largest eigenvalue of f_i's Hessian."""
    return max(float(np.linalg.eigvalsh(a.T @ a)[-1]) + RIDGE / size
               for a, _, _ in (load(r, size) for r in range(size)))
