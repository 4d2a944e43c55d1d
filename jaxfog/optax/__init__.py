r"""Decentralized optimizers as optax transformations.

Each is an ``optax.GradientTransformationExtraArgs`` with a NamedTuple state,
pure and jittable, called as ``update(grads, state, params)`` (``params`` is
required, except by :func:`gradient_allreduce`), and runs unchanged on every
backend: MPI processes (``jaxfog run``) and simulated agents
(:func:`jaxfog.simulate`).

Notation, the same in every docstring below: agent (rank) :math:`i` holds the
parameters :math:`x_i^k` at step :math:`k` (the ``params`` given to
``update``), :math:`g_i^k` is its local gradient (``grads``), :math:`u_i^k`
the update of the inner optax transformation and :math:`a` the learning rate.
:math:`W` is the mixing matrix in jaxfog's convention, ``W[i, j]`` being the
weight agent :math:`i` gives to what agent :math:`j` sends, so that one
neighbour averaging is

.. math::

    x_i \leftarrow \sum_j W_{ij}\, x_j .

``update`` returns the change of the parameters (:math:`x_i^{k+1} - x_i^k`),
to be applied with ``optax.apply_updates``.

``topology=`` takes a :class:`~jaxfog.topology.Topology`, a
:class:`~jaxfog.topology.Schedule` (the step counter lives in the state, so a
time-varying graph never retraces) or ``None``: the runtime's current topology
(:func:`jaxfog.load_topology`; in :func:`jaxfog.simulate`, the simulation's).

The transformations:

* :func:`atc` and :func:`awc`: diffusion around any optax optimizer; with a
  constant step size they stop at a distance from the optimum that shrinks
  with the step size.
* :func:`gradient_allreduce`: global gradient averaging, the baseline.
* :func:`gradient_tracking` and :func:`exact_diffusion`: exact methods (they
  reach the optimum of :math:`\sum_i f_i` with a constant step size).
  :func:`gradient_tracking` also takes an optax transformation in place of
  its step size and runs it on the tracked gradient: Adam for agents whose
  data differ, where Adam inside :func:`atc` or :func:`awc` stalls.
* :func:`push_sum` and :func:`push_diging`: directed and time-varying graphs,
  with the column-stochastic weights of :func:`column_stochastic`.
* :func:`choco` and :func:`beer`: compressed gossip (CHOCO-SGD, and BEER,
  exact); ``compressor=`` in :func:`gradient_allreduce` and :func:`awc` adds
  error feedback. Compressors come from :mod:`jaxfog.compress`. Every agent
  keeps public copies of itself and its in-neighbours; on a
  :class:`~jaxfog.topology.Schedule` it keeps copies of the union of its
  in-neighbours over the period and sends to the union of its out-neighbours
  at every step, so no copy goes stale (the mixing uses the step's weights).
* :func:`local_sgd`, :func:`diloco` and :func:`noloco`: low-communication
  training. Every agent takes ``every`` inner steps alone, then the agents
  average their parameters (local SGD), or their pseudo-gradients before an
  outer optimizer step (DiLoCo, optionally compressed with error feedback),
  or pair up with one random peer for NoLoCo's outer step. The steps in
  between run no communication op.
* :func:`streaming_diloco`: DiLoCo fragment by fragment (Streaming DiLoCo):
  the fragments' syncs are spread over the ``every`` steps, so a step sends
  at most one fragment's pseudo-gradient, and each exchange is started with
  :func:`jaxfog.allreduce_nonblocking` and finished ``delay`` steps later,
  its :class:`jaxfog.Handle` carried in the optimizer state.

Where they stand in a chain: ``atc``, ``awc``, ``push_sum``, ``local_sgd``,
``diloco``, ``streaming_diloco`` and ``noloco`` wrap an inner optax
transformation (put clipping, weight decay, etc. inside it) and must be the last
element of a chain, since their updates move the parameters to mixed values;
``gradient_allreduce`` averages the gradients before its inner transformation;
``gradient_tracking`` (a learning rate or an inner transformation),
``exact_diffusion`` and ``push_diging`` (a learning rate) are used alone (or
after gradient-only transforms such as clipping) and, mixing the parameters,
come last.

Compile the train step with :func:`jaxfog.jit` (a drop-in for ``jax.jit``):
the step then dispatches on JAX's C++ path, which matters for a state of
hundreds of leaves (plain ``jax.jit`` is correct but pays about 9 us per leaf
per call)::

    import jax, optax, jaxfog, jaxfog.optax

    optimizer = jaxfog.optax.atc(optax.sgd(0.1))
    opt_state = optimizer.init(params)

    @jaxfog.jit
    def step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

The modules, one per family: ``diffusion`` (atc, awc, gradient_allreduce),
``exact`` (gradient_tracking, exact_diffusion), ``push_sum`` (push_sum,
async_push_sum, push_diging), ``compressed`` (choco, beer, error feedback),
``local_sgd`` (local_sgd, diloco, noloco), ``streaming`` (streaming_diloco);
what they share is in ``_common``.
Import the names from :mod:`jaxfog.optax` itself.

References:
  Ying, Yuan, Hu, Chen, Yin. *BlueFog: Make Decentralized Algorithms
  Practical for Optimization and Deep Learning*. arXiv:2111.04287, 2021.
"""

from jaxfog.optax._common import check_chain
from jaxfog.optax._gossip import ErrorFeedbackState, PublicCopies
from jaxfog.optax.compressed import BeerState, ChocoState, beer, choco
from jaxfog.optax.diffusion import (DelayedDiffusionState, Diffusion, DiffusionState, atc,
                                    awc, gradient_allreduce)
from jaxfog.optax.exact import (ExactDiffusionState, TrackingState, exact_diffusion,
                                gradient_tracking)
from jaxfog.optax.local_sgd import (DiLoCoState, LocalSGDState, NoLoCoState, diloco, local_sgd,
                                    noloco, random_pairs)
from jaxfog.optax.push_sum import (AsyncPushSumState, PushDigingState, PushSumState,
                                   async_push_sum, column_stochastic, mass_dtype,
                                   min_push_weight, push_diging, push_sum)
from jaxfog.optax.streaming import (StreamingDiLoCo, StreamingDiLoCoState, streaming_diloco,
                                    streaming_offsets)

__all__ = ["AsyncPushSumState", "BeerState", "ChocoState", "DiLoCoState", "DelayedDiffusionState",
           "Diffusion", "DiffusionState",
           "ErrorFeedbackState", "ExactDiffusionState", "LocalSGDState", "NoLoCoState",
           "PublicCopies", "PushDigingState", "PushSumState", "StreamingDiLoCo",
           "StreamingDiLoCoState", "TrackingState",
           "async_push_sum", "atc", "awc", "beer", "check_chain", "choco",
           "column_stochastic", "diloco", "exact_diffusion", "gradient_allreduce",
           "gradient_tracking", "local_sgd", "mass_dtype", "min_push_weight", "noloco",
           "push_diging", "push_sum", "random_pairs", "streaming_diloco",
           "streaming_offsets"]
