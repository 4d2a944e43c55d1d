"""Every exception class jaxfog defines, in one family under :class:`JaxfogError`.

``TypeError`` and ``ValueError`` report bad arguments (at call or construction
time, on the calling rank). Everything else jaxfog raises derives from
:class:`JaxfogError` (itself a ``RuntimeError``), and also from the builtin it
stands for where there is one, so ``except RuntimeError``, ``except
ImportError`` and ``except ValueError`` keep working. Errors raised by a handler
inside compiled code reach Python as JAX's ``jax.errors.JaxRuntimeError`` (XLA
raises it, not jaxfog), with a message that starts with
``jaxfog <op> (op #k on rank r)``. The one warning category, for a legal but
suspicious topology, lives here too.
"""

from __future__ import annotations


class JaxfogError(RuntimeError):
    """A runtime failure of jaxfog: a communication that failed, an unusable
    transport, a neighbour that stopped, an operation out of its context."""


class JaxfogTimeoutError(JaxfogError, TimeoutError):
    """Nothing happened within ``JAXFOG_TIMEOUT`` seconds (a neighbour stopped)."""


class NotInitializedError(JaxfogError):
    """A jaxfog operation was used before ``jaxfog.init()``."""


class BackendError(JaxfogError):
    """An operation the current backend cannot do: MPI-only queries inside
    ``jaxfog.simulate``, simulated windows outside it."""


class FfiLibraryError(JaxfogError, ImportError):
    """The FFI library is missing, or does not match the MPI that mpi4py uses or
    the jaxlib that XLA runs."""


class JaxCompatError(JaxfogError):
    """A private JAX API jaxfog relies on is missing from this JAX version."""


class HandleError(JaxfogError, ValueError):
    """A nonblocking op's handle used wrongly: waited for twice, or not a handle."""


class TimelineError(JaxfogError, ValueError):
    """An input is not a timeline, or two inputs are the same rank."""


class MembershipChange(JaxfogError):
    """Raised by ``jaxfog.elastic.State.steps`` at a step where membership
    changes: inside :func:`jaxfog.elastic.simulate` (its schedule), and inside
    :func:`jaxfog.elastic.run` when ranks are to join in place. Those functions
    catch it and run the program again for the new members."""


class TopologyWarning(UserWarning):
    """Warning for a suspicious but legal topology (e.g. not strongly connected)."""


__all__ = ["BackendError", "FfiLibraryError", "HandleError", "JaxCompatError", "JaxfogError",
           "JaxfogTimeoutError", "MembershipChange", "NotInitializedError", "TimelineError",
           "TopologyWarning"]
