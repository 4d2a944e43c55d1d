"""jaxfog's exceptions: one base for every runtime communication failure.

``TypeError`` and ``ValueError`` report bad arguments (at call or construction
time, on the calling rank). What goes wrong while ranks communicate derives
from :class:`JaxfogError`; a timeout is also a ``TimeoutError``. Errors raised
by a handler inside compiled code reach Python as JAX's
``jax.errors.JaxRuntimeError`` (XLA raises it, not jaxfog), with a message
that starts with ``jaxfog <op> (op #k on rank r)``.
"""

from __future__ import annotations


class JaxfogError(RuntimeError):
    """A runtime failure of jaxfog's communication: a window operation that
    failed, an unusable transport, a neighbour that stopped."""


class JaxfogTimeoutError(JaxfogError, TimeoutError):
    """Nothing happened within ``JAXFOG_TIMEOUT`` seconds (a neighbour stopped)."""


__all__ = ["JaxfogError", "JaxfogTimeoutError"]
