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
from jax._src import config, core, dispatch, effects
from jax._src.interpreters import ad, mlir, pxla

from jaxfog import ffi, runtime

#: dtypes every op accepts (integers are averaged in float64 and rounded to
#: nearest, ties to even).
SUPPORTED_DTYPES = tuple(np.dtype(t) for t in (
    jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64, jnp.complex64, jnp.complex128,
    jnp.int32, jnp.int64))


class CommEffect(effects.Effect):
    """Communication through one of jaxfog's communicators (ordered)."""

    __str__ = lambda self: "jaxfog.Comm"  # noqa: E731


comm_effect = CommEffect()
effects.ordered_effects.add_type(CommEffect)
effects.lowerable_effects.add_type(CommEffect)
effects.control_flow_allowed_effects.add_type(CommEffect)
effects.custom_derivatives_allowed_effects.add_type(CommEffect)
effects.remat_allowed_effects.add_type(CommEffect)


def _reuse_comm_tokens() -> None:
    """Skips a no-op re-sharding of jaxfog's runtime token at every dispatch.

    For an ordered effect JAX passes the previous computation's token into the
    next one, and re-shards it first with ``device_put`` through a freshly made
    ``Mesh``/``NamedSharding`` -- about 120 us per jitted call on CPU, even
    when the token already lives on the one device the computation runs on.
    For jaxfog's effect, in that single-device case, the token is passed as is.
    """
    original = dispatch.RuntimeTokenSet.get_token_input
    if getattr(original, "_jaxfog", False):
        return

    def get_token_input(self, eff, devices):
        token = self.current_tokens.get(eff)
        if isinstance(eff, CommEffect) and isinstance(token, core.Token) and len(devices) == 1:
            sharding = getattr(token._buf, "sharding", None)
            if sharding is not None and sharding.device_set == {devices[0]}:
                return token
        return original(self, eff, devices)

    get_token_input._jaxfog = True
    dispatch.RuntimeTokenSet.get_token_input = get_token_input


_reuse_comm_tokens()


def _no_aot_fast_path_for_comm() -> None:
    """Keeps ahead-of-time compiled functions with jaxfog ops on the token path.

    ``jit(f).lower(...).compile()`` installs JAX's C++ fast path after the
    first call unless the computation has host callbacks or unordered effects;
    it forgets ordered effects (JAX 0.10), so the second call would be made
    without the runtime token ("supplied 3 arguments but compiled program
    expected 4"). For computations with jaxfog's effect the fast path is
    refused and every call goes through JAX's token-threading Python path,
    as ``jax.jit`` does.
    """
    original = getattr(pxla.MeshExecutable, "create_cpp_call", None)
    if original is None or getattr(original, "_jaxfog", False):
        return

    def create_cpp_call(self, params):
        ordered = getattr(self.unsafe_call, "ordered_effects", ()) or ()
        if any(isinstance(e, CommEffect) for e in ordered):
            return None
        return original(self, params)

    create_cpp_call._jaxfog = True
    pxla.MeshExecutable.create_cpp_call = create_cpp_call


_no_aot_fast_path_for_comm()

# Ops read the current topology when they are traced. This counter, bumped by
# set_topology/set_machine_topology, is part of JAX's trace context, so a
# function jitted before the topology changed is traced again afterwards.
topology_generation = config.int_state(
    "jaxfog_topology_generation", 0, "jaxfog: how many times the topology was set",
    include_in_jit_key=True, include_in_trace_context=True)


def sync_topology_generation() -> None:
    """Makes JAX's trace context follow the runtime's topology generation."""
    generation = runtime.topology_generation()
    if topology_generation.value != generation:
        jax.config.update("jaxfog_topology_generation", generation)


sync_topology_generation()


def _attribute(value: Any):
    if isinstance(value, (bool, np.bool_)):
        return mlir.ir_attribute(np.bool_(value))
    if isinstance(value, int):
        return mlir.ir_attribute(np.int64(value))
    if isinstance(value, float):
        return mlir.ir_attribute(np.float64(value))
    return mlir.ir_attribute(value)


def _ir_type(ctx: mlir.LoweringRuleContext, aval):
    try:  # newer JAX passes the module context
        return mlir.aval_to_ir_type(ctx.module_context, aval)
    except TypeError:
        return mlir.aval_to_ir_type(aval)


def _row_major(aval) -> tuple[int, ...]:
    return tuple(range(len(aval.shape) - 1, -1, -1))


def lower_comm_call(ctx: mlir.LoweringRuleContext, target: str, operands: Sequence[Any],
                    attributes: Mapping[str, Any]) -> list:
    """Emits a typed-FFI custom call that consumes and produces the comm token.

    The handler's first operand and first result are the token; ``operands``
    and ``ctx.avals_out`` follow. Python ints/floats/bools become i64/f64/i1
    attributes, numpy arrays become array attributes.
    """
    token = ctx.tokens_in.get(comm_effect)
    result_types = [mlir.token_type()] + [_ir_type(ctx, a) for a in ctx.avals_out]
    call = mlir.custom_call(
        target, result_types=result_types, operands=[token, *operands],
        backend_config={k: _attribute(v) for k, v in attributes.items()},
        api_version=4, has_side_effect=True,
        operand_layouts=[()] + [_row_major(a) for a in ctx.avals_in],
        result_layouts=[()] + [_row_major(a) for a in ctx.avals_out])
    token_out, *results = call.results
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({comm_effect: token_out})))
    return results


def define(name: str, target: str, out_avals: Callable[..., list],
           attributes: Callable[..., dict]) -> core.Primitive:
    """A multiple-result communicating primitive lowered to custom call ``target``.

    ``out_avals(*avals, **params)`` gives the result avals;
    ``attributes(avals_in, **params)`` the custom call's attributes.
    """
    prim = core.Primitive(name)
    prim.multiple_results = True
    prim.def_effectful_abstract_eval(
        lambda *avals, **params: (out_avals(*avals, **params), {comm_effect}))
    prim.def_impl(functools.partial(dispatch.apply_primitive, prim))

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
