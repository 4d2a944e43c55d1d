"""jaxfog's ordered communication effect and the custom-call lowering that threads it.

XLA:CPU may run independent custom calls concurrently and in different orders
on different ranks; two ranks waiting in different exchanges deadlock. Every
communicating primitive therefore carries one *ordered* effect: JAX threads a
token through all of them (within a jitted function, through ``scan``/``cond``/
``while`` bodies, and across consecutive jitted calls), so every rank runs the
same communication in the same order, by construction.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
from jax._src import effects
from jax._src.interpreters import mlir


class CommEffect(effects.Effect):
    """Communication through jaxfog's world communicator (ordered)."""

    __str__ = lambda self: "jaxfog.Comm"  # noqa: E731


comm_effect = CommEffect()
effects.ordered_effects.add_type(CommEffect)
effects.lowerable_effects.add_type(CommEffect)
effects.control_flow_allowed_effects.add_type(CommEffect)
effects.custom_derivatives_allowed_effects.add_type(CommEffect)
effects.remat_allowed_effects.add_type(CommEffect)


def _attribute(value: Any):
    if isinstance(value, (bool, np.bool_)):
        value = np.int64(value)
    elif isinstance(value, int):
        value = np.int64(value)
    elif isinstance(value, float):
        value = np.float64(value)
    return mlir.ir_attribute(value)


def lower_comm_call(ctx: mlir.LoweringRuleContext, target: str, operands: Sequence[Any],
                    attributes: Mapping[str, Any]) -> list:
    """Emits a typed-FFI custom call that consumes and produces the comm token.

    The handler's first operand and first result are the token; ``operands``
    and ``ctx.avals_out`` follow. Python ints/floats become i64/f64 attributes,
    numpy arrays become array attributes.
    """
    token = ctx.tokens_in.get(comm_effect)
    result_types = [mlir.token_type()] + [mlir.aval_to_ir_type(a) for a in ctx.avals_out]
    call = mlir.custom_call(
        target, result_types=result_types, operands=[token, *operands],
        backend_config={k: _attribute(v) for k, v in attributes.items()},
        api_version=4, has_side_effect=True,
        result_layouts=[()] + [tuple(range(len(a.shape) - 1, -1, -1)) for a in ctx.avals_out],
        operand_layouts=[()] + [tuple(range(len(a.shape) - 1, -1, -1)) for a in ctx.avals_in])
    token_out, *results = call.results
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({comm_effect: token_out})))
    return results
