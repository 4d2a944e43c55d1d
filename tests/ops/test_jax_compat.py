"""One test per private JAX touchpoint in ``jaxfog.ops._jax_compat``.

A JAX upgrade that moves or changes one of them fails here, by name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core
from jax.interpreters import mlir

import jaxfog as jf
from jaxfog.ops import _jax_compat

pytestmark = pytest.mark.jax_internals


def test_no_touchpoint_failed_at_import():
    import jaxfog.ops  # noqa: F401  (registers everything)

    assert _jax_compat.BROKEN == {}
    _jax_compat.require(*_jax_compat.BROKEN)  # nothing to raise


def test_a_broken_touchpoint_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(_jax_compat.BROKEN, "probe", AttributeError("gone"))
    with pytest.raises(_jax_compat.JaxCompatError, match="probe: AttributeError: gone"):
        _jax_compat.require("probe")


def test_jax_version_is_one_we_test():
    assert _jax_compat.jax_version() in _jax_compat.TESTED_JAX, (
        f"jax {jax.__version__} is not in the tested range {_jax_compat.TESTED_JAX}")


def _effectful_primitive(name: str, effect):
    prim = jex_core.Primitive(name)
    prim.def_effectful_abstract_eval(lambda x: (x, {effect}))
    prim.def_impl(lambda x: x)
    seen = []

    def lowering(ctx, x):
        seen.append(ctx.tokens_in.get(effect))  # KeyError if JAX threads no token
        ctx.set_tokens_out(ctx.tokens_in)
        return [x]

    mlir.register_lowering(prim, lowering)
    return prim, seen


def test_register_ordered_effect():
    class Probe(jex_core.Effect):
        pass

    _jax_compat.register_ordered_effect(Probe)
    prim, seen = _effectful_primitive("compat_probe", Probe())

    def body(x):
        x = jax.lax.scan(lambda c, _: (prim.bind(c), None), x, None, length=2)[0]
        x = jax.lax.cond(x[0] > 0, prim.bind, lambda y: y, x)
        return jax.checkpoint(prim.bind)(x)

    # Control flow and remat accept the effect, and the rule gets a token.
    assert "stablehlo.token" in jax.jit(body).lower(jnp.ones(3)).as_text()
    assert seen


def test_apply_primitive():
    prim = jex_core.Primitive("compat_double")
    prim.def_abstract_eval(lambda x: x)
    mlir.register_lowering(prim, mlir.lower_fun(lambda x: [x * 2], multiple_results=True))
    prim.def_impl(lambda x: _jax_compat.apply_primitive(prim, x))
    np.testing.assert_array_equal(prim.bind(jnp.arange(3)), [0, 2, 4])


def test_at_top_level():
    assert _jax_compat.at_top_level()
    seen = []

    def probe(x):
        seen.append(_jax_compat.at_top_level())
        return x

    jax.jit(probe)(1.0)
    jax.grad(probe)(1.0)
    jax.vmap(probe)(jnp.ones(2))
    jax.make_jaxpr(lambda x: probe(x))(1.0)
    assert seen == [False] * 4
    with jax.ensure_compile_time_eval():
        assert _jax_compat.at_top_level()


def test_trace_context_int_retraces():
    state = _jax_compat.trace_context_int("jaxfog_compat_probe", "test only")
    traces = []

    @jax.jit
    def f(x):
        traces.append(1)
        return x + 1

    f(1.0)
    f(1.0)
    _jax_compat.set_trace_context_int(state, "jaxfog_compat_probe", state.value + 1)
    f(1.0)
    assert len(traces) == 2


#: JAX versions where an unguarded AOT call with an ordered effect was seen to
#: lose its token on the second call (jax 0.10.2 and 0.11.2 do not show it).
AOT_TOKEN_BUG = {(0, 12)}


def test_aot_guard_keeps_every_call_on_the_token_path():
    jf.init()
    from jaxfog.ops._primitive_machinery import CommEffect

    def compiled():
        return jax.jit(jf.allreduce).lower(jnp.ones(3)).compile()

    _jax_compat.remove_aot_guard()
    try:
        unguarded = compiled()
        np.testing.assert_array_equal(unguarded(jnp.ones(3)), np.ones(3))
        if _jax_compat.jax_version() in AOT_TOKEN_BUG:  # what the guard is for
            with pytest.raises(Exception, match="arguments but compiled program expected"):
                unguarded(jnp.ones(3))
    finally:
        assert _jax_compat.keep_aot_calls_on_token_path(lambda e: isinstance(e, CommEffect))
    guarded = compiled()
    for _ in range(3):
        np.testing.assert_array_equal(guarded(jnp.ones(3)), np.ones(3))


def test_keep_when_unused():
    prim = jex_core.Primitive("compat_kept")
    prim.multiple_results = True
    prim.def_abstract_eval(lambda: [])
    mlir.register_lowering(prim, lambda ctx: [mlir.ir_constant(np.int32(7))] and [])
    _jax_compat.keep_when_unused(prim)
    lowered = jax.jit(lambda x: (prim.bind(), x)[1]).trace(1.0)
    assert [e.primitive for e in lowered.jaxpr.jaxpr.eqns] == [prim]
    # JAX's own DCE calls the rule (with the arguments of this JAX version).
    from jax._src.interpreters import partial_eval as pe

    jaxpr = lowered.jaxpr.jaxpr
    assert [e.primitive for e in pe.dce_jaxpr(jaxpr, [True])[0].eqns] == [prim]
    assert pe.dce_jaxpr(jaxpr, [False])[0].eqns


_USES_THE_CACHE = """
import sys
import jax, jax.numpy as jnp
from jaxfog.ops import _jax_compat

events = []
jax.monitoring.register_event_listener(lambda event, **_: events.append(event))
jax.jit(lambda x: x * 3)(jnp.ones(2)).block_until_ready()  # before: JAX decides here
_jax_compat.use_compilation_cache(sys.argv[1])
assert "use_compilation_cache" not in _jax_compat.BROKEN, _jax_compat.BROKEN
jax.jit(lambda x: jnp.sin(x) + 1)(jnp.ones(5)).block_until_ready()
print(events.count("/jax/compilation_cache/cache_hits"))
"""


def test_use_compilation_cache_works_after_a_compile(tmp_path):
    """The program compiled after the switch is written to the folder (JAX
    had decided against a cache at the first compile), and a second process
    loads it from there."""
    import subprocess
    import sys

    from jaxfog.testing import launch_environment

    env = launch_environment()
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the suite's
    env.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)
    hits = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", _USES_THE_CACHE, str(tmp_path)], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        hits.append(int(done.stdout.split()[-1]))
    assert list(tmp_path.iterdir())
    assert hits[0] == 0 and hits[1] >= 1, hits  # sin + 1, and jnp.ones(5) eagerly


def test_private_jax_is_reached_from_this_module_only():
    from pathlib import Path

    package = Path(jf.__file__).parent
    offenders = [str(p.relative_to(package)) for p in package.rglob("*.py")
                 if p.name != "_jax_compat.py" and "jax._src" in p.read_text()]
    assert offenders == []
