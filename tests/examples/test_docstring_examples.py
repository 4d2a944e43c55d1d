"""Every ``Example::`` of a public docstring runs, as a user would paste it
into a program of 4 MPI processes; and every optax transformation's docstring
carries its update equations and an example.

An example may use what a reader's program around it would hold: ``params``
(a small MLP's: four leaves), ``grads`` (its gradient), ``x`` (an array), ``loss`` (a
scalar), ``step`` (a step that averages ``params`` with the neighbours),
``state``, ``batch``. An example that builds an
``optimizer`` and its ``opt_state`` and stops there is taken one jitted
update further, whose result must have the parameters' structure and be
finite.
"""

from __future__ import annotations

import inspect
import re
import textwrap

import pytest

from mpi_harness import mpi_test

#: The public modules whose names' docstrings are read.
MODULES = ("jaxfog", "jaxfog.optax", "jaxfog.topology", "jaxfog.compress",
           "jaxfog.asynchrony", "jaxfog.elastic", "jaxfog.mesh", "jaxfog.timeline")


def examples() -> list[tuple[str, str]]:
    """``(where, code)`` of every ``Example::`` block of a public name's docstring."""
    import importlib

    found = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name)
            doc = inspect.getdoc(obj) if callable(obj) or inspect.isclass(obj) else None
            if not doc or getattr(obj, "__module__", "").split(".")[0] != "jaxfog":
                continue
            for match in re.finditer(r"Example::\n\n((?:(?: {4}.*)?\n)+)", doc + "\n"):
                found.append((f"{module_name}.{name}", textwrap.dedent(match.group(1))))
    unique = dict(found)  # a name exported by two modules: once
    return sorted(unique.items())


def test_the_examples_are_found():
    where = [w for w, _ in examples()]
    assert len(where) >= 20, where
    for name in ("jaxfog.neighbor_allreduce", "jaxfog.optax.atc", "jaxfog.optax.diloco",
                 "jaxfog.simulate", "jaxfog.optax.streaming_diloco"):
        assert name in where, name


def test_every_transformation_documents_its_equations_and_an_example():
    """optax's habit: the update equations in the docstring, and how to call it."""
    import jaxfog.optax as jfo

    # What returns a transformation (Diffusion and StreamingDiLoCo are ones
    # with a method more).
    kinds = ("GradientTransformation", "Diffusion", "StreamingDiLoCo")
    transformations = [n for n in jfo.__all__ if inspect.isfunction(getattr(jfo, n)) and any(
        kind in str(inspect.signature(getattr(jfo, n)).return_annotation) for kind in kinds)]
    assert len(transformations) >= 14, transformations
    lacking = [n for n in transformations
               if ".. math::" not in getattr(jfo, n).__doc__
               or "Example::" not in getattr(jfo, n).__doc__]
    assert not lacking, f"transformations without equations or an example: {lacking}"


@mpi_test(nprocs=(4,), timeout=400)
def test_every_docstring_example_runs():
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxfog

    jaxfog.init()
    default = jaxfog.topology.exponential(jaxfog.size())
    for where, code in examples():
        rank = float(jaxfog.rank())
        params = {f"layer{i}": {"w": jnp.full((4, 4), rank), "b": jnp.zeros(4)}
                  for i in (1, 2)}  # a small MLP's
        held = {"jax": jax, "jnp": jnp, "np": np, "optax": optax, "jaxfog": jaxfog,
                "params": params, "grads": jax.tree.map(jnp.ones_like, params),
                "x": jnp.full(3, rank), "loss": jnp.float32(rank), "state": None,
                "batch": None,
                "step": lambda params, state: (jaxfog.neighbor_allreduce(params), state)}
        try:
            exec(compile(code, f"<example of {where}>", "exec"), held)
            optimizer, opt_state = held.get("optimizer"), held.get("opt_state")
            if opt_state is not None and "updates" not in held:
                updates, _ = jax.jit(optimizer.update)(held["grads"], opt_state, held["params"])
                assert jax.tree.structure(updates) == jax.tree.structure(params)
                assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))
        except Exception as error:
            raise AssertionError(f"the example of {where} failed:\n{code}") from error
        finally:
            jaxfog.set_topology(default)


pytestmark = pytest.mark.jax_internals
