"""Checkpointing a decentralized run with orbax: MPI processes save every
agent's params, optimizer state and schedule step; new processes restore them
and continue bit-identically to the uninterrupted run."""

from __future__ import annotations

import os

import pytest

from jaxfog.testing import run_mpi

STEPS = 12  # saved after STEPS, compared after 2 * STEPS


def _run(nprocs: int, body: str, directory) -> None:
    result = run_mpi(nprocs, __file__, body, timeout=180, env={"CKPT_DIR": str(directory)})
    if not result.ok:
        pytest.fail(result.report(), pytrace=False)


def _training():
    """(state, train(state, start, stop)): ATC over the one-peer schedule with
    Adam, on this rank's slice of the digits data; the minibatch depends on
    the step, so a restored run must restore the step to continue the same."""
    import jax
    import jax.numpy as jnp
    import optax
    from sklearn.datasets import load_digits

    import jaxfog as jf
    import jaxfog.optax as jfo
    import jaxfog.topology as T

    r, n = jf.rank(), jf.size()
    images, labels = load_digits(return_X_y=True)
    order = jnp.argsort(jnp.asarray(labels))
    mine = jnp.array_split(order, n)[r]
    x, y = jnp.asarray(images[mine] / 16.0, jnp.float32), jnp.asarray(labels[mine])
    optimizer = jfo.atc(optax.adam(1e-2), topology=T.one_peer_exponential(n))
    params = {"w": jnp.zeros((64, 10)), "b": jnp.zeros(10)}

    def loss(p, xb, yb):
        logits = xb @ p["w"] + p["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    @jax.jit
    def step(state, k):
        params, opt_state = state
        take = jax.random.choice(jax.random.fold_in(jax.random.key(r), k), len(y), (16,))
        grads = jax.grad(loss)(params, x[take], y[take])
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def train(state, start, stop):
        for k in range(start, stop):
            state = step(state, k)
        return state

    return (params, optimizer.init(params)), train


def _final_path(rank: int) -> str:
    return os.path.join(os.environ["CKPT_DIR"], f"final_{rank}.npz")


def save_then_continue():
    import jax
    import numpy as np

    import jaxfog as jf
    from jaxfog.checkpoint import CheckpointManager

    jf.init()
    state, train = _training()
    with CheckpointManager(os.environ["CKPT_DIR"], max_to_keep=2) as manager:
        assert manager.latest_step() is None
        with pytest.raises(ValueError, match="ranks disagree on the step .rank 0: 0, rank 1: 1"):
            manager.save(jf.rank(), state)  # every rank raises; nothing is written
        state = train(state, 0, STEPS // 2)
        manager.save(STEPS // 2, state)
        state = train(state, STEPS // 2, STEPS)
        assert manager.save(STEPS, state)
        manager.wait_until_finished()
    state = train(state, STEPS, 2 * STEPS)
    assert int(state[1].count) == 2 * STEPS  # the schedule step is in the state
    np.savez(_final_path(jf.rank()), *jax.tree.leaves(state))


def restore_and_continue():
    import jax
    import numpy as np

    import jaxfog as jf
    from jaxfog.checkpoint import CheckpointManager

    jf.init()
    fresh, train = _training()
    with CheckpointManager(os.environ["CKPT_DIR"]) as manager:
        assert manager.all_steps() == [STEPS // 2, STEPS]
        missing = r"no checkpoint of step 5 .* \(have \[6, 12\]\)"
        with pytest.raises(FileNotFoundError, match=missing):
            manager.restore(5, like=fresh)
        state = manager.restore(None, like=fresh)  # the latest: STEPS
    assert int(state[1].count) == STEPS
    state = train(state, STEPS, 2 * STEPS)
    expected = np.load(_final_path(jf.rank()))
    leaves = jax.tree.leaves(state)
    assert len(leaves) == len(expected.files)
    for i, leaf in enumerate(leaves):
        want = expected[f"arr_{i}"]
        assert leaf.dtype == want.dtype and np.array_equal(np.asarray(leaf), want), i


def restore_with_another_size():
    import jaxfog as jf
    from jaxfog.checkpoint import CheckpointManager

    jf.init()
    with pytest.raises(ValueError, match="with 4 process"):
        CheckpointManager(os.environ["CKPT_DIR"])


def test_restored_run_continues_bit_identically(tmp_path):
    _run(4, "save_then_continue", tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["final_0.npz", "final_1.npz", "final_2.npz",
                                            "final_3.npz", "jaxfog.json", "rank_0", "rank_1",
                                            "rank_2", "rank_3"]
    _run(4, "restore_and_continue", tmp_path)
    _run(3, "restore_with_another_size", tmp_path)


def test_simulated_agents_checkpoint_their_stacked_state(tmp_path):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxfog as jf
    import jaxfog.optax as jfo
    import jaxfog.topology as T
    from jaxfog.checkpoint import CheckpointManager

    n = 4
    optimizer = jfo.awc(optax.adam(0.1), topology=T.one_peer_exponential(n))
    data = jnp.asarray(np.random.default_rng(0).standard_normal((n, 5)), jnp.float32)

    def step(state, target):
        params, opt_state = state
        grads = params - target
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(jf.simulate(step, n))
    state = jax.jit(jf.simulate(lambda x: (x, optimizer.init(x)), n))(jnp.zeros((n, 5)))
    for _ in range(3):
        state = step(state, data)
    with CheckpointManager(tmp_path, async_save=False) as manager:
        manager.save(3, state)
    with CheckpointManager(tmp_path) as manager:
        restored = manager.restore(None, like=state)
    assert (tmp_path / "rank_0").is_dir()
    for _ in range(3):
        state, restored = step(state, data), step(restored, data)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert int(restored[1].count[0]) == 6


def _awc_problem(n=4):
    """awc with Adam over the one-peer schedule, pulled towards per-agent targets."""
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxfog.optax as jfo
    import jaxfog.topology as T

    optimizer = jfo.awc(optax.adam(0.1), topology=T.one_peer_exponential(n))
    data = jnp.asarray(np.random.default_rng(0).standard_normal((n, 5)), jnp.float32)

    def step(state, target):
        params, opt_state = state
        updates, opt_state = optimizer.update(params - target, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return optimizer, data, step


def continue_converted_on_processes():
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxfog as jf
    from jaxfog.checkpoint import CheckpointManager

    jf.init()
    optimizer, data, step = _awc_problem(jf.size())
    fresh = (jnp.zeros(5), optimizer.init(jnp.zeros(5)))
    with CheckpointManager(os.path.join(os.environ["CKPT_DIR"], "mpi")) as manager:
        state = manager.restore(None, like=fresh)
    step = jf.jit(step)
    for _ in range(3):
        state = step(state, data[jf.rank()])
    np.savez(_final_path(jf.rank()), *jax.tree.leaves(state))


def test_simulated_checkpoints_continue_on_mpi_processes_and_back(tmp_path):
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxfog as jf
    from jaxfog.checkpoint import CheckpointManager, convert

    n = 4
    optimizer, data, step = _awc_problem(n)
    step = jax.jit(jf.simulate(step, n))
    state = jax.jit(jf.simulate(lambda x: (x, optimizer.init(x)), n))(jnp.zeros((n, 5)))
    for _ in range(3):
        state = step(state, data)
    with CheckpointManager(tmp_path / "sim", async_save=False) as manager:
        manager.save(3, state)
    one = (jnp.zeros(5), optimizer.init(jnp.zeros(5)))
    with pytest.raises(ValueError, match="for 1 process.*not to 1"):
        convert(tmp_path / "sim", tmp_path / "same", processes=1, like=one)
    assert convert(tmp_path / "sim", tmp_path / "mpi", processes=n, like=one) == [3]
    _run(n, "continue_converted_on_processes", tmp_path)
    for _ in range(3):
        state = step(state, data)
    for r in range(n):  # the processes went on as the simulated agents did
        on_rank = np.load(tmp_path / f"final_{r}.npz")
        for i, leaf in enumerate(jax.tree.leaves(state)):
            np.testing.assert_allclose(on_rank[f"arr_{i}"], np.asarray(leaf)[r], rtol=1e-5,
                                       atol=1e-6, err_msg=f"rank {r}, leaf {i}")
    # And back: the processes' checkpoints as one process of stacked agents, bit for bit.
    assert convert(tmp_path / "mpi", tmp_path / "back", processes=1, like=one) == [3]
    with CheckpointManager(tmp_path / "back") as manager:
        back = manager.restore(3, like=state)
    with CheckpointManager(tmp_path / "sim") as manager:
        saved = manager.restore(3, like=state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(saved)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    with pytest.raises(ValueError, match=r"run with 4 process.*jaxfog.checkpoint.convert"):
        CheckpointManager(tmp_path / "mpi")
