"""Shared machinery of jaxfog's communication primitives.

Every communicating primitive carries one *ordered* effect. XLA:CPU may run
independent custom calls concurrently and in different orders on different
ranks, and two ranks waiting in different exchanges deadlock; with the
ordered effect JAX threads a token through all of them (within a jitted
function, through ``scan``/``cond``/``while`` bodies, and across consecutive
jitted calls), so every rank runs the same communication in the same order,
by construction.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core
from jax.interpreters import ad, mlir

from jaxfog import ffi, runtime
from jaxfog.ops import _jax_compat

#: dtypes every op accepts (integers are averaged in float64 and rounded to
#: nearest, ties to even).
SUPPORTED_DTYPES = tuple(np.dtype(t) for t in (
    jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64, jnp.complex64, jnp.complex128,
    jnp.int32, jnp.int64))


class CommEffect(jex_core.Effect):
    """Communication through one of jaxfog's communicators (ordered)."""

    __str__ = lambda self: "jaxfog.Comm"  # noqa: E731


comm_effect = CommEffect()
_jax_compat.register_ordered_effect(CommEffect)
# Plain jax.jit only; jaxfog.jit computations carry no effect at the top.
_jax_compat.keep_aot_calls_on_token_path(lambda effect: isinstance(effect, CommEffect))

# Ops read the current topology when they are traced. This counter, bumped by
# set_topology/set_machine_topology, is part of JAX's trace context, so a
# function jitted before the topology changed is traced again afterwards.
_GENERATION = "jaxfog_topology_generation"
topology_generation = _jax_compat.trace_context_int(
    _GENERATION, "jaxfog: how many times the topology was set")


def sync_topology_generation() -> None:
    """Makes JAX's trace context follow the runtime's topology generation."""
    _jax_compat.set_trace_context_int(topology_generation, _GENERATION,
                                      runtime.topology_generation())


sync_topology_generation()


def _attribute(value: Any):
    if isinstance(value, (bool, np.bool_)):
        return mlir.ir_attribute(np.bool_(value))
    if isinstance(value, int):
        return mlir.ir_attribute(np.int64(value))
    if isinstance(value, float):
        return mlir.ir_attribute(np.float64(value))
    return mlir.ir_attribute(value)


@functools.cache
def _token_aval():
    return jax.typeof(jax.lax.create_token())


def lower_comm_call(ctx: mlir.LoweringRuleContext, target: str, operands: Sequence[Any],
                    attributes: Mapping[str, Any]) -> list:
    """Emits a typed-FFI custom call that consumes and produces the comm token.

    The handler's first operand and first result are the token; ``operands``
    and ``ctx.avals_out`` follow (row-major). Python ints/floats/bools become
    i64/f64/i1 attributes, numpy arrays become array attributes.
    """
    _jax_compat.require("register_ordered_effect")
    token = ctx.tokens_in.get(comm_effect)
    with_token = ctx.replace(avals_in=(_token_aval(), *ctx.avals_in),
                             avals_out=(_token_aval(), *ctx.avals_out))
    rule = jax.ffi.ffi_lowering(
        target, has_side_effect=True,
        backend_config={k: _attribute(v) for k, v in attributes.items()})
    token_out, *results = rule(with_token, token, *operands)
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({comm_effect: token_out})))
    return results


def define(name: str, target: str, out_avals: Callable[..., list],
           attributes: Callable[..., dict]) -> jex_core.Primitive:
    """A multiple-result communicating primitive lowered to custom call ``target``.

    ``out_avals(*avals, **params)`` gives the result avals;
    ``attributes(avals_in, **params)`` the custom call's attributes.
    """
    prim = jex_core.Primitive(name)
    prim.multiple_results = True
    prim.def_effectful_abstract_eval(
        lambda *avals, **params: (out_avals(*avals, **params), {comm_effect}))
    prim.def_impl(lambda *args, **params: _jax_compat.apply_primitive(prim, *args, **params))

    def lowering(ctx, *operands, **params):
        return lower_comm_call(ctx, target, operands, attributes(ctx.avals_in, **params))

    mlir.register_lowering(prim, lowering, platform="cpu")
    return prim


def check_leaves(op: str, leaves: Sequence[Any]) -> None:
    """TypeError at trace time for dtypes no op supports."""
    for leaf in leaves:
        dtype = np.dtype(jnp.result_type(leaf))
        if dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
            raise TypeError(f"jaxfog.{op}: dtype {dtype} is not supported (supported: {names})")


def signature(op: str, avals: Sequence[Any]) -> int:
    """A rank-independent hash of one message's layout (op, dtypes, shapes)."""
    text = op + ";" + ";".join(f"{np.dtype(a.dtype).name}{tuple(a.shape)}" for a in avals)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def ready() -> None:
    """Raises if jaxfog is not initialised; registers the handlers once."""
    runtime._require()
    ffi.register_handlers()


def _differentiable(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def linear_jvp(prim, n_static: int):
    """jvp of a primitive linear in its operands after the first ``n_static``:
    the same op on the (non-zero, differentiable) tangents."""

    def jvp(primals, tangents, **params):
        static, xs = primals[:n_static], primals[n_static:]
        outs = prim.bind(*static, *xs, **params)
        live = [i for i, t in enumerate(tangents[n_static:])
                if type(t) is not ad.Zero and _differentiable(jax.typeof(xs[i]))]
        tangent_outs = [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in outs]
        if live:
            moved = prim.bind(*static, *(tangents[n_static + i] for i in live), **params)
            for i, t in zip(live, moved):
                tangent_outs[i] = t
        return outs, tangent_outs

    return jvp


def linear_transpose(adjoint, n_static: int = 0):
    """Transpose rule calling ``adjoint(static, cotangents, xs, **params)`` on the
    non-zero cotangents only (zero ones stay symbolic: no communication)."""

    def transpose(cts, *args, **params):
        static, xs = args[:n_static], args[n_static:]
        live = [i for i, ct in enumerate(cts) if type(ct) is not ad.Zero]
        results: list[Any] = [None] * n_static + [ad.Zero(x.aval) for x in xs]
        if live:
            back = adjoint(static, [cts[i] for i in live], [xs[i] for i in live], **params)
            for i, ct in zip(live, back):
                results[n_static + i] = ct
        return results

    return transpose
