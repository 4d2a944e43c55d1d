"""Every use of JAX API that is not public, in one place.

jaxfog needs a few things JAX exports no public name for. Each is reached
through one function here, and ``tests/ops/test_jax_compat.py`` has one test per
touchpoint, so that a JAX upgrade that moves one fails in a named test instead
of at import or, worse, silently. Nothing here is monkeypatched on the
``jaxfog.jit`` path; the one patch left (:func:`keep_aot_calls_on_token_path`)
only concerns AOT-compiled plain ``jax.jit``.

Supported: the last three minor jax releases, :data:`TESTED_JAX` (0.10, 0.11,
0.12; the rule for the next one is in docs/building.rst). Where JAX changed a
touchpoint between them, the function here takes every form.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
from jax.extend import core as jex_core

from jaxfog import _interrupt
from jaxfog.errors import JaxCompatError

#: The jax releases this module was written and tested against.
TESTED_JAX = ((0, 10), (0, 11), (0, 12))

#: Touchpoints that failed when jaxfog was imported: name -> the error. A JAX
#: that moved one still imports jaxfog; the ops that need it raise
#: :class:`JaxCompatError` naming it, and ``tests/ops/test_jax_compat.py`` fails.
BROKEN: dict[str, BaseException] = {}


def _touchpoint(fn: Callable) -> Callable:
    """Records (instead of raising) a touchpoint that this JAX lacks."""

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ImportError, AttributeError, TypeError) as error:
            BROKEN[fn.__name__] = error
            return None

    return guarded


def require(*names: str) -> None:
    """Raises JaxCompatError if any of the named touchpoints is broken."""
    broken = {n: BROKEN[n] for n in names if n in BROKEN}
    if broken:
        detail = "; ".join(f"{n}: {type(e).__name__}: {e}" for n, e in broken.items())
        raise JaxCompatError(
            f"jaxfog needs JAX internals that jax {jax.__version__} does not have "
            f"({detail}); jaxfog is tested with jax {TESTED_JAX}")


def jax_version() -> tuple[int, int]:
    major, minor = jax.__version_info__[:2]
    return int(major), int(minor)


# --- effects ---------------------------------------------------------------


@_touchpoint
def register_ordered_effect(effect_type: type) -> None:
    """Makes ``effect_type`` ordered (JAX threads a token through its uses) and
    allowed in lowering, control flow, custom derivatives and remat."""
    from jax._src import effects

    effects.ordered_effects.add_type(effect_type)
    effects.lowerable_effects.add_type(effect_type)
    effects.control_flow_allowed_effects.add_type(effect_type)
    effects.custom_derivatives_allowed_effects.add_type(effect_type)
    effects.remat_allowed_effects.add_type(effect_type)


# --- eager evaluation of a primitive ----------------------------------------


def apply_primitive(prim: Any, *args: Any, **params: Any) -> Any:
    """Runs ``prim`` eagerly by compiling it alone (what JAX does for lax ops)."""
    from jax._src import dispatch

    try:
        return dispatch.apply_primitive(prim, *args, **params)
    except BaseException as error:  # an op's wait ended by Ctrl-C: KeyboardInterrupt
        _interrupt.raise_if_interrupted(error)
        raise


# --- trace context ---------------------------------------------------------

_TOP_LEVEL = jex_core.get_opaque_trace_state()
_trace_state = jex_core.get_opaque_trace_state


def at_top_level() -> bool:
    """True when no JAX transformation or trace is active (eager Python).

    Public API only: the trace in effect at import (JAX's eval trace) compared
    with the one in effect now.
    """
    return _trace_state() == _TOP_LEVEL


# --- a value in JAX's trace context (part of every jit cache key) ----------


@functools.cache
@_touchpoint
def trace_context_int(name: str, help_text: str) -> Any:
    """An integer JAX config state that is part of the jit cache key and the
    trace context: changing it makes every jitted function trace again."""
    from jax._src import config

    return config.int_state(name, 0, help_text, include_in_jit_key=True,
                            include_in_trace_context=True)


def set_trace_context_int(state: Any, name: str, value: int) -> None:
    if state is not None and state.value != value:
        jax.config.update(name, value)


# --- the persistent compilation cache -----------------------------------------


@_touchpoint
def use_compilation_cache(folder: str) -> None:
    """Keeps every program this process compiles from now on in JAX's
    persistent compilation cache in ``folder``, and looks there before
    compiling, whatever its compile time.

    JAX decides whether it uses the cache once, at its first compile: the
    private ``reset_cache`` makes it decide again, so that this works after
    programs were compiled.
    """
    from jax._src import compilation_cache

    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    compilation_cache.reset_cache()


# --- plain jax.jit, AOT, ordered effects ------------------------------------


@_touchpoint
def keep_aot_calls_on_token_path(is_ours: Callable[[Any], bool]) -> bool:
    """Refuses the C++ fast path to AOT-compiled executables with an ordered
    effect that ``is_ours`` claims, so every call threads the runtime token.

    ``jit(f).lower(...).compile()`` of a function with an ordered effect
    installs JAX's C++ fast path after its first call, which then calls the
    executable without the token (seen with jax 0.12.0; not with 0.10.2 or
    0.11.2). The guard costs only the fast path of such AOT calls, so it is
    installed on every version. Only plain ``jax.jit`` needs it: ``jaxfog.jit``
    computations have no effect at the top. Returns whether it is installed.
    """
    from jax._src.interpreters import pxla

    original = getattr(pxla.MeshExecutable, "create_cpp_call", None)
    if original is None:
        return False
    if getattr(original, "_jaxfog", False):
        return True

    def create_cpp_call(self, params):
        ordered = getattr(self.unsafe_call, "ordered_effects", ()) or ()
        if any(is_ours(e) for e in ordered):
            return None
        return original(self, params)

    # Marks on the function, and a patch of JAX's private class: untyped.
    create_cpp_call._jaxfog = True  # type: ignore[attr-defined]
    create_cpp_call._jaxfog_original = original  # type: ignore[attr-defined]
    pxla.MeshExecutable.create_cpp_call = create_cpp_call  # type: ignore[method-assign]
    return True


def remove_aot_guard() -> None:
    """Undoes :func:`keep_aot_calls_on_token_path` (tests only)."""
    from jax._src.interpreters import pxla

    current = getattr(pxla.MeshExecutable, "create_cpp_call", None)
    original = getattr(current, "_jaxfog_original", None)
    if original is not None:  # the patch undone on JAX's private class: untyped
        pxla.MeshExecutable.create_cpp_call = original  # type: ignore[method-assign]


# --- dead-code elimination --------------------------------------------------


@_touchpoint
def keep_when_unused(prim: Any) -> None:
    """Tells JAX's dead-code elimination to keep every use of ``prim`` even
    when no result is used and it reports no effect."""
    from jax._src.interpreters import partial_eval as pe

    def keep(*args):
        # jax <= 0.11 calls rule(used_outs, eqn); 0.12 rule(used_outs, live_ins,
        # eqn). The equation is last in both.
        eqn = args[-1]
        return [True] * len(eqn.invars), eqn

    pe.dce_rules[prim] = keep
