"""What a new user meets first: mistakes get errors that say what to do, and
the API reference lists everything."""

from __future__ import annotations

import pydoc

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfog as jf
import jaxfog.asynchrony as jfa
import jaxfog.optax as jfo
import jaxfog.topology as T


def test_a_script_for_four_ranks_started_as_one_process_is_told_how_to_launch():
    jf.init()
    with pytest.raises(ValueError, match=r"4 nodes but there are 1 ranks.*jaxfog run -np 4"):
        jf.set_topology(T.ring(4))
    with pytest.raises(ValueError, match=r"neighbor_allreduce.*did you mean `jaxfog run -np 4"):
        jf.neighbor_allreduce(jnp.ones(3), topology=T.ring(4))


def test_optax_errors_name_the_transformation_the_user_called():
    jf.init()
    params = jnp.ones(3)
    for name, tx in [("atc", jfo.atc(optax.sgd(0.1), topology=T.ring(4))),
                     ("awc", jfo.awc(optax.sgd(0.1), topology=T.ring(4))),
                     ("exact_diffusion", jfo.exact_diffusion(0.1, topology=T.ring(4))),
                     ("gradient_tracking", jfo.gradient_tracking(0.1, topology=T.ring(4)))]:
        with pytest.raises(ValueError, match=rf"\(jaxfog\.optax\.{name}\): the topology has 4"):
            tx.update(params, tx.init(params), params)
    with pytest.raises(ValueError, match=r"jaxfog\.optax\.atc: communication must be one of"):
        jfo.atc(optax.sgd(0.1), communication="gossip")  # when it is made


def test_simulate_checks_the_number_of_agents_up_front():
    agent = lambda x: jf.neighbor_allreduce(x)  # noqa: E731
    with pytest.raises(ValueError, match=r"topology has 5 agents but argument 0 has 4 along "
                                         r"its agent axis 0 \(shape \(4, 3\)\)"):
        jf.simulate(agent, T.ring(5))(jnp.ones((4, 3)))
    with pytest.raises(ValueError, match=r"number has 3 agents but argument 1 has no axis 0"):
        jf.simulate(lambda x, y: x + y, 3)(jnp.ones((3, 2)), jnp.float32(1.0))
    out = jf.simulate(lambda x, y: x + y, 3, in_axes=(0, None))(jnp.ones((3, 2)), 1.0)
    np.testing.assert_array_equal(out, np.full((3, 2), 2.0))


def test_pydoc_lists_the_lazily_loaded_api():
    text = pydoc.render_doc(jf, renderer=pydoc.plaintext)
    for name in ("neighbor_allreduce(", "class Agents", "simulate(", "jit(", "win_put(",
                 "class Delays"):
        assert name in text, name
    assert {"neighbor_allreduce", "Agents", "simulate", "jit"} <= set(dir(jf))
    assert {"async_push_sum", "AsyncPushSumState"} <= set(jfo.__all__)


def test_a_transformation_after_atc_in_a_chain_is_warned_about():
    with pytest.warns(UserWarning, match=r"jaxfog.optax.atc is followed by 1 other.*clip"):
        jfo.check_chain(optax.chain(jfo.atc(optax.sgd(0.1)), optax.clip_by_global_norm(1.0)))
    with pytest.warns(UserWarning, match=r"jaxfog.optax.push_sum is followed"):
        jfa.from_optax(optax.chain(optax.chain(jfo.push_sum(optax.sgd(0.1)),
                                               optax.scale(2.0))))
    with pytest.warns(UserWarning, match=r"jaxfog.optax.awc is followed by 1 other"):
        jfo.check_chain(optax.named_chain(("mix", jfo.awc(optax.sgd(0.1))),
                                          ("clip", optax.clip(1.0))))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jfo.check_chain(jfo.atc(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))))
        jfo.check_chain(optax.chain(optax.clip(1.0), jfo.awc(optax.adam(0.1))))
        jfo.check_chain(optax.chain(jfo.gradient_allreduce(optax.sgd(0.1)), optax.clip(1.0)))
        jfo.check_chain(optax.named_chain(("clip", optax.clip(1.0)),
                                          ("mix", jfo.atc(optax.sgd(0.1)))))
