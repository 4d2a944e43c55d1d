"""Global collectives: allreduce (sum or mean), broadcast, allgather."""

from __future__ import annotations

from typing import Any

from jaxfog.ops import _args, _backends


def allreduce(x: Any, op: str = "mean", *, name: str | None = None) -> Any:
    r"""Sum or mean over all ranks: :math:`y = \sum_j x_j` or :math:`\frac1n \sum_j x_j`.

    Args:
      x: an array or a pytree (one message per dtype).
      op: ``"mean"`` or ``"sum"``.
      name: a name for error messages.

    Returns:
      The same value on every rank. Integer means are rounded to nearest,
      ties to even; integer sums are exact.

    Its adjoint is the same allreduce, so gradient averaging composes with
    ``jax.grad``.

    Example::

        mean_loss = jaxfog.allreduce(loss)
    """
    return _backends.apply("allreduce", x, _args.allreduce(op=op, name=name))


def broadcast(x: Any, root: int = 0, *, name: str | None = None) -> Any:
    """Every rank gets ``x`` of rank ``root``: ``y_i = x_root``.

    Args:
      x: an array or a pytree (one message).
      root: the rank whose value is sent.
      name: a name for error messages.

    Returns:
      ``x_root`` on every rank. The adjoint sums the cotangents to the root.

    Example::

        params = jaxfog.broadcast(params, root=0)  # same initial model everywhere
    """
    return _backends.apply("broadcast", x, _args.broadcast(root=root, name=name))


def allgather(x: Any, *, name: str | None = None) -> Any:
    """Concatenates every rank's ``x`` along axis 0, in rank order.

    Args:
      x: an array or a pytree; all ranks pass the same shapes (a scalar counts
        as shape ``(1,)``).
      name: a name for error messages.

    Returns:
      Each leaf of shape ``(size * d0, *rest)``; block r is rank r's value.

    Example::

        everyone = jaxfog.allgather(jnp.array([float(jaxfog.rank())]))  # [0., 1., ...]
    """
    return _backends.apply("allgather", x, _args.allgather(name=name))


__all__ = ["allgather", "allreduce", "broadcast"]
