"""Ctrl-C (SIGINT) during an op's wait for a peer: a ``KeyboardInterrupt``
that names the op, at once.

Python runs its SIGINT handler only between bytecodes of the main thread; a
main thread blocked on an op whose peer never comes would get its
``KeyboardInterrupt`` only at ``JAXFOG_TIMEOUT``. At init, while Python's
default handler (``signal.default_int_handler``) is in place, jaxfog adds a C
handler in front of Python's (``jaxfog/ffi/peer_watch.h``, ``CatchInterrupts``):
Python's still runs first, so its ``KeyboardInterrupt`` is pending as before,
and a wait in flight then fails at once with an error that says
``interrupted (SIGINT)``. Where that error reaches jaxfog's Python code (an
eager op, ``jaxfog.wait``, ``win_mutex``), :func:`converted` raises it as a
``KeyboardInterrupt`` whose message names the op and what it waited for.
Where it reaches the program elsewhere (the result of a ``jax.jit``/``jf.jit``
function read later), the ``KeyboardInterrupt`` is Python's own, raised while
the ``JaxRuntimeError`` naming the op was being handled (its ``__context__``).

A program's own SIGINT handler (installed before ``jaxfog.init``, or after:
``signal.signal`` replaces the C handler) is left alone. Between ops, SIGINT
is Python's ``KeyboardInterrupt`` exactly as without jaxfog.
"""

from __future__ import annotations

import contextlib
import signal
from typing import Iterator

#: What the C++ error of an interrupted wait says (``InterruptedError``).
MARK = "interrupted (SIGINT)"


def catch(lib) -> bool:
    """At init: installs the C handler where Python's default SIGINT handler is
    in place; returns whether it is installed."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return False  # the program's own handler, or SIGINT ignored: left alone
    return bool(lib.jaxfog_catch_interrupts())


def report(error: BaseException | None) -> str | None:
    """The interrupted op's error message (from "jaxfog ...") if ``error`` is
    that error, or was raised while handling it (Python's own
    ``KeyboardInterrupt``, pending since the signal, often fires there)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        if MARK in text:
            start = text.find("jaxfog ")
            return text[start:] if start >= 0 else text
        error = error.__cause__ or error.__context__
    return None


def _pending_handlers() -> None:
    """A Python call: at its start CPython runs pending signal handlers."""


def interrupt(text: str) -> KeyboardInterrupt:
    """The ``KeyboardInterrupt`` for an interrupted op's error ``text``, with
    Python's own pending one (from the same SIGINT) consumed first, so that
    only this one is raised."""
    try:
        _pending_handlers()
    except KeyboardInterrupt:
        pass
    return KeyboardInterrupt(text)


def raise_if_interrupted(error: BaseException) -> None:
    """In an ``except BaseException`` clause: raises an interrupted op's error
    (or Python's ``KeyboardInterrupt`` raised while handling it) as one
    ``KeyboardInterrupt`` naming the op; returns for any other error."""
    text = report(error)
    if text is not None:
        raise interrupt(text) from None


@contextlib.contextmanager
def converted() -> Iterator[None]:
    """:func:`raise_if_interrupted` around a block."""
    try:
        yield
    except BaseException as error:
        raise_if_interrupted(error)
        raise
