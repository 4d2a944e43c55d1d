"""Decentralized ridge regression on scikit-learn's diabetes data (no download).

    minimise  sum_i f_i(x),  f_i(x) = 1/2 ||A_i x - b_i||^2 + ridge / (2 n) ||x||^2

Rows are sorted by target and dealt to ranks in contiguous blocks, so every
rank sees a different part of the problem (heterogeneous data). The small
ridge term (total weight RIDGE) keeps the problem well conditioned enough
for the examples to converge in a few thousand iterations.
"""

from __future__ import annotations

import numpy as np

RIDGE = 30.0


def load(rank: int, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(A_rank, b_rank, x_star): this rank's rows and the centralized minimiser."""
    from sklearn.datasets import load_diabetes

    features, target = load_diabetes(return_X_y=True)
    features = (features - features.mean(0)) / features.std(0)
    a = np.hstack([features, np.ones((len(features), 1))])
    b = (target - target.mean()) / target.std()
    order = np.argsort(b, kind="stable")
    a, b = a[order], b[order]
    x_star = np.linalg.solve(a.T @ a + RIDGE * np.eye(a.shape[1]), a.T @ b)
    blocks = np.array_split(np.arange(len(b)), size)
    return a[blocks[rank]], b[blocks[rank]], x_star


def gradient(a, b, x, size: int):
    """grad f_i(x) (numpy or jax arrays)."""
    return a.T @ (a @ x - b) + (RIDGE / size) * x


def smoothness(a: np.ndarray, size: int) -> float:
    """L_i, the Lipschitz constant of grad f_i: largest eigenvalue of its Hessian."""
    return float(np.linalg.eigvalsh(a.T @ a)[-1]) + RIDGE / size
