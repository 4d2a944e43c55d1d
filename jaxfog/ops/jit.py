"""``jaxfog.jit``: ``jax.jit`` that dispatches in C++ when the function communicates.

Every communicating primitive carries jaxfog's ordered effect, so that JAX
threads one token through all of them and every rank runs the same exchanges
in the same order. JAX's C++ dispatch path is refused to any computation with
an effect, so a plain ``jax.jit`` step with one jaxfog op pays the Python path
(tens of microseconds, plus about 9 us per argument leaf).

``jaxfog.jit`` wraps the traced function in one higher-order primitive,
``comm_scope``. Its lowering starts a fresh token, lowers the body with it
(through ``scan``/``cond``/``while`` bodies as before), and drops the token at
the end; its abstract evaluation reports the body's effects less jaxfog's. The
top-level computation then has no effect and JAX dispatches it in C++, while
inside it every jaxfog op is still chained by the token.

Across calls no runtime token is needed: PjRt:CPU runs the executions that
one thread dispatches in the order they were dispatched. Dispatch functions
that communicate from one thread.

Under a JAX transformation or another trace (arguments are tracers: ``grad``,
``vmap``, an enclosing ``jax.jit``), ``jaxfog.jit`` is exactly ``jax.jit``, so
the ops take part in the enclosing computation's token chain.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import jax
from jax.extend import core as jex_core
from jax.extend.mlir.dialects import stablehlo
from jax.interpreters import mlir

from jaxfog import _validate as V
from jaxfog.ops import _jax_compat
from jaxfog.ops._primitive_machinery import CommEffect, comm_effect


def _is_comm(effect: Any) -> bool:
    return isinstance(effect, CommEffect)


# --- the scope primitive ---------------------------------------------------

comm_scope_p = jex_core.Primitive("jaxfog_comm_scope")
comm_scope_p.multiple_results = True


@comm_scope_p.def_effectful_abstract_eval
def _scope_abstract_eval(*avals, jaxpr: jex_core.ClosedJaxpr):
    del avals
    return jaxpr.out_avals, {e for e in jaxpr.effects if not _is_comm(e)}


@comm_scope_p.def_impl
def _scope_impl(*args, jaxpr: jex_core.ClosedJaxpr):
    return jex_core.jaxpr_as_fun(jaxpr)(*args)


def _scope_lowering(ctx: mlir.LoweringRuleContext, *args, jaxpr: jex_core.ClosedJaxpr):
    _jax_compat.require("keep_when_unused")
    tokens = dict(ctx.tokens_in.items())
    tokens[comm_effect] = stablehlo.create_token()
    inner = ctx.replace(tokens_in=mlir.TokenSet(tokens), tokens_out=None)
    outs = mlir.lower_fun(jex_core.jaxpr_as_fun(jaxpr), multiple_results=True)(inner, *args)
    if len(ctx.tokens_in):  # the body's other ordered effects (e.g. io_callback)
        others = {e: t for e, t in inner.tokens_out.items() if not _is_comm(e)}
        ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet(others)))
    return outs


mlir.register_lowering(comm_scope_p, _scope_lowering)
# The scope shows no effect, so without this JAX would drop a scope whose
# results are unused (a step that only communicates, e.g. a barrier).
_jax_compat.keep_when_unused(comm_scope_p)


def comm_scope(fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, traced into one ``comm_scope`` when it communicates.

    To be called while tracing: the tracers among the pytree leaves of
    ``args``/``kwargs`` become the scope's operands, every other leaf stays a
    constant of the body.
    """
    leaves, tree = jax.tree.flatten((args, kwargs))
    where = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.core.Tracer)]
    out_tree = []

    def flat_fn(*operands):
        filled = list(leaves)
        for i, x in zip(where, operands):
            filled[i] = x
        call_args, call_kwargs = jax.tree.unflatten(tree, filled)
        out_leaves, treedef = jax.tree.flatten(fn(*call_args, **call_kwargs))
        out_tree.append(treedef)
        return out_leaves

    operands = [leaves[i] for i in where]
    closed = jax.make_jaxpr(flat_fn)(*operands)
    if any(_is_comm(e) for e in closed.effects):
        outs = comm_scope_p.bind(*operands, jaxpr=closed)
    else:
        outs = jex_core.jaxpr_as_fun(closed)(*operands)
    return jax.tree.unflatten(out_tree[0], outs)


# --- jaxfog.jit ------------------------------------------------------------


def _arguments_kept(fn: Callable) -> Callable:
    """``fn``, checked at trace time for Flax NNX objects it updates in place
    without returning them.

    A compiled function gets copies of its arguments' leaves: an
    ``nnx.Module`` or ``nnx.Optimizer`` passed in and updated in place (the
    usual NNX train step) changes a copy, never the caller's object, and the
    step would silently train nothing. The check runs when ``fn`` is traced,
    so it costs nothing per call, and only when Flax NNX is imported.
    """

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        nnx = sys.modules.get("flax.nnx")
        if nnx is None:
            return fn(*args, **kwargs)
        stateful = lambda x: isinstance(x, nnx.Pytree)  # noqa: E731  (Module, Optimizer, Rngs)
        named = [*(f"argument {i}" for i in range(len(args))), *(f"{k}=" for k in kwargs)]
        objects = [(name, x) for name, value in zip(named, (*args, *kwargs.values()))
                   for x in jax.tree.leaves(value, is_leaf=stateful) if stateful(x)]
        before = [{id(leaf) for leaf in jax.tree.leaves(x)} for _, x in objects]
        out = fn(*args, **kwargs)
        returned = {id(leaf) for leaf in jax.tree.leaves(out)}
        lost = [(name, x) for (name, x), old in zip(objects, before)
                if any(id(leaf) not in old and id(leaf) not in returned
                       for leaf in jax.tree.leaves(x))]
        if lost:
            what = ", ".join(f"{name} ({type(x).__name__})" for name, x in lost)
            raise TypeError(
                f"jaxfog.jit({getattr(fn, '__qualname__', fn)!r}) updated {what} in place "
                "without returning it: compiled code works on copies of its arguments, so "
                "the caller's Flax NNX objects would silently stay as they were. Split once "
                "and pass the state: `graphdef, state = nnx.split((model, optimizer))`; in "
                "the step, `model, optimizer = nnx.merge(graphdef, state)`, update them and "
                "return `nnx.state((model, optimizer))` (the fast pattern: see docs/guide/flax.rst "
                "and examples/train_digits_nnx.py). Or use `nnx.jit`, which "
                "carries the updates back but dispatches more slowly.")
        return out

    return checked


class Jitted:
    """The result of :func:`jit`: callable, with ``lower``/``trace``/``eval_shape``."""

    def __init__(self, fn: Callable, jit_kwargs: dict):
        functools.update_wrapper(self, fn)
        self._fn = fn
        fn = _arguments_kept(fn)

        @functools.wraps(fn)  # keeps the signature for static/donate argnames
        def scoped(*args, **kwargs):
            return comm_scope(fn, *args, **kwargs)

        self._fast = jax.jit(scoped, **jit_kwargs)
        self._plain = jax.jit(fn, **jit_kwargs)

    def _pick(self):
        return self._fast if _jax_compat.at_top_level() else self._plain

    def __call__(self, *args, **kwargs):
        if _jax_compat.at_top_level():  # the hot path: one check, one C++ call
            return self._fast(*args, **kwargs)
        return self._plain(*args, **kwargs)

    def lower(self, *args, **kwargs):
        """``jax.jit(...).lower``; the compiled result dispatches in C++ too."""
        return self._pick().lower(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self._pick().trace(*args, **kwargs)

    def eval_shape(self, *args, **kwargs):
        return self._plain.eval_shape(*args, **kwargs)

    def clear_cache(self) -> None:
        # JAX adds clear_cache to its jitted functions' C++ class at run time.
        self._fast.clear_cache()  # type: ignore[attr-defined]
        self._plain.clear_cache()  # type: ignore[attr-defined]

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        return functools.partial(self, obj)

    def __repr__(self) -> str:
        return f"jaxfog.jit({getattr(self._fn, '__qualname__', self._fn)!r})"


def jit(fn: Callable | None = None, /, **jit_kwargs: Any) -> Any:
    """``jax.jit`` for functions with jaxfog ops, dispatched on JAX's C++ path.

    Takes every keyword ``jax.jit`` takes (``static_argnums``,
    ``static_argnames``, ``donate_argnums``, ``donate_argnames``, ...) and
    returns an object used like the result of ``jax.jit``, ``.lower(...)``
    and ``.lower(...).compile()`` included. Usable as ``@jaxfog.jit`` or
    ``@jaxfog.jit(static_argnums=1)``.

    Inside, every jaxfog op is ordered exactly as under ``jax.jit`` (one token
    through the function, its loops and branches), but the computation shows
    no effect at the top, so each call costs what a call of a jitted function
    without communication costs. Plain ``jax.jit`` stays correct, only slower
    to dispatch.

    Dispatch the compiled function from one thread: the order of calls is the
    order of communication on every rank. Under ``grad``, ``vmap`` or an
    enclosing ``jit`` it behaves exactly like ``jax.jit``.

    Args:
      fn: the function to compile; omitted when used as
        ``@jaxfog.jit(**jit_kwargs)``.
      **jit_kwargs: any keyword argument of ``jax.jit``.

    Returns:
      The compiled function (or, without ``fn``, a decorator).

    Example::

        @jaxfog.jit
        def step(params, opt_state, batch):
            grads = jax.grad(loss)(params, batch)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state
    """
    if fn is None:
        return functools.partial(jit, **jit_kwargs)
    return Jitted(V.function("jaxfog.jit", "fn", fn), jit_kwargs)


__all__ = ["jit"]
