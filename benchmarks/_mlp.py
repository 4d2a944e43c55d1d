"""The square tanh MLP whose backward pass the overlap benchmarks time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def mlp(width: int, depth: int) -> list:
    """``depth`` float32 ``width x width`` weight matrices."""
    keys = jax.random.split(jax.random.key(0), depth)
    return [jax.random.normal(k, (width, width), jnp.float32) / np.sqrt(width) for k in keys]


def loss(params, x):
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.mean(x ** 2)
