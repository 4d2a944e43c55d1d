"""jaxfog.elastic on simulated agents and in one process: who resumes what
(``plan``), the invariants restored after a membership change (against the
centralized optimum of the members that remain), snapshots on disk, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfog as jf
import jaxfog.elastic as je
import jaxfog.optax as jfo
import jaxfog.topology as T
from jaxfog.errors import BackendError

pytestmark = pytest.mark.jax_internals


# --- plan: pure -------------------------------------------------------------------------

def test_plan_fresh_start_numbers_members_by_rank():
    plan = je.plan(["a", "a", "b"], {"a": {}, "b": {}}, every=10)
    assert (plan.step, plan.members, plan.donors) == (0, [0, 1, 2], {})


def test_plan_resumes_at_the_oldest_latest_snapshot_and_drops_a_lost_host():
    # Host b (members 2, 3) is gone; member 1 died mid-write of step 30.
    listings = {"a": {0: [20, 30], 1: [10, 20]}, "c": {4: [20, 30]}}
    plan = je.plan(["a", "a", "c"], listings, every=10)
    assert plan.step == 20
    assert plan.members == [0, 1, 4]
    assert plan.snapshots == [("a", 0), ("a", 1), ("c", 4)]
    assert plan.donors == {}


def test_plan_gives_newcomers_fresh_ids_and_the_nearest_resumed_rank_below():
    listings = {"a": {0: [10], 1: [10]}, "new": {}}
    plan = je.plan(["a", "a", "new", "new"], listings, every=10)
    assert plan.members == [0, 1, 2, 3]
    assert plan.donors == {2: 1, 3: 1}
    # rank 0 new: its donor is found cyclically (the last resumed rank)
    plan = je.plan(["new", "a"], {"new": {}, "a": {5: [10]}}, every=10)
    assert plan.members == [6, 5] and plan.donors == {0: 1}


def test_plan_drops_stale_members_of_a_host_that_came_back():
    listings = {"a": {0: [90, 100]}, "b": {1: [30, 40]}}   # b left at step 40
    plan = je.plan(["a", "b"], listings, every=10)
    assert plan.step == 100 and plan.members == [0, 2] and plan.donors == {1: 0}


# --- simulated churn: the invariants -------------------------------------------------------

def _quadratic_program(method, steps=400, every=10):
    """Agent r of n minimises 0.5 |x - c_r|^2 with c_r = (r, r^2) / n: the
    members' optimum is the mean of their c_r."""
    def program(n):
        agents = jf.Agents(simulated=n)
        topology = T.exponential(n)
        optimizer = {"gradient_tracking": lambda: jfo.gradient_tracking(0.2, topology=topology),
                     "exact_diffusion": lambda: jfo.exact_diffusion(0.2, topology=topology),
                     "gradient_allreduce": lambda: jfo.gradient_allreduce(optax.sgd(0.2)),
                     "atc": lambda: jfo.atc(optax.sgd(0.2), topology=topology)}[method]()
        targets = agents.data(lambda r: np.array([r, r * r], np.float32) / n)

        def step(x, s, c):
            updates, s = optimizer.update(x - c, s, x)
            return optax.apply_updates(x, updates), s

        x0 = agents.data(lambda r: np.zeros(2, np.float32))
        state = je.State(params=x0, opt_state=agents.map(optimizer.init)(x0), every=every)
        step = agents.map(step)
        for _ in state.steps(steps):
            state.params, state.opt_state = step(state.params, state.opt_state, targets)
        return np.asarray(state.params), np.asarray(targets)
    return program


@pytest.mark.parametrize("method", ["gradient_tracking", "exact_diffusion"])
def test_exact_methods_reach_the_remaining_members_optimum_after_churn(method):
    """4 agents; at step 100 agent 3 leaves, at step 200 two join: the exact
    methods still reach the optimum of the 5 members' losses (the invariant
    restored; without it the trackers keep a bias)."""
    (x, c), resumed = je.simulate(_quadratic_program(method), 4,
                                  {100: je.Change(leave=[3]), 200: je.Change(join=2)})
    assert [r.members for r in resumed] == [(0, 1, 2, 3), (0, 1, 2), (0, 1, 2, 4, 5)]
    assert [r.changed for r in resumed] == [False, True, True]
    assert resumed[2].copied_from == {3: 2, 4: 2}
    np.testing.assert_allclose(x, np.broadcast_to(c.mean(0), x.shape), atol=1e-5)


def test_without_the_tracking_rule_the_bias_stays():
    """The rule is what makes the test above pass: the same churn with it
    switched off leaves gradient tracking away from the optimum."""
    rule = je.RULES.pop(jfo.TrackingState)
    try:
        (x, c), _ = je.simulate(_quadratic_program("gradient_tracking"), 4,
                                {100: je.Change(leave=[3])})
    finally:
        je.RULES[jfo.TrackingState] = rule
    assert np.abs(x - c.mean(0)).max() > 1e-2


def test_a_restart_with_the_same_members_continues_exactly():
    program = _quadratic_program("atc", steps=60)
    (x, _), _ = je.simulate(program, 4)
    (y, _), resumed = je.simulate(program, 4, {30: je.Change()})
    assert resumed[1].step == 30 and not resumed[1].changed
    np.testing.assert_array_equal(x, y)


# --- one process: snapshots on disk ----------------------------------------------------------

def test_snapshots_resume_where_they_stopped(tmp_path, monkeypatch):
    monkeypatch.setenv(je.DIRECTORY_ENV, str(tmp_path))
    x0 = jnp.zeros(3, jnp.float32)
    state = je.State(x=x0, every=4)
    for step in state.steps(10):
        state.x = state.x + step
    assert state.resumed.step == 0
    files = sorted(p.name for p in next(tmp_path.iterdir()).iterdir())
    assert files == ["member0.step10.npz", "member0.step8.npz"]  # the newest two
    again = je.State(x=x0, every=4)
    assert again.step == 10 and again.x.dtype == jnp.float32
    np.testing.assert_array_equal(again.x, np.full(3, 45.0))
    for step in again.steps(12):
        again.x = again.x + step
    np.testing.assert_array_equal(again.x, np.full(3, 66.0))


def test_bad_input_is_refused(tmp_path):
    with pytest.raises(ValueError, match="keyword arguments"):
        je.State(every=3, directory=str(tmp_path))
    with pytest.raises(ValueError, match="every"):
        je.State(x=jnp.zeros(2), every=0, directory=str(tmp_path))
    state = je.State(x=jnp.zeros(2), every=2, directory=str(tmp_path))
    with pytest.raises(AttributeError, match="has no value 'y'"):
        state.y = 1
    for _ in state.steps(2):
        pass
    with pytest.raises(ValueError, match=r"\['x'\] is \(2,\) in the snapshot but \(3,\)"):
        je.State(x=jnp.zeros(3), every=2, directory=str(tmp_path))
    with pytest.raises(ValueError, match="version"):
        je.State(x=jnp.zeros(2), every=2, directory=str(tmp_path), version="v2")
    with pytest.raises(ValueError, match="taken every 2 steps"):
        je.State(x=jnp.zeros(2), every=5, directory=str(tmp_path))
    with pytest.raises(ValueError, match=r"members \[7\] are not in the run"):
        je.simulate(_quadratic_program("atc", steps=20), 2, {5: je.Change(leave=[7])})
    with pytest.raises(ValueError, match="no agent is left"):
        je.simulate(_quadratic_program("atc", steps=20), 2, {5: je.Change(leave=[0, 1])})
    with pytest.warns(RuntimeWarning, match="one agent is left"):
        je.simulate(_quadratic_program("atc", steps=20), 2, {5: je.Change(leave=[1])})
    # Joining in place is elastic.run's, under ULFM (test_elastic_in_place_mpi.py).
    with pytest.raises(jf.JaxfogError, match="join in place only inside jaxfog.elastic.run"):
        je.request_join()
    with pytest.raises(ValueError, match="count"):
        je.request_join(0)
    with pytest.raises(ValueError, match=r"hosts must be 2 str \(one a rank\)"):
        je.request_join(2, ["node1"])
    with pytest.raises(BackendError, match="needs MPI with ULFM"):
        jf.runtime.grow(1)


def test_plan_leaves_out_a_member_the_last_run_did_not_have():
    """Member 3 sat out the last run (its slot was gone) but its files, one
    interval older, are still on the host: the run's snapshots do not list it."""
    listings = {"a": {0: [20, 30], 1: [20, 30], 2: [20, 30], 3: [10, 20]}}
    rosters = {("a", m): [0, 1, 2] for m in range(3)} | {("a", 3): [0, 1, 2, 3]}
    plan = je.plan(["a"] * 4, listings, every=10, rosters=rosters)
    assert plan.step == 30 and plan.members == [0, 1, 2, 4] and plan.donors == {3: 2}
    # without the rosters it would have been taken back, at the older step
    assert je.plan(["a"] * 4, listings, every=10).step == 20


def _nnx_program(steps=60):
    """A Flax NNX MLP on the digits with atc, the state as ``nnx.split`` gives it."""
    from flax import nnx
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    images, labels = (images / 16.0).astype(np.float32), labels.astype(np.int32)

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.hidden, self.out = nnx.Linear(64, 32, rngs=rngs), nnx.Linear(32, 10, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x)))

    graphdef, params0 = nnx.split(MLP(nnx.Rngs(0)))

    def program(n):
        agents = jf.Agents(simulated=n)
        optimizer = jfo.atc(optax.sgd(0.1, momentum=0.9), topology=T.exponential(n))
        x, y = agents.data(lambda r: (images[r::n][:len(images) // n],
                                      labels[r::n][:len(images) // n]))

        def train_step(params, opt_state, x, y, step):
            rows = (jnp.arange(32) + step * 32) % x.shape[0]

            def loss(params):
                logits = nnx.merge(graphdef, params)(x[rows])
                return optax.softmax_cross_entropy_with_integer_labels(logits, y[rows]).mean()

            updates, opt_state = optimizer.update(jax.grad(loss)(params), opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        train_step = agents.map(train_step, in_axes=(0, 0, 0, 0, None))
        params, opt_state = agents.map(lambda _: (params0, optimizer.init(params0)))(
            agents.data(lambda r: np.int32(r)))
        state = je.State(params=params, opt_state=opt_state, every=10)
        for step in state.steps(steps):
            state.params, state.opt_state = train_step(state.params, state.opt_state, x, y,
                                                       jnp.int32(step))
        mean = jax.tree.map(lambda p: p.mean(0), state.params)
        accuracy = float((nnx.merge(graphdef, mean)(images).argmax(-1) == labels).mean())
        return state.params, accuracy
    return program


def test_a_flax_nnx_state_survives_restarts_and_churn():
    """nnx.State as the params: a restart with the same members continues
    bit for bit, churn keeps float32 and trains."""
    program = _nnx_program()
    (params, accuracy), _ = je.simulate(program, 3)
    (again, _), resumed = je.simulate(program, 3, {30: je.Change()})
    assert resumed[1].step == 30
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)
    (churned, churned_accuracy), resumed = je.simulate(
        program, 3, {20: je.Change(leave=[1]), 40: je.Change(join=2)})
    assert [r.members for r in resumed][-1] == (0, 2, 3, 4)
    assert all(leaf.dtype == jnp.float32 and leaf.shape[0] == 4
               for leaf in jax.tree.leaves(churned))
    assert accuracy > 0.8 and churned_accuracy > 0.8, (accuracy, churned_accuracy)
