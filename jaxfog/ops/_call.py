"""An MPI op's call (:class:`Call`), run at once or started and waited for.

Every op of the MPI backend is built as a :class:`Call` (one FFI primitive's
call and the local step after it): the blocking op runs it
(:meth:`Call.run`), the nonblocking op starts it (:func:`start_call`) and
finishes it at the wait (:func:`wait_call`), through two primitives:

``start_p`` runs one of the ops' FFI primitives (``neighbor_allreduce_p``...) as
its C++ start form, ``jaxfog_<op>_start`` (``jaxfog/ffi/nonblocking.h``): the
inputs are copied before the call returns, the messages move on the
communication thread in program order, and the call returns a *handle id*.
``wait_p`` takes the handle id and returns the op's results. Both carry the
ordered communication effect, so a start, a wait and every other op keep the
program's order on every rank; a wait itself does not communicate.

The handle id is a float32 scalar holding a small integer, so that it can carry
a cotangent. Both primitives are linear in their data, and the adjoint of
start/wait is start/wait of the adjoint op (``ADJOINTS``):

* jvp: the tangents are started (a second handle id, the tangent of the first)
  and waited for where the primal is;
* transpose: the wait's transpose *starts* the adjoint op on the cotangents
  of the results, and its handle id travels back as the cotangent of the
  handle id; the start's transpose waits for it. The adjoint's messages move
  while the backward pass computes what lay between start and wait.

Handle id 0 is the zero cotangent (scan and cond may instantiate one): waiting
for it gives zeros, with no communication.
"""

from __future__ import annotations

import ctypes
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import core
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from jaxfog import ffi, runtime
from jaxfog.errors import HandleError
from jaxfog.ops._primitive_machinery import (ATTRIBUTES, comm_effect, differentiable,
                                             lower_comm_call, not_differentiable)
from jaxfog.ops._primitive_machinery import ADJOINTS
from jaxfog.ops import _jax_compat

#: The custom-call target of every wait (``jaxfog/ffi/nonblocking.cc``).
WAIT_TARGET = "jaxfog_wait"

_HANDLE_ID = core.ShapedArray((), np.float32)


def start_target(prim: jex_core.Primitive) -> str:
    """The start form of ``prim``'s custom call."""
    return prim.name + "_start"


def _results(prim, static_avals, avals, params: tuple) -> list:
    outs, _ = prim.abstract_eval(*static_avals, *avals, **dict(params))
    return list(outs)


# --- start ---------------------------------------------------------------------

start_p = jex_core.Primitive("jaxfog_start")
start_p.def_effectful_abstract_eval(
    lambda *avals, op, params, n_static: (_HANDLE_ID, {comm_effect}))
start_p.def_impl(lambda *args, **params: _jax_compat.apply_primitive(start_p, *args, **params))


def _start_lowering(ctx, *operands, op, params, n_static):
    kw = dict(params)
    results = _results(op, ctx.avals_in[:n_static], ctx.avals_in[n_static:], params)
    # The op's own results are placeholders the start never writes (the C++
    # start stages them to host scratch); its handle id comes last.
    outs = lower_comm_call(ctx, start_target(op), operands,
                           ATTRIBUTES[op](ctx.avals_in, **kw),
                           avals_out=(*results, _HANDLE_ID))
    return [outs[-1]]


def start(prim: jex_core.Primitive, operands: list, params: dict, n_static: int) -> jax.Array:
    """Starts ``prim.bind(*operands, **params)``; returns its handle id."""
    return start_p.bind(*operands, op=prim, params=tuple(sorted(params.items())),
                        n_static=n_static)


def _tangent_operands(xs, tangents) -> list:
    """The tangents as the op's operands: symbolic zeros (and the float0
    tangents of integer leaves) made zeros of the operand's dtype, so that the
    tangent message has the primal's layout and the same wait takes it."""
    return [jnp.zeros(x.shape, x.dtype) if type(t) is ad.Zero or not differentiable(
        jax.typeof(x)) else t for x, t in zip(xs, tangents)]


def _start_jvp(primals, tangents, *, op, params, n_static):
    handle_id = start_p.bind(*primals, op=op, params=params, n_static=n_static)
    static, xs = primals[:n_static], primals[n_static:]
    live = [type(t) is not ad.Zero and differentiable(jax.typeof(x))
            for x, t in zip(xs, tangents[n_static:])]
    if not any(live):
        return handle_id, ad.Zero(_HANDLE_ID)
    if op not in ADJOINTS:
        raise not_differentiable(op)
    tangent = start_p.bind(*static, *_tangent_operands(xs, tangents[n_static:]), op=op,
                           params=params, n_static=n_static)
    return handle_id, tangent


def _start_transpose(ct, *operands, op, params, n_static):
    static, xs = operands[:n_static], operands[n_static:]
    avals = [x.aval for x in xs]
    if type(ct) is ad.Zero:
        return [None] * n_static + [ad.Zero(a) for a in avals]
    adjoint = ADJOINTS[op](static, dict(params), avals)
    results = _results(op, [jax.typeof(s) for s in static], avals, params)
    outs = adjoint.post(wait(ct, adjoint.static, adjoint.prim, adjoint.params, results))
    return [None] * n_static + [o if differentiable(a) else ad.Zero(a)
                                for o, a in zip(outs, avals)]


# --- wait ----------------------------------------------------------------------

# Operands: the handle id, then the op's static operands (the wait does not read
# them; its transpose starts the adjoint with them).
wait_p = jex_core.Primitive("jaxfog_wait")
wait_p.multiple_results = True
wait_p.def_effectful_abstract_eval(
    lambda handle_id, *static, op, params, avals: (
        _results(op, static, avals, params), {comm_effect}))
wait_p.def_impl(lambda *args, **params: _jax_compat.apply_primitive(wait_p, *args, **params))


def _wait_lowering(ctx, handle_id, *static, op, params, avals):
    return lower_comm_call(ctx, WAIT_TARGET, [handle_id, *static], {})


def wait(handle_id, static: list, prim: jex_core.Primitive, params: dict, avals: list) -> list:
    """The results of the op ``prim`` with ``params`` on data of ``avals``
    (and ``static`` operands) started as ``handle_id``."""
    return wait_p.bind(handle_id, *static, op=prim, params=tuple(sorted(params.items())),
                       avals=tuple(core.ShapedArray(a.shape, a.dtype) for a in avals))


def _wait_jvp(primals, tangents, *, op, params, avals):
    outs = wait_p.bind(*primals, op=op, params=params, avals=avals)
    zeros = [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in outs]
    if type(tangents[0]) is ad.Zero:
        return outs, zeros
    moved = wait_p.bind(tangents[0], *primals[1:], op=op, params=params, avals=avals)
    return outs, [m if differentiable(jax.typeof(o)) else z
                  for m, o, z in zip(moved, outs, zeros)]


def _wait_transpose(cts, handle_id, *static, op, params, avals):
    if all(type(ct) is ad.Zero for ct in cts):
        return [ad.Zero(_HANDLE_ID)] + [None] * len(static)
    results = _results(op, [jax.typeof(s) for s in static], avals, params)
    cts = [jnp.zeros(r.shape, r.dtype) if type(ct) is ad.Zero or not differentiable(r)
           else ct for ct, r in zip(cts, results)]
    adjoint = ADJOINTS[op](static, dict(params), list(avals))
    return [start(adjoint.prim, [*adjoint.static, *cts], adjoint.params,
                  len(adjoint.static))] + [None] * len(static)


def _not_batchable(name):
    def rule(args, dims, **params):
        raise NotImplementedError(
            f"jaxfog: the nonblocking ops cannot be vmapped on MPI processes ({name}): "
            "start and wait them outside vmap, or use the blocking op inside")

    return rule


ad.primitive_jvps[start_p] = _start_jvp
ad.primitive_transposes[start_p] = _start_transpose
ad.primitive_jvps[wait_p] = _wait_jvp
ad.primitive_transposes[wait_p] = _wait_transpose
batching.primitive_batchers[start_p] = _not_batchable("start")
batching.primitive_batchers[wait_p] = _not_batchable("wait")
for _platform in ("cpu", "cuda"):
    mlir.register_lowering(start_p, _start_lowering, platform=_platform)
    mlir.register_lowering(wait_p, _wait_lowering, platform=_platform)

# --- the MPI backend's ops as calls, started and waited for -------------------------


class Call(NamedTuple):
    """One FFI primitive's call, and the local step after it: ``post(outs,
    kept)`` (hashable; None: the results as they come), ``kept`` the arrays
    it needs besides the results. A nonblocking op starts the call and runs
    ``post`` at the wait."""

    prim: Any
    operands: list
    params: dict
    n_static: int = 0  # operands before the data (a schedule's step)
    post: Any = None
    kept: list = []

    def run(self) -> list:
        outs = self.prim.bind(*self.operands, **self.params)
        return outs if self.post is None else self.post(outs, self.kept)


class CallHandle(NamedTuple):
    """What waiting for a started :class:`Call` needs besides its arrays
    (``[handle_id, *static operands, *kept]``); hashable."""

    prim: Any
    params: tuple
    avals: tuple  # the data operands'
    n_static: int
    post: Any
    n_kept: int


def start_call(call: Call) -> tuple[list, CallHandle]:
    """Starts ``call``: the arrays its handle holds and how to finish it."""
    handle_id = start(call.prim, call.operands, call.params, call.n_static)
    static, data = call.operands[:call.n_static], call.operands[call.n_static:]
    avals = tuple(core.ShapedArray(jnp.shape(x), jnp.result_type(x)) for x in data)
    return ([handle_id, *static, *call.kept],
            CallHandle(call.prim, tuple(sorted(call.params.items())), avals, call.n_static,
                    call.post, len(call.kept)))


def wait_call(arrays: list, handle: CallHandle) -> list:
    """The results of the call started as ``arrays`` (from :func:`start_call`)."""
    handle_id, rest = arrays[0], list(arrays[1:])
    if not isinstance(handle_id, jax.core.Tracer):
        # Eagerly, a spent handle id is refused here: the handler's own error would
        # reach the caller only at a later block on CUDA (asynchronous dispatch).
        _check_pending("jaxfog.wait", handle_id)
    static, kept = rest[:handle.n_static], rest[handle.n_static:]
    outs = wait(handle_id, static, handle.prim, dict(handle.params), list(handle.avals))
    return outs if handle.post is None else handle.post(outs, kept)



def poll_call(arrays: list, handle: CallHandle) -> bool:
    """Whether the call started as ``arrays`` has finished (its handle id concrete)."""
    if isinstance(arrays[0], jax.core.Tracer):
        raise TypeError("jaxfog.poll reads a handle's id: call it outside jit")
    return _check_pending("jaxfog.poll", arrays[0]) != 0  # handle id 0 (idle): nothing in flight


def _check_pending(what: str, handle_id: Any) -> int:
    """The C++ library's state of a concrete handle id (1 finished, 0 in flight or
    idle); raises :class:`HandleError` for one that is not pending."""
    number = float(np.asarray(handle_id))
    state = ffi.library().jaxfog_handle_done(number)
    if state < 0 and number != 0:
        raise HandleError(f"{what}: handle {number:g} is not pending on this process: "
                          "it was already waited for")
    return max(state, 0)


def _discard_pending() -> None:
    """At shutdown (after the fence: every started op has finished): forgets
    the ops never waited for, and warns of them."""
    text = ctypes.create_string_buffer(1024)
    count = ffi.library().jaxfog_handles_discard(text, len(text))
    if count:
        warnings.warn(f"jaxfog.shutdown: {count} nonblocking op(s) never waited for "
                      f"({text.value.decode()}); their results are discarded. Call "
                      "jaxfog.wait on every handle", RuntimeWarning)


runtime.on_shutdown("discard", _discard_pending)
