"""jaxfog.jit in one process: the top level shows no effect, the ops inside are
chained by one token, and under a transformation it is jax.jit."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfog as jf
from jaxfog.ops._primitive_machinery import CommEffect

pytestmark = pytest.mark.jax_internals


@pytest.fixture(autouse=True)
def initialized():
    jf.init()
    yield


def _comm_effects(effects) -> list:
    return [e for e in effects if isinstance(e, CommEffect)]


def step(xs, scale):
    a = jf.neighbor_allreduce(xs["a"])
    b = jf.allreduce(xs["b"], op="sum")
    c = jax.lax.fori_loop(0, 3, lambda i, c: jf.broadcast(c * scale), xs["c"])
    return {"a": a, "b": b, "c": c}


XS = {"a": jnp.arange(300.0), "b": jnp.ones((20, 30)), "c": jnp.full(200, 2.0)}


def test_top_level_has_no_effect_but_the_body_communicates():
    traced = jf.jit(step).trace(XS, 2.0)
    assert not traced.jaxpr.effects  # what lets JAX dispatch it in C++
    (eqn,) = [e for e in traced.jaxpr.jaxpr.eqns if e.primitive.name == "jaxfog_comm_scope"]
    assert _comm_effects(eqn.params["jaxpr"].effects)
    plain = jax.jit(step).trace(XS, 2.0)
    assert _comm_effects(plain.jaxpr.effects)


def test_ops_are_chained_by_one_token_in_program_order():
    text = jf.jit(step).lower(XS, 2.0).as_text()
    calls = re.findall(r"(%[^\s:]+)\S* = stablehlo\.custom_call @(jaxfog_\w+)\((%[^,)]+)", text)
    names = [name for _, name, _ in calls]
    assert names[:2] == ["jaxfog_neighbor_allreduce", "jaxfog_allreduce"]
    assert "jaxfog_broadcast" in names
    # The token each call consumes is the one the previous call produced (the
    # loop's body threads it through its carry).
    first_result, _, first_token = calls[0]
    assert re.search(re.escape(first_token) + r" = stablehlo\.create_token", text)
    second_result, _, second_token = calls[1]
    assert second_token == first_result + "#0"
    assert re.search(r"stablehlo\.while\(.*" + re.escape(second_result) + "#0", text)


def test_values_match_plain_jit_and_repeat():
    fast, plain = jf.jit(step), jax.jit(step)
    want = plain(XS, 2.0)
    for _ in range(3):
        got = fast(XS, 2.0)
        jax.tree.map(np.testing.assert_array_equal, got, want)


def test_functions_without_communication_are_plain_jit():
    traced = jf.jit(lambda x: x * 2).trace(jnp.ones(3))
    assert [e.primitive.name for e in traced.jaxpr.jaxpr.eqns] == ["mul"]


def test_under_transformations_it_is_jax_jit():
    f = jf.jit(lambda x: jnp.sum(jf.allreduce(x) ** 2))
    x = jnp.arange(4.0)
    np.testing.assert_allclose(jax.grad(f)(x), 2 * x)
    np.testing.assert_allclose(jax.vmap(f)(jnp.stack([x, x + 1])),
                               [jnp.sum(x ** 2), jnp.sum((x + 1) ** 2)])
    # Nested in jax.jit, the ops take part in the enclosing token chain.
    outer = jax.jit(lambda x: f(x) + 1).trace(x)
    assert _comm_effects(outer.jaxpr.effects)
    assert float(jax.jit(lambda x: f(x) + 1)(x)) == pytest.approx(15.0)


def test_static_and_donated_arguments_and_aot():
    @jf.jit
    def plain_decorated(x):
        return jf.allreduce(x)

    @jf.jit(static_argnames="power", donate_argnums=0)
    def powered(x, power):
        return jf.allreduce(x) ** power

    assert float(plain_decorated(jnp.float32(3))) == 3.0
    x = jnp.arange(5.0)
    np.testing.assert_allclose(powered(x, power=3), np.arange(5.0) ** 3)
    assert x.is_deleted()  # donated
    compiled = powered.lower(jnp.arange(5.0), power=2).compile()
    for _ in range(3):  # every call, not only the first
        np.testing.assert_allclose(compiled(jnp.arange(5.0)), np.arange(5.0) ** 2)
    assert "jaxfog.jit" in repr(powered) and powered.__name__ == "powered"


def test_a_step_that_only_communicates_is_kept():
    text = jf.jit(lambda: jf.barrier()).lower().as_text()
    assert "@jaxfog_barrier" in text


def test_methods():
    class Model:
        def __init__(self, k):
            self.k = k

        @jf.jit(static_argnums=0)  # as with jax.jit, self is static
        def mixed(self, x):
            return jf.allreduce(x) * 2

    np.testing.assert_allclose(Model(1).mixed(jnp.ones(2)), [2.0, 2.0])
    np.testing.assert_allclose(Model.mixed(Model(1), jnp.ones(2)), [2.0, 2.0])
