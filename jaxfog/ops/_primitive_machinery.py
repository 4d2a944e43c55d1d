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
from typing import Any, Callable, Mapping, NamedTuple, Sequence, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import core
from jax.extend import core as jex_core
from jax.interpreters import ad, mlir

from jaxfog import runtime
from jaxfog.ops import _jax_compat

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


def _sync_topology_generation(generation: int) -> None:
    """Makes JAX's trace context follow the runtime's topology generation."""
    _jax_compat.set_trace_context_int(topology_generation, _GENERATION, generation)


_sync_topology_generation(runtime.topology_generation())
runtime._topology_listeners.append(_sync_topology_generation)

# Likewise for windows: ops bake in the window they name (its id, or in the
# simulation its references), so creating or freeing one retraces.
_WINDOWS = "jaxfog_window_generation"
window_generation = _jax_compat.trace_context_int(
    _WINDOWS, "jaxfog: how many times windows were created or freed")


def windows_changed() -> None:
    """Makes functions jitted before a window was created or freed trace again."""
    _jax_compat.set_trace_context_int(window_generation, _WINDOWS,
                                      window_generation.value + 1)


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
                    attributes: Mapping[str, Any], avals_out: Sequence[Any] | None = None
                    ) -> list:
    """Emits a typed-FFI custom call that consumes and produces the comm token.

    The handler's first operand and first result are the token; ``operands``
    and ``avals_out`` (default ``ctx.avals_out``) follow (row-major). Python
    ints/floats/bools become i64/f64/i1 attributes, numpy arrays become array
    attributes.
    """
    _jax_compat.require("register_ordered_effect")
    token = ctx.tokens_in.get(comm_effect)
    avals_out = ctx.avals_out if avals_out is None else avals_out
    with_token = ctx.replace(avals_in=(_token_aval(), *ctx.avals_in),
                             avals_out=(_token_aval(), *avals_out))
    rule = jax.ffi.ffi_lowering(
        target, has_side_effect=True,
        backend_config={k: _attribute(v) for k, v in attributes.items()})
    token_out, *results = rule(with_token, token, *operands)
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({comm_effect: token_out})))
    return results


#: The custom call's attributes of each primitive made by :func:`define`:
#: ``attributes(avals_in, **params)`` (the nonblocking start lowers with them).
ATTRIBUTES: dict[jex_core.Primitive, Callable[..., dict]] = {}

#: Every FFI target a primitive lowers to, by op name (``tests/ops/test_op_table.py``
#: checks them against the op table the C++ library exports).
TARGETS: dict[str, str] = {}


def target(op: str) -> str:
    """The custom-call target of ``op``: the handler symbol ``jaxfog_<op>`` that
    the C++ op table (``jaxfog/ffi/ops.h``) defines."""
    TARGETS[op] = f"jaxfog_{op}"
    return TARGETS[op]


def define(op: str, out_avals: Callable[..., list],
           attributes: Callable[..., dict]) -> jex_core.Primitive:
    """A multiple-result communicating primitive lowered to ``op``'s custom call.

    ``out_avals(*avals, **params)`` gives the result avals;
    ``attributes(avals_in, **params)`` the custom call's attributes.
    """
    name = target(op)
    prim = jex_core.Primitive(name)
    prim.multiple_results = True
    prim.def_effectful_abstract_eval(
        lambda *avals, **params: (out_avals(*avals, **params), {comm_effect}))
    prim.def_impl(lambda *args, **params: _jax_compat.apply_primitive(prim, *args, **params))

    def lowering(ctx, *operands, **params):
        return lower_comm_call(ctx, name, operands, attributes(ctx.avals_in, **params))

    ATTRIBUTES[prim] = attributes

    register_lowering(prim, lowering)
    return prim


#: The lowering of each communicating primitive shared by CPU and CUDA (where
#: it runs the op with host staging), by primitive; the NCCL rules
#: (``jaxfog.ops._nccl``) fall back to it.
GENERIC_LOWERINGS: dict[jex_core.Primitive, Callable] = {}


def register_lowering(prim: jex_core.Primitive, lowering: Callable) -> None:
    """Lowers ``prim`` with ``lowering`` on CPU and on CUDA (the same custom
    call: XLA binds it to the CPU handler or to its host-staged CUDA form)."""
    GENERIC_LOWERINGS[prim] = lowering
    for platform in ("cpu", "cuda"):
        mlir.register_lowering(prim, lowering, platform=platform)


def signature(op: str, avals: Sequence[Any]) -> int:
    """A rank-independent hash of one message's layout (op, dtypes, shapes)."""
    text = op + ";" + ";".join(f"{np.dtype(a.dtype).name}{tuple(a.shape)}" for a in avals)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


#: Characters of a layout that travel in every message header (``LayoutText``
#: in ``jaxfog/ffi/transport.h``).
LAYOUT_CHARS = 88


def _short_dtype(dtype) -> str:
    """jnp's short names: f32, bf16, i64, u8, c64, bool."""
    name = np.dtype(dtype).name
    if name == "bfloat16":
        return "bf16"
    for long, short in (("complex", "c"), ("float", "f"), ("uint", "u"), ("int", "i")):
        if name.startswith(long):
            return short + name[len(long):]
    return name


def layout(avals: Sequence[Any]) -> str:
    """One message's layout in words for errors, e.g. ``f32[3,4], i32[]``: the
    first leaves and ``... (N leaves)`` when all would not fit in a header."""
    leaves = [f"{_short_dtype(a.dtype)}[{','.join(map(str, a.shape))}]" for a in avals]
    text = ", ".join(leaves)
    if len(text) <= LAYOUT_CHARS:
        return text
    for shown in range(len(leaves) - 1, 0, -1):
        text = ", ".join(leaves[:shown]) + f", ... ({len(leaves)} leaves)"
        if len(text) <= LAYOUT_CHARS:
            return text
    return text[:LAYOUT_CHARS - 3] + "..."


def message(op: str, avals: Sequence[Any]) -> dict[str, Any]:
    """The attributes that describe one message of ``op``: its ``signature``,
    which ranks compare, and its ``layout``, which a mismatch error shows."""
    return {"signature": signature(op, avals), "layout": layout(avals)}


def differentiable(aval) -> bool:
    """Whether values of ``aval`` carry tangents (floating or complex)."""
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def not_differentiable(prim: Any) -> TypeError:
    """The error of differentiating a window op (``prim``'s name in it)."""
    return TypeError(f"jaxfog.{prim.name.removeprefix('jaxfog_')} is not differentiable: "
                     "it writes into other ranks' windows, a side effect with no "
                     "tangent; differentiate the local computation around it")


def linear_jvp(prim, n_static: int):
    """jvp of a primitive linear in its operands after the first ``n_static``:
    the same op on the (non-zero, differentiable) tangents."""

    def jvp(primals, tangents, **params):
        static, xs = primals[:n_static], primals[n_static:]
        outs = prim.bind(*static, *xs, **params)
        live = [i for i, t in enumerate(tangents[n_static:])
                if type(t) is not ad.Zero and differentiable(jax.typeof(xs[i]))]
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

    def transpose(cts: Any, *args: Any, **params: Any) -> list[Any]:
        static, xs = args[:n_static], args[n_static:]
        live = [i for i, ct in enumerate(cts) if type(ct) is not ad.Zero]
        results: list[Any] = [None] * n_static + [ad.Zero(x.aval) for x in xs]
        if live:
            back = adjoint(static, [cts[i] for i in live], [xs[i] for i in live], **params)
            for i, ct in zip(live, back):
                results[n_static + i] = ct
        return results

    return transpose


# --- what the ops' rules share -------------------------------------------------


class Adjoint(NamedTuple):
    """An op's adjoint as one op and a local step after it (for the
    nonblocking ops, which start the op and finish with ``post`` at the wait):
    ``post(adjoint_prim.bind(*static, *cotangents, **params))``."""

    prim: jex_core.Primitive
    params: dict
    static: list  # operands before the cotangents (the step of a schedule)
    post: Callable[[list], list]


#: Each linear primitive's adjoint as an :class:`Adjoint`, registered beside
#: the primitive: ``ADJOINTS[prim](static, params, avals_in)`` (``avals_in``:
#: its data operands').
ADJOINTS: dict[jex_core.Primitive, Callable[..., Adjoint]] = {}


def unchanged(outs: list) -> list:
    return outs


def same_avals(*avals, **params) -> list:
    return [core.ShapedArray(a.shape, a.dtype) for a in avals]


def elementwise_batch(prim):
    """vmap of an op that treats every element alike: one message for the batch."""
    def rule(args, dims, **params):
        return prim.bind(*args, **params), list(dims)

    return rule


def move_batch_to_axis1(x, dim):
    """Puts the batch axis second, so that blocks along axis 0 stay contiguous."""
    if dim is None:
        return x, False
    x = jnp.moveaxis(x, dim, 0)
    if x.ndim == 1:
        return x[None, :], True
    return jnp.moveaxis(x, 0, 1), True


def blocking_transpose(adjoint_rule):
    """The transpose rule that runs an :class:`Adjoint` at once."""
    def back(static, cts, xs, **params):
        adjoint = adjoint_rule(static, params, [x.aval for x in xs])
        return adjoint.post(adjoint.prim.bind(*adjoint.static, *cts, **adjoint.params))

    return linear_transpose(back)


def rank_in(comm_id: int) -> int:
    """This process's rank in the communicator registered under ``comm_id``."""
    # An MPI process's: an int (only a simulated agent's is traced).
    return cast(int, {runtime.WORLD_COMM_ID: runtime.rank,
                      runtime.LOCAL_COMM_ID: runtime.local_rank,
                      runtime.LEADERS_COMM_ID: runtime.machine_rank}[comm_id]())
