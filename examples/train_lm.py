"""Decentralized training of a byte-level transformer (Flax NNX) on Python's standard library.

    python examples/train_lm.py                           # 8 simulated agents, every method
    jaxfog run -np 8 python examples/train_lm.py          # 8 MPI processes
    python examples/train_lm.py --mesh                    # 8 agents on this process's devices
    jaxfog run -np 8 python examples/train_lm.py --mesh   # one agent per device of 8 processes
    python examples/train_lm.py --size gpu                # a bigger model, for a GPU

Data that every machine has: the source of the running Python's standard
library (``sysconfig.get_paths()['stdlib']``, its ``.py`` files outside
``site-packages``, sorted by relative path, the first ``--data-mb`` MB), as
bytes. Every 10th file is held out for validation. The other files are dealt
to the agents in contiguous blocks of about equal bytes, so that each agent
trains on its own files and they differ (one agent gets ``asyncio``, another
the codec tables of ``encodings``): heterogeneous data, as in decentralized
training. ``--iid`` deals the files in a random order instead.

The model: a decoder-only transformer over bytes (vocabulary 256), learned
positions, pre-LayerNorm blocks of causal multi-head attention and a GELU
MLP, the output layer tied to the embedding; parameters in float32, computed
in float32 or, with ``--dtype bfloat16``, in bfloat16 (the parameters cast
inside the loss, so the gradients, the optimizer and the exchanges stay in
float32, and the cross-entropy is taken on float32 logits). Every agent starts
from the same model and takes minibatches of random windows of its own
bytes; one training step is one ``jax.jit`` (on MPI processes
``jaxfog.jit``) call on all agents. The inner optimizer is AdamW with
gradient clipping and a warmup-cosine step size, combined by

* ``allreduce``: ``gradient_allreduce``, the data-parallel baseline;
* ``atc`` and ``tracking`` (``gradient_tracking`` with AdamW on the tracked
  gradient) on each graph of ``--graphs`` (the exponential graph, the
  one-peer exponential schedule);
* ``choco``: CHOCO-SGD sending ``--compressor``-compressed differences on
  ``--choco-graph``;
* ``diloco`` and ``diloco-compressed``: DiLoCo for each round length of
  ``--rounds``, with dense and with ``--compressor``-compressed
  pseudo-gradients (error feedback);
* ``streaming-diloco``: Streaming DiLoCo for each round length, 4 fragments
  synchronised in turn, each exchange waited for one step after it started
  (its simulated time is DiLoCo's: the overlap is not credited);
* ``noloco`` (one random peer per round) and ``local-sgd``, rounds of the
  first of ``--rounds``;
* ``push-sum``: asynchronous push-sum (SGP) in simulated time (simulated
  agents only).

Time is simulated, in the model of ``jaxfog.Delays``, agent 0 a straggler
(``--straggler`` times slower). The unit is a fast agent's compute
per step; a message takes ``--message-time`` units per copy of the model it
carries (an agent's sends go one after another). A synchronous method waits
for the straggler at every exchange (directly or through its neighbours),
so its step takes the straggler's compute plus the exchange; a method with
rounds takes the straggler's compute for each step and the exchange once a
round. Asynchronous push-sum runs in ``jaxfog.simulate(delays=...)``: every
agent at its own speed, for the time a fast agent takes for ``--steps``
steps.

Reported, every ``--eval-every`` steps: the validation loss of the agents'
averaged model in bits per byte, against steps, against the bytes each agent
sent (modelled; on MPI also what ``jaxfog.comm_stats`` counted) and against
simulated time; and, for scale, the bits per byte of a unigram model of the
training bytes; the wall time of the training steps, tokens (bytes) per
second, the model FLOP/s and the model FLOP utilization (MFU: model FLOP/s
over the devices' dense peak, :data:`PEAK_TFLOPS` or ``--peak-tflops``).
Writes ``--out``/lm_{n}agents.{md,json,png} (lm_{n}procs on
MPI processes).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from train_digits import Progress, Traffic, compressor, in_flight  # beside this script

import jaxfog as jf
import jaxfog.asynchrony as jfa
import jaxfog.compress as C
import jaxfog.optax as jfo
import jaxfog.topology as T
from jaxfog import _machine

VOCABULARY = 256  # bytes
METHODS = ("allreduce", "atc", "tracking", "choco", "diloco", "diloco-compressed",
           "streaming-diloco", "noloco", "local-sgd", "push-sum")
VALIDATION_EVERY = 10  # every 10th file is held out

#: Dense peak TFLOP/s of one device, by ``device_kind`` and compute dtype: NVIDIA's
#: H100 and H200 datasheets (SXM, PCIe and NVL forms), whose tensor-core figures
#: are "with sparsity", halved here. float32 is the TF32 tensor-core peak: XLA's
#: default precision runs float32 matmuls as TF32 on these GPUs (plain FP32 peaks
#: at 67 TFLOP/s on the SXM forms).
PEAK_TFLOPS = {
    "NVIDIA H200": {"bfloat16": 989.4, "float32": 494.7},
    "NVIDIA H200 NVL": {"bfloat16": 835.5, "float32": 417.5},
    "NVIDIA H100 80GB HBM3": {"bfloat16": 989.4, "float32": 494.7},
    "NVIDIA H100 PCIe": {"bfloat16": 756.5, "float32": 378.0},
    "NVIDIA H100 NVL": {"bfloat16": 835.5, "float32": 417.5},
}


class Size(NamedTuple):
    width: int
    depth: int
    heads: int
    context: int
    batch: int       # windows per agent and step
    steps: int
    lr: float
    data_mb: float
    eval_every: int
    eval_windows: int


SIZES = {
    "tiny": Size(width=32, depth=1, heads=2, context=32, batch=4, steps=12, lr=1e-2,
                 data_mb=1, eval_every=6, eval_windows=16),
    "default": Size(width=64, depth=2, heads=4, context=64, batch=4, steps=300, lr=1e-2,
                    data_mb=4, eval_every=10, eval_windows=128),
    "gpu": Size(width=256, depth=4, heads=8, context=256, batch=16, steps=2000, lr=3e-3,
                data_mb=32, eval_every=100, eval_windows=256),
}


# -- data ---------------------------------------------------------------------------------


def stdlib_files(megabytes: float) -> list[tuple[str, bytes]]:
    """(relative path, contents) of the standard library's .py files, sorted by
    path, up to ``megabytes`` MB in all (the last file cut)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted((p for p in root.rglob("*.py")
                    if not {"site-packages", "dist-packages"} & set(p.parts)),
                   key=lambda p: p.relative_to(root).as_posix())
    files, left = [], int(megabytes * 1e6)
    for path in paths:
        if left <= 0:
            break
        text = path.read_bytes()[:left]
        files.append((path.relative_to(root).as_posix(), text))
        left -= len(text)
    return files


class Corpus(NamedTuple):
    streams: np.ndarray           # (n, length) uint8: agent r's training bytes
    validation: np.ndarray        # (windows, context + 1) uint8
    unigram_bpb: float            # a unigram model of the training bytes, on validation
    files: list[list[str]]        # the files of each agent


def corpus(n: int, size: Size, *, data_mb: float, iid: bool, seed: int) -> Corpus:
    """The agents' training bytes (each its own files, equal lengths) and the
    validation windows (held-out files)."""
    files = stdlib_files(data_mb)
    held_out = [text for i, (_, text) in enumerate(files) if i % VALIDATION_EVERY == 0]
    train = [f for i, f in enumerate(files) if i % VALIDATION_EVERY]
    if iid:
        train = [train[i] for i in np.random.default_rng(seed).permutation(len(train))]
    if len(train) < n:
        raise SystemExit(f"--data-mb {data_mb}: {len(train)} training files for {n} agents")
    # Contiguous blocks of files with about equal bytes: cut at the file end
    # nearest to each n-th of the total (at least one file a block).
    ends = np.cumsum([len(text) for _, text in train])
    cuts = [int(np.argmin(np.abs(ends - ends[-1] * i / n))) + 1 for i in range(1, n)]
    for i in range(n - 1):
        cuts[i] = min(max(cuts[i], cuts[i - 1] + 1 if i else 1), len(train) - (n - 1 - i))
    blocks = np.split(np.arange(len(train)), cuts)
    streams = [np.frombuffer(b"".join(train[i][1] for i in block), np.uint8)
               for block in blocks]
    length = min(len(s) for s in streams)
    validation = np.frombuffer(b"".join(held_out), np.uint8)
    starts = np.random.default_rng(seed).integers(0, len(validation) - size.context - 1,
                                                  size.eval_windows)
    windows = np.stack([validation[s:s + size.context + 1] for s in starts])
    # Unigram: the training bytes' frequencies (add-one), scored on the
    # validation windows' predicted bytes.
    counts = sum(np.bincount(s, minlength=VOCABULARY) for s in streams) + 1
    unigram = -np.mean(np.log2(counts / counts.sum())[windows[:, 1:]])
    return Corpus(np.stack([s[:length] for s in streams]), windows, float(unigram),
                  [[train[i][0] for i in block] for block in blocks])


# -- model --------------------------------------------------------------------------------


class Block(nnx.Module):
    """Pre-LN transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, width: int, heads: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.attention_norm = nnx.LayerNorm(width, rngs=rngs)
        self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
        self.attention_out = nnx.Linear(width, width, rngs=rngs)
        self.mlp_norm = nnx.LayerNorm(width, rngs=rngs)
        self.mlp_in = nnx.Linear(width, 4 * width, rngs=rngs)
        self.mlp_out = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, width = x.shape
        qkv = self.qkv(self.attention_norm(x)).reshape(batch, length, 3, self.heads, -1)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # (batch, length, heads, dim)
        attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attention_out(attended.reshape(batch, length, width))
        return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.mlp_norm(x))))


class Transformer(nnx.Module):
    """Decoder-only byte-level language model: logits of the next byte."""

    def __init__(self, *, width: int, depth: int, heads: int, context: int, rngs: nnx.Rngs):
        small = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(VOCABULARY, width, embedding_init=small, rngs=rngs)
        self.position = nnx.Param(small(rngs.params(), (context, width)))
        self.blocks = nnx.List([Block(width, heads, rngs=rngs) for _ in range(depth)])
        self.norm = nnx.LayerNorm(width, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.position[:tokens.shape[-1]]
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.norm(x))  # the output layer tied to the embedding


def make_model(size: Size, seed: int) -> Transformer:
    return Transformer(width=size.width, depth=size.depth, heads=size.heads,
                       context=size.context, rngs=nnx.Rngs(seed))


def computed_in(graphdef: Any, params: Any, dtype: Any) -> Transformer:
    """The model that computes in ``dtype``; the gradient flows back through
    the cast to the float32 parameters."""
    return nnx.merge(graphdef, jax.tree.map(lambda v: v.astype(dtype), params))


def loss_nats(model: Transformer, windows: jax.Array) -> jax.Array:
    """Mean cross-entropy (nats) of each window's bytes after the first."""
    windows = windows.astype(jnp.int32)
    logits = model(windows[:, :-1]).astype(jnp.float32)  # bfloat16 logits lose the tail
    return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()


def flops_per_token(size: Size, params: Any) -> float:
    """Model FLOPs of one trained token, forward and backward (PaLM's count,
    appendix B): 6 per matmul parameter (the blocks' and the tied output
    layer's; the learned positions are only added) and 12 x depth x width x
    context for the attention scores and values (the causal mask's zeros
    counted, as is usual)."""
    matmul = sum(v.size for v in jax.tree.leaves(params)) - size.context * size.width
    return 6.0 * matmul + 12.0 * size.depth * size.width * size.context


def peak_tflops(device_kind: str, dtype: str) -> float | None:
    """One device's dense peak from :data:`PEAK_TFLOPS`, None if not listed."""
    return PEAK_TFLOPS.get(device_kind, {}).get(dtype)


def sample(stream: jax.Array, key: jax.Array, batch: int, context: int) -> jax.Array:
    """``batch`` random windows of ``context + 1`` bytes of ``stream``."""
    starts = jax.random.randint(key, (batch,), 0, stream.shape[0] - context)
    return jax.vmap(lambda s: jax.lax.dynamic_slice(stream, (s,), (context + 1,)))(starts)


def batch_key(seed: int, rank: Any, step: Any) -> jax.Array:
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed + 1), rank), step)


# -- methods ------------------------------------------------------------------------------


class Method(NamedTuple):
    label: str
    optimizer: Any                 # an optax transformation (a trainer for push-sum)
    every: int                     # steps per exchange round (1: every step)
    #: bytes one agent sends per round, from one agent's parameters
    bytes_per_round: Callable[[Any], float]
    asynchronous: bool = False


def nbytes(params: Any) -> int:
    return sum(v.nbytes for v in jax.tree.leaves(params))


def out_degree(topology: T.Topology | T.Schedule, n: int) -> float:
    """Out-neighbours per agent, averaged over the agents and schedule entries."""
    entries = list(topology) if isinstance(topology, T.Schedule) else [topology]
    return float(np.mean([len(t.out_neighbors(r)) for t in entries for r in range(n)]))


def union_out_degree(topology: T.Topology | T.Schedule, n: int) -> float:
    """CHOCO sends to every out-neighbour of the schedule's period."""
    entries = list(topology) if isinstance(topology, T.Schedule) else [topology]
    edges = np.any([t.weights != 0 for t in entries], axis=0) & ~np.eye(n, dtype=bool)
    return float(edges.sum(0).mean())


def inner_optimizer(args: argparse.Namespace, steps: int) -> optax.GradientTransformation:
    """Every method's inner optimizer: AdamW (``args.lr``, ``args.weight_decay``),
    warmup-cosine over ``steps``, gradients clipped at norm 1."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, steps // 20), steps)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, weight_decay=args.weight_decay))


def methods(n: int, names: list[str], args: argparse.Namespace,
            steps: int) -> list[Method]:
    """The runs to compare, in the order of the table."""
    def inner(length=steps):
        return inner_optimizer(args, length)

    def outer():  # DiLoCo's outer Nesterov step (the paper's: 0.7, momentum 0.9)
        return optax.sgd(args.outer_lr, momentum=args.outer_momentum or None,
                         nesterov=args.outer_momentum > 0)

    def dense(copies):
        return lambda params: copies * nbytes(params)

    ring = 2 * (n - 1) / n  # a ring allreduce sends 2 (n - 1) / n of the message
    graphs = {"exponential": T.exponential(n), "one-peer": T.one_peer_exponential(n)}
    unknown = set(names) - set(METHODS)
    if unknown:
        raise SystemExit(f"--methods: unknown {sorted(unknown)}")
    rounds = [int(h) for h in args.rounds.split(",")]
    c = compressor(args.compressor)
    runs = []
    if "allreduce" in names:
        runs.append(Method("allreduce", jfo.gradient_allreduce(inner()), 1, dense(ring)))
    for graph in args.graphs.split(","):
        topology = graphs[graph]
        if "atc" in names:
            runs.append(Method(f"atc {graph}", jfo.atc(inner(), topology=topology), 1,
                               dense(out_degree(topology, n))))
        if "tracking" in names:  # the tracker and the parameters: two exchanges
            runs.append(Method(f"gradient tracking {graph}",
                               jfo.gradient_tracking(inner(), topology=topology), 1,
                               dense(2 * out_degree(topology, n))))
    if "choco" in names:
        topology = graphs[args.choco_graph]
        degree = union_out_degree(topology, n)
        runs.append(Method(
            f"choco {c.name} {args.choco_graph}",
            jfo.choco(inner(), compressor=c, gamma=args.gamma, topology=topology), 1,
            lambda params: degree * C.tree_bytes(c, params)))
    for h in rounds:
        if "diloco" in names:
            runs.append(Method(f"diloco H={h}", jfo.diloco(inner(), outer(), every=h), h,
                               dense(ring)))
        if "diloco-compressed" in names:
            # The payloads travel in one allgather: n - 1 of them, merged into one group.
            runs.append(Method(
                f"diloco H={h} {c.name}",
                jfo.diloco(inner(), outer(), every=h, compressor=c, groups=1), h,
                lambda params: (n - 1) * C.tree_bytes(c, params, C.balanced(params, 1))))
        if "streaming-diloco" in names:
            # A round sends every fragment once: DiLoCo's bytes, a quarter at a time.
            runs.append(Method(
                f"streaming diloco H={h} P=4 tau=1",
                jfo.streaming_diloco(inner(), outer(), every=h, fragments=4, delay=1), h,
                dense(ring)))
    if "noloco" in names:  # with gamma = beta only the parameters travel, to one peer
        runs.append(Method(f"noloco H={rounds[0]}", jfo.noloco(inner(), every=rounds[0]),
                           rounds[0], dense(1.0)))
    if "local-sgd" in names:
        runs.append(Method(f"local SGD H={rounds[0]}", jfo.local_sgd(inner(), every=rounds[0]),
                           rounds[0], dense(ring)))
    if "push-sum" in names:  # each message: the numerator and the push weight (float32)
        topology = graphs["exponential"]
        degree = out_degree(topology, n)
        runs.append(Method(
            f"push-sum async, straggler {args.straggler:g}x",
            jfa.async_push_sum(inner(), topology=topology), 1,
            lambda params: degree * (nbytes(params) + 4), asynchronous=True))
    return runs


def synchronous_time(method: Method, steps: int, straggler: float, message_time: float,
                     params_bytes: int, sent_per_round: float) -> float:
    """Simulated time of ``steps`` steps of a synchronous method: the
    straggler's compute every step, and each round's exchanges, an agent's
    bytes at ``message_time`` per copy of the model."""
    return steps * straggler + (steps // method.every) * message_time * (
        sent_per_round / params_bytes)


# -- training -----------------------------------------------------------------------------


def averaged_bpb(agents: jf.Agents, graphdef: Any, params: Any, validation: jax.Array,
                 dtype: Any) -> float:
    """Validation bits per byte of the agents' averaged model (collective)."""
    mean = agents.mean(params)
    return float(evaluate(graphdef, mean, validation, dtype)) / math.log(2)


@functools.partial(jax.jit, static_argnums=(0, 3))
def evaluate(graphdef: Any, params: Any, validation: jax.Array, dtype: Any) -> jax.Array:
    return loss_nats(computed_in(graphdef, params, dtype), validation)


def train(agents: jf.Agents, method: Method, data: Corpus, size: Size, model: Any, *,
          steps: int, seed: int, straggler: float, message_time: float, progress: bool,
          dtype: Any, target: float | None = None,
          wire_bytes: Callable[[], int] | None = None) -> list[dict[str, Any]]:
    """One synchronous run from ``model`` (graphdef, params: the same on every
    agent); a row every ``size.eval_every`` steps (and at 0). It stops after
    the first row whose validation bpb is at or below ``target``, if given. On
    MPI each row has the run's bytes so far, evaluations excluded
    (``run_measured_bytes``; ``run_interface_bytes``: ``wire_bytes()``'s, the
    bytes this agent's interface has sent so far; train_digits.Traffic)."""
    graphdef, params = model
    optimizer = method.optimizer
    params_bytes = nbytes(params)
    sent_per_round = method.bytes_per_round(params)
    streams = agents.data(lambda r: data.streams[r])
    validation = jnp.asarray(data.validation)

    def init(stream):
        return params, optimizer.init(params)

    def step(params, opt_state, stream, k):
        windows = sample(stream, batch_key(seed, jf.rank(), k), size.batch, size.context)
        loss, grads = nnx.value_and_grad(
            lambda p: loss_nats(computed_in(graphdef, p, dtype), windows))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    state = agents.map(init)(streams)
    # Compiled ahead, so that the wall times are training, not compilation.
    step = agents.map(step, in_axes=(0, 0, 0, None)).lower(*state, streams, 0).compile()

    def row(k, losses, wall, measured, run=None):
        sent = (k // method.every) * sent_per_round
        return {"step": k,
                "val_bpb": averaged_bpb(agents, graphdef, state[0], validation, dtype),
                "train_bpb": (float(np.mean(agents.mean(jnp.stack(losses)))) / math.log(2)
                              if losses else None),
                "sent_bytes": sent, "wall_time": wall,
                "simulated_time": synchronous_time(method, k, straggler, message_time,
                                                   params_bytes, sent_per_round),
                **({} if measured is None else {"measured_sent_bytes": measured}),
                **(run or {})}

    measured = None if agents.simulated else 0
    traffic = Traffic(agents, wire_bytes)
    # The first evaluation, before any step, is every evaluation's traffic
    # (the same collectives: train_bpb's mean excepted, a few bytes).
    rows = [traffic.calibrate(lambda: row(0, [], 0.0, measured, traffic.totals()))]
    wall = 0.0
    with Progress(method.label, steps, progress and agents.is_root) as bar:
        for start in range(0, steps, size.eval_every):
            stop = min(steps, start + size.eval_every)
            traffic.read()  # what ran between the windows counts for the run only
            clock = time.perf_counter()
            losses = []
            for k in range(start, stop):
                *state, loss = step(*state, streams, k)
                losses.append(loss)
                bar(k + 1)
            jax.block_until_ready(losses)
            wall += time.perf_counter() - clock
            if not agents.simulated:  # what this rank put on the wire during the steps
                measured += traffic.read()[0]
            rows.append(row(stop, losses, wall, measured, traffic.totals()))
            traffic.evaluated()
            if target is not None and rows[-1]["val_bpb"] <= target:
                break  # the same on every agent: the averaged model's
    if hasattr(optimizer, "finish") and in_flight(state[1]):  # delay=, streaming_diloco
        def finish(params, opt_state):
            updates, opt_state = optimizer.finish(opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        state = list(agents.map(finish)(*state))
        if stop == steps:
            rows[-1] = row(steps, losses, wall, measured, traffic.totals())
    return rows


def train_push_sum(method: Method, data: Corpus, size: Size, model: Any, *, steps: int,
                   seed: int, straggler: float, message_time: float, progress: bool,
                   dtype: Any) -> list[dict[str, Any]]:
    """Asynchronous push-sum on simulated agents in simulated time: agent 0
    computes ``straggler`` units a step, the others 1; it runs until a fast
    agent has had the time for ``steps`` steps, in ``steps / eval_every``
    chunks."""
    n = data.streams.shape[0]
    trainer = method.optimizer
    topology = T.exponential(n)
    graphdef, params = model
    params_bytes = nbytes(params)
    sent_per_step = method.bytes_per_round(params)
    delays = jf.Delays.straggler(n, straggler, compute=1.0,
                                 message=message_time * sent_per_step / params_bytes)
    streams = jnp.asarray(data.streams)
    validation = jnp.asarray(data.validation)
    stacked = jax.tree.map(lambda v: jnp.broadcast_to(v, (n, *v.shape)), params)

    def grad_fn(stream):
        def gradient(params, k):
            windows = sample(stream, batch_key(seed, jf.rank(), k), size.batch, size.context)
            return jax.grad(lambda p: loss_nats(computed_in(graphdef, p, dtype), windows))(
                params)
        return gradient

    def chunk(state, stream, until):
        state = jfa.run(trainer, state, grad_fn(stream), 10**9, until=until)
        return state, trainer.params(state)

    def finish(state):
        state = trainer.finish(state)
        return state, trainer.params(state)

    jf.reset_clocks()
    run_until = jax.jit(jf.simulate(chunk, topology, delays=delays, in_axes=(0, 0, None)))
    state = jax.jit(jf.simulate(trainer.init, topology, delays=delays))(stacked)
    state, _ = run_until(state, streams, 0.0)  # compiles; no agent steps before time 0

    def row(state, model, until, wall):
        iterations = np.asarray(state.iteration)
        mean = jax.tree.map(lambda v: v.mean(0), model)
        return {"step": float(iterations.mean()),
                "val_bpb": float(evaluate(graphdef, mean, validation, dtype)) / math.log(2),
                "train_bpb": None, "sent_bytes": float(iterations.mean()) * sent_per_step,
                "wall_time": wall, "simulated_time": until, "iterations": iterations.tolist()}

    rows, wall = [row(state, stacked, 0.0, 0.0)], 0.0
    with Progress(method.label, steps, progress) as bar:
        for start in range(0, steps, size.eval_every):
            until = float(min(steps, start + size.eval_every))
            clock = time.perf_counter()
            state, model = jax.block_until_ready(run_until(state, streams, until))
            wall += time.perf_counter() - clock
            if until == steps:  # deliver the mass still in flight: the final models
                state, model = jax.jit(jf.simulate(finish, topology, delays=delays))(state)
            rows.append(row(state, model, until, wall))
            bar(int(until))
    jf.simulate(lambda v: (trainer.free(), v)[1], topology)(jnp.zeros(n))
    return rows


# -- report -------------------------------------------------------------------------------


def at_time(rows: list[dict[str, Any]], when: float) -> float:
    """Validation bpb at simulated time ``when`` (interpolated between rows)."""
    return float(np.interp(when, [r["simulated_time"] for r in rows],
                           [r["val_bpb"] for r in rows]))


def summary(results: dict[str, list[dict[str, Any]]], unigram: float, when: float,
            tokens_per_step: int, flops_per_token: float, peak: float | None) -> list[str]:
    """The table: per method, the last row, the bpb at simulated time ``when``,
    and the training throughput (``tokens_per_step``: all agents' bytes a step;
    ``peak``: the dense TFLOP/s of all the devices used, None if unknown)."""
    base = results.get("allreduce", [{}])[-1].get("val_bpb")
    measured = any("measured_sent_bytes" in rows[-1] for rows in results.values())
    lines = ["| method | steps | validation bpb | vs allreduce | MB sent / agent "
             + ("| measured MB " if measured else "")
             + f"| simulated time | bpb at time {when:g} | wall time | tokens/s "
             "| model TFLOP/s | MFU |",
             "|---|---:|---:|---:|---:|" + ("---:|" if measured else "")
             + "---:|---:|---:|---:|---:|---:|"]
    for label, rows in results.items():
        last = rows[-1]
        gap = "" if base is None else f"{last['val_bpb'] - base:+.3f}"
        tokens = last["step"] * tokens_per_step / max(last["wall_time"], 1e-9)
        tflops = tokens * flops_per_token / 1e12
        mfu = "" if peak is None else f"{100 * tflops / peak:.2f}%"
        lines.append(
            f"| {label} | {last['step']:.0f} | {last['val_bpb']:.3f} | {gap} "
            f"| {last['sent_bytes'] / 1e6:.2f} "
            + (f"| {last.get('measured_sent_bytes', float('nan')) / 1e6:.2f} "
               if measured else "")
            + f"| {last['simulated_time']:.0f} | {at_time(rows, when):.3f} "
            f"| {last['wall_time']:.1f} s | {tokens:,.0f} | {tflops:.3g} | {mfu} |")
    lines.append(f"| unigram model of the training bytes | | {unigram:.3f} | | | "
                 + ("| " if measured else "") + "| | | | | |")
    return lines


def plot(results: dict[str, list[dict[str, Any]]], unigram: float, path: str,
         title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5.5), sharey=True)
    colors = plt.get_cmap("tab20").colors
    for index, (label, rows) in enumerate(results.items()):
        # solid: an exchange every step; dashed: rounds; dash-dot: asynchronous
        style = ("-." if "async" in label else
                 "--" if label.split()[0] in ("diloco", "noloco", "local") else "-")
        color = colors[(2 * index) % 20 + (2 * index) // 20]
        values = [r["val_bpb"] for r in rows]
        axes[0].plot([r["step"] for r in rows], values, style, color=color, label=label)
        sent = [(r["sent_bytes"] / 1e6, v) for r, v in zip(rows, values) if r["sent_bytes"]]
        axes[1].plot(*zip(*sent), style, color=color)
        axes[2].plot([r["simulated_time"] for r in rows], values, style, color=color)
    for axis, xlabel in zip(axes, ("step", "MB sent per agent", "simulated time "
                                   "(a fast agent's steps; agent 0 is a straggler)")):
        axis.axhline(unigram, color="gray", linestyle=":", label="unigram")
        axis.set_xlabel(xlabel)
        axis.grid(True, alpha=0.3)
    axes[1].set_xscale("log")
    axes[0].set_ylabel("validation bits per byte (averaged model)")
    low = min(r["val_bpb"] for rows in results.values() for r in rows)
    axes[0].set_ylim(low - 0.1, max(low + 1.0, unigram + 0.8))
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def make_parser() -> argparse.ArgumentParser:
    """The command line; its defaults are also what benchmarks take."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default",
                        help="model, batch, steps and data (SIZES in this file); the "
                             "options --width to --eval-windows override its fields")
    for name in Size._fields:
        parser.add_argument(f"--{name.replace('_', '-')}",
                            type=type(getattr(SIZES["default"], name)), default=None)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--graphs", default="exponential,one-peer",
                        help="the graphs of atc and tracking")
    parser.add_argument("--rounds", default="10,50",
                        help="DiLoCo's round lengths H; noloco and local-sgd take the first")
    parser.add_argument("--compressor", default="top_k:0.05",
                        help="CHOCO's and compressed DiLoCo's: top_k:R, rand_k:R, sign, "
                             "qsgd:S, low_rank:R")
    parser.add_argument("--gamma", type=float, default=0.1, help="CHOCO's consensus step")
    parser.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer step size")
    parser.add_argument("--outer-momentum", type=float, default=0.9,
                        help="DiLoCo's outer Nesterov momentum")
    parser.add_argument("--choco-graph", default="exponential")
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--iid", action="store_true",
                        help="deal the training files to the agents in a random order")
    parser.add_argument("--straggler", type=float, default=4.0,
                        help="agent 0 computes this many times slower (simulated time)")
    parser.add_argument("--message-time", type=float, default=0.25,
                        help="simulated time of sending one copy of the model, in a fast "
                             "agent's steps")
    parser.add_argument("--agents", type=int, default=8, help="without a launcher")
    parser.add_argument("--mesh", action="store_true",
                        help="on a device mesh: one agent per device of every process under "
                             "jaxfog run, --agents spread over this process's devices "
                             "without it")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="compute dtype; the parameters, gradients, optimizer and "
                             "exchanges stay float32")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="one device's dense peak for the MFU (default: PEAK_TFLOPS by "
                             "device kind and --dtype; none on CPUs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="train_lm_results",
                        help="directory for lm_{n}agents.{md,json,png}")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    return parser


def make_agents(args: argparse.Namespace) -> jf.Agents:
    """The agents: on a device mesh (``--mesh``), MPI processes under a launcher
    or ``--agents`` simulated ones."""
    if args.mesh:
        import jaxfog.mesh

        jaxfog.mesh.init_distributed()  # before anything asks JAX for its devices
        per_device = max(1, args.agents // jax.device_count()) if jax.process_count() == 1 else 1
        return jf.Agents(mesh=True, per_device=per_device)
    return jf.Agents(simulated=args.agents)


def train_all(agents: jf.Agents, args: argparse.Namespace, data: Corpus, size: Size,
              model: Any) -> dict[str, list[dict[str, Any]]]:
    """Trains with every method of ``--methods`` in turn: its rows by label."""
    n = agents.size
    on_mesh, on_mpi = agents.mesh is not None, not agents.simulated
    results: dict[str, list[dict[str, Any]]] = {}
    for method in methods(n, args.methods.split(","), args, size.steps):
        if method.asynchronous:
            if on_mesh or on_mpi:
                if agents.is_root:
                    print(f"({method.label}: in simulated time, on simulated agents only)")
                continue
            rows = train_push_sum(method, data, size, model, steps=size.steps, seed=args.seed,
                                  straggler=args.straggler, message_time=args.message_time,
                                  progress=not args.no_progress, dtype=args.dtype)
        else:
            rows = train(agents, method, data, size, model, steps=size.steps, seed=args.seed,
                         straggler=args.straggler, message_time=args.message_time,
                         progress=not args.no_progress, dtype=args.dtype)
        results[method.label] = rows
        if agents.is_root and not args.quiet:
            last = rows[-1]
            print(f"{method.label:<34} validation {last['val_bpb']:.3f} bpb  "
                  f"{last['sent_bytes'] / 1e6:8.2f} MB sent  "
                  f"time {last['simulated_time']:6.0f}  {last['wall_time']:6.1f} s", flush=True)
    return results


def header(report: dict[str, Any], args: argparse.Namespace, argv: list[str] | None,
           data: Corpus, size: Size, n: int, on_mpi: bool, per_device: float | None
           ) -> list[str]:
    """The lines above the result table: the run, data, model and measures."""
    where, version = report["where"], report["python"]
    kind, devices = report["device_kind"], report["devices"]
    seconds, cpu = report["seconds"], report["cpu_seconds"]
    count, flops, peak = report["parameters"], report["flops_per_token"], report["peak_tflops"]
    split = "i.i.d. (files dealt at random)" if args.iid else "heterogeneous (files by path)"
    command = " ".join([*([f"jaxfog run -np {n}"] if on_mpi else []), "python",
                        "examples/train_lm.py", *(sys.argv[1:] if argv is None else argv)])
    return [
        f"# Byte-level transformer on Python {version}'s standard library: {where}", "",
        f"Machine: {report['machine']}; jax {jax.__version__}. `{command}` "
        f"({seconds / 60:.1f} minutes in all, {cpu / 60:.1f} CPU-minutes).", "",
        f"Data: the first {size.data_mb:g} MB of the standard library's .py files "
        f"sorted by path, every {VALIDATION_EVERY}th file held out; each agent trains on "
        f"{data.streams.shape[1] / 1e6:.2f} MB of its own files, {split}. Model: "
        f"{size.depth} blocks of width {size.width}, {size.heads} heads, context "
        f"{size.context}, {count:,} parameters (float32, computed in {args.dtype}); "
        f"{size.steps} steps of "
        f"{size.batch} windows per agent; inner optimizer AdamW (peak {size.lr:g}, "
        f"warmup-cosine, clipped at norm 1); CHOCO's gamma {args.gamma:g}; DiLoCo's "
        f"outer Nesterov step {args.outer_lr:g}, momentum {args.outer_momentum:g}.", "",
        f"Validation: bits per byte of the agents' averaged model on "
        f"{size.eval_windows} windows of {size.context} bytes of the held-out files. "
        f"MB sent: by one agent over the run (modelled"
        + ("; measured: what jaxfog.comm_stats counted on rank 0" if on_mpi else "")
        + f"). Simulated time: agent 0 computes {args.straggler:g}x slower; the unit is "
        f"a fast agent's step; a message takes {args.message_time:g} per copy of the "
        f"model it carries. 'bpb at time {size.steps:g}': when a fast agent has had the "
        f"time for {size.steps} steps (asynchronous push-sum's budget). Wall time: the "
        f"training steps, compilation and validation excluded; tokens/s: all agents' "
        f"training bytes per second of it. Model TFLOP/s: tokens/s x {flops:,.0f} "
        f"FLOPs a token (6 per matmul parameter + 12 x depth x width x context, forward "
        f"and backward); MFU: over "
        + (f"{devices} x {kind}'s dense {args.dtype} peak, {per_device:g} TFLOP/s"
           + ("" if args.peak_tflops else " (NVIDIA's datasheet)")
           if peak else f"no known peak for {kind} (--peak-tflops)") + ".", ""]


def make_report(agents: jf.Agents, args: argparse.Namespace, data: Corpus, size: Size,
                model: Any, results: dict[str, list[dict[str, Any]]], where: str,
                seconds: float, cpu: float) -> tuple[dict[str, Any], float | None]:
    """The run's report (the .json) and the peak TFLOP/s of one device."""
    n, on_mesh, on_mpi = agents.size, agents.mesh is not None, not agents.simulated
    count = sum(v.size for v in jax.tree.leaves(model[1]))
    # The devices the agents run on: simulated agents share one; MPI processes
    # and mesh agents have their own.
    kind = jax.devices()[0].device_kind
    devices = agents.mesh.devices.size if on_mesh else n if on_mpi else 1
    per_device = args.peak_tflops or peak_tflops(kind, args.dtype)
    peak = None if per_device is None else per_device * devices
    report = {
        "where": where, "machine": _machine.cpu(), "python": sys.version.split()[0],
        "jax": jax.__version__, "size": size._asdict(), "parameters": int(count),
        "dtype": args.dtype, "device_kind": kind, "devices": devices,
        "flops_per_token": flops_per_token(size, model[1]), "peak_tflops": peak,
        "unigram_bpb": data.unigram_bpb, "iid": args.iid, "straggler": args.straggler,
        "message_time": args.message_time, "agent_bytes": int(data.streams.shape[1]),
        "agent_files": [[files[0], files[-1], len(files)] for files in data.files],
        "seconds": seconds, "cpu_seconds": cpu, "results": results}
    return report, per_device


def write(report: dict[str, Any], text: str, out: str, n: int, on_mpi: bool) -> None:
    """Writes ``--out``/lm_{n}agents.{md,json,png} (lm_{n}procs on MPI processes)."""
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"lm_{n}{'procs' if on_mpi else 'agents'}")
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    with open(stem + ".json", "w") as f:
        json.dump(report, f)
    plot(report["results"], report["unigram_bpb"], stem + ".png",
         f"Byte-level transformer on the Python {report['python']} standard library, "
         f"{report['where']}")
    print(f"wrote {stem}.md, .json and .png")


def main(argv=None) -> dict[str, Any]:
    args = make_parser().parse_args(argv)
    size = SIZES[args.size]._replace(**{k: getattr(args, k) for k in Size._fields
                                        if getattr(args, k) is not None})
    args.lr = size.lr
    agents = make_agents(args)
    n, on_mpi = agents.size, not agents.simulated
    where = (f"{n} agents on a device mesh" if agents.mesh is not None else
             f"{n} simulated agents" if agents.simulated else f"{n} MPI processes")
    data = corpus(n, size, data_mb=size.data_mb, iid=args.iid, seed=args.seed)
    model = nnx.split(make_model(size, args.seed), nnx.Param)  # graphdef, params
    started, cpu = time.perf_counter(), time.process_time()
    results = train_all(agents, args, data, size, model)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    report, per_device = make_report(agents, args, data, size, model, results, where,
                                     seconds, cpu)
    if agents.is_root:
        lines = header(report, args, argv, data, size, n, on_mpi, per_device)
        text = "\n".join(lines + summary(results, data.unigram_bpb, size.steps,
                                         n * size.batch * size.context,
                                         report["flops_per_token"], report["peak_tflops"]))
        print(text, flush=True)
        write(report, text, args.out, n, on_mpi)
    return report


if __name__ == "__main__":
    main()
