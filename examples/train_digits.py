"""Decentralized training of a Flax MLP on scikit-learn's digits, split by label.

    jaxfog run -np 4 python examples/train_digits.py    # 4 MPI processes
    python examples/train_digits.py                      # 4 simulated agents
    jaxfog run -np 4 python examples/train_digits.py --mesh  # a 4-device JAX mesh
    python examples/train_digits.py --mesh               # 4 agents on this process's devices

Each of the 4 agents holds a different slice of the training set: the rows
sorted by label and dealt in contiguous blocks, so agent 0 sees mostly 0s, 1s
and 2s, agent 3 mostly 7s, 8s and 9s (heterogeneous data). Every agent starts
from the same initial model and trains on minibatches of its own slice with
SGD and momentum, combined with its neighbours by one of

* ``gradient_allreduce``: the global average of the gradients (the baseline),
* ``atc``: adapt then combine, x+ = W (x + u),
* ``awc``: adapt with combine, x+ = W x + u,

on the static exponential graph or the one-peer exponential schedule, and,
with ``--compress top_k:0.01,sign,qsgd:7,low_rank:4``, CHOCO-SGD with those
compressors (``--gamma``, ``--groups``; ``benchmarks/bench_compress.py`` runs
the comparison with minibatches of 8, which CHOCO's slower consensus needs). It
prints a progress bar and a per-epoch table, then a summary, and plots loss
against step and against wall time, and test accuracy against step (the
averaged model, and the band of the agents' own models), to
``--out``/train_digits.png. The table's
columns: the training loss (each agent's minibatch loss at its own model,
averaged over the agents and the epoch's steps), the test accuracy of the
averaged model (mean of the agents' parameters) and the range of the agents'
own test accuracies, the spread (||x_i - x_mean|| / ||x_mean||, root mean
square over agents), the bytes each agent sends per step, and the wall time
of training (compilation excluded). The SGD step size follows a cosine decay
to 0, which also removes the bias of diffusion (atc, awc) with respect to the
global minimiser.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import rich.console
import rich.progress

import jaxfog as jf
import jaxfog.compress as C
import jaxfog.optax as jfo
import jaxfog.topology as T

CLASSES = 10


class MLP(nn.Module):
    hidden: int = 128

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.hidden)(x))
        x = nn.relu(nn.Dense(self.hidden)(x))
        return nn.Dense(CLASSES)(x)


def load(n: int, test_size: float = 0.25):
    """Per-agent training slices (sorted by label, equal length) and the test set."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    images = (images / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=test_size, stratify=labels, random_state=0)
    order = np.argsort(y_train, kind="stable")
    blocks = np.array_split(order, n)
    length = min(len(block) for block in blocks)
    shards = [(x_train[block[:length]], y_train[block[:length]].astype(np.int32))
              for block in blocks]
    return shards, (x_test, y_test.astype(np.int32))


class Method(NamedTuple):
    label: str
    optimizer: optax.GradientTransformation
    #: bytes one agent sends per step, from one agent's parameters
    bytes_per_step: Callable[[Any], float]


def compressor(spec: str) -> C.Compressor:
    """``top_k:0.01``, ``rand_k:0.01``, ``sign``, ``qsgd:7`` (4 bits, buckets of 128)
    or ``low_rank:4``."""
    name, _, arg = spec.partition(":")
    makers = {"top_k": lambda: C.top_k(float(arg)), "rand_k": lambda: C.rand_k(float(arg)),
              "sign": C.sign, "qsgd": lambda: C.qsgd(int(arg), unbiased=False, bucket=128),
              "low_rank": lambda: C.low_rank(int(arg), vectors=C.identity()),
              "identity": C.identity}
    if name not in makers:
        raise SystemExit(f"--compress: unknown compressor {spec!r} (one of {sorted(makers)})")
    return makers[name]()


def methods(n: int, names: list[str], graphs: list[str], lr: float, momentum: float,
            total_steps: int, compress: list[str] = (), gamma: float = 0.5,
            groups: int | None = None):
    """The runs to compare, with the bytes each agent sends per step."""
    def inner():  # the step size decays to 0, which also removes diffusion's bias
        return optax.sgd(optax.cosine_decay_schedule(lr, total_steps), momentum=momentum)

    def out_degree(topology) -> float:  # averaged over agents and schedule entries
        entries = list(topology) if isinstance(topology, T.Schedule) else [topology]
        return float(np.mean([len(t.out_neighbors(r)) for t in entries for r in range(n)]))

    def union_out_degree(topology) -> float:  # CHOCO sends to every neighbour of the period
        entries = list(topology) if isinstance(topology, T.Schedule) else [topology]
        edges = np.any([t.weights != 0 for t in entries], axis=0) & ~np.eye(n, dtype=bool)
        return float(edges.sum(0).mean())

    def dense(factor):
        return lambda params: factor * sum(v.nbytes for v in jax.tree.leaves(params))

    topologies = {"exponential": T.exponential(n), "one-peer": T.one_peer_exponential(n)}
    runs = []
    if "allreduce" in names:  # ring allreduce sends 2 (n - 1) / n of the message
        runs.append(Method("allreduce", jfo.gradient_allreduce(inner()), dense(2 * (n - 1) / n)))
    for graph in graphs:
        topology = topologies[graph]
        for name in ("atc", "awc"):
            if name in names:
                make = jfo.atc if name == "atc" else jfo.awc
                runs.append(Method(f"{name} {graph}", make(inner(), topology=topology),
                                   dense(out_degree(topology))))
        for spec in compress:  # CHOCO-SGD
            c = compressor(spec)
            y = groups if c.mergeable else None  # low-rank compresses leaf by leaf

            def sent(params, c=c, y=y, d=union_out_degree(topology)):
                return d * C.tree_bytes(c, params, None if y is None else C.balanced(params, y))

            runs.append(Method(
                f"choco {c.name} {graph}",
                jfo.choco(inner(), compressor=c, gamma=gamma, topology=topology, groups=y),
                sent))
    return runs


class Traffic:
    """What this rank sent over a whole run, evaluations excluded.

    ``jf.comm_stats()`` (and ``wire_bytes()``, an interface's counter, if
    given) is read, and reset, around every window of steps and every
    evaluation; all of it is summed, so that an exchange which a nonblocking
    method's communication thread runs between two windows (during an
    evaluation) is still counted, and the evaluations' traffic, measured once
    on an evaluation before any step (:meth:`calibrate`), is subtracted per
    evaluation. A window's own reading (:meth:`read`'s return) misses such an
    exchange or counts it in the next window. Nothing on simulated agents."""

    def __init__(self, agents: jf.Agents, wire_bytes: Callable[[], int] | None = None):
        self.on = not agents.simulated
        self.wire_bytes = wire_bytes
        self.last_wire = wire_bytes() if wire_bytes else 0
        self.comm = self.wire = 0
        self.evaluations = 0
        self.per_evaluation = (0, 0)
        if self.on:
            jf.comm_stats(reset=True)

    def read(self) -> tuple[int, int | None]:
        """Bytes sent since the last reading (comm_stats, interface), added to the run's."""
        if not self.on:
            return 0, None
        comm = sum(s.bytes for s in jf.comm_stats(reset=True).values())
        wire = None
        if self.wire_bytes:
            now = self.wire_bytes()
            wire, self.last_wire = now - self.last_wire, now
        self.comm += comm
        self.wire += wire or 0
        return comm, wire

    def calibrate(self, evaluate: Callable[[], Any]) -> Any:
        """Runs ``evaluate`` (no step before it) and takes its traffic as an evaluation's."""
        self.read()
        self.comm = self.wire = 0
        value = evaluate()
        comm, wire = self.read()
        self.comm = self.wire = 0
        self.per_evaluation = (comm, wire or 0)
        return value

    def evaluated(self) -> None:
        """One more evaluation (after calibrate's) since the run began."""
        self.evaluations += 1

    def totals(self) -> dict[str, float]:
        """The run's bytes so far, evaluations excluded: keys ``run_measured_bytes``
        (comm_stats) and ``run_interface_bytes`` (with ``wire_bytes``)."""
        if not self.on:
            return {}
        self.read()
        comm = self.comm - self.evaluations * self.per_evaluation[0]
        out = {"run_measured_bytes": float(comm)}
        if self.wire_bytes:
            out["run_interface_bytes"] = float(self.wire - self.evaluations
                                               * self.per_evaluation[1])
        return out


class Progress:
    """A progress bar on stderr, drawn by rich when ``enabled`` (callers enable it
    on one rank) and stderr is a terminal. ``bar(done, note)`` shows ``done`` of
    ``total`` steps; drawing stops, leaving the bar on screen, once ``done``
    reaches ``total`` or at ``close()`` (which leaving a ``with`` block calls).
    Stdout is left alone: the tables printed there are the output."""

    def __init__(self, label: str, total: int, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self.label, self.total = label, total
        self.bar = None  # rich's display, once the first call has started it

    def __call__(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        if self.bar is None:
            self.bar = rich.progress.Progress(
                rich.progress.TextColumn("{task.description:<22}", markup=False),
                rich.progress.BarColumn(bar_width=30), rich.progress.MofNCompleteColumn(),
                rich.progress.TimeElapsedColumn(),
                rich.progress.TextColumn("{task.fields[note]}", markup=False),
                console=rich.console.Console(stderr=True), redirect_stdout=False)
            self.task = self.bar.add_task(self.label, total=self.total, note=note)
            self.bar.start()
        self.bar.update(self.task, completed=done, note=note)
        if done >= self.total:
            self.close()

    def close(self) -> None:
        """Stops drawing (restoring the cursor); later calls draw nothing."""
        if self.bar is not None:
            self.bar.stop()
        self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def in_flight(opt_state: Any) -> bool:
    """Whether an optimizer state holds exchanges in flight (:class:`jaxfog.Handle`
    s: atc/awc with ``delay=``, streaming_diloco), which ``optimizer.finish``
    waits for and merges when training ends."""
    is_handle = lambda leaf: isinstance(leaf, jf.Handle)  # noqa: E731
    return any(map(is_handle, jax.tree.leaves(opt_state, is_leaf=is_handle)))


def train(agents: jf.Agents, method: Method, shards, test, *, epochs: int, batch: int,
          seed: int, progress: bool, hidden: int = 128, target: float | None = None,
          wire_bytes: Callable[[], int] | None = None) -> list[dict[str, Any]]:
    """Trains one run; returns one row of metrics per epoch. It stops after the
    first epoch whose averaged model reaches ``target`` test accuracy (percent),
    if given; ``wire_bytes()`` (bytes this agent's interface has sent so far)
    adds what crossed the interface during the steps, evaluation excluded. On
    MPI each row also has the run's bytes so far (:class:`Traffic`)."""
    model = MLP(hidden)
    x_test, y_test = jnp.asarray(test[0]), jnp.asarray(test[1])
    xs, ys = agents.data(lambda r: shards[r])
    length = shards[0][0].shape[0]
    steps = length // batch
    optimizer = method.optimizer

    def init(xs):
        params = model.init(jax.random.key(seed), xs[:1])  # the same on every agent
        return params, optimizer.init(params)

    def loss_fn(params, x, y):
        logits = model.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(params, opt_state, xs, ys, epoch, i):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed + 1), jf.rank()), epoch)
        take = jax.lax.dynamic_slice(jax.random.permutation(key, length), [i * batch], [batch])
        loss, grads = jax.value_and_grad(loss_fn)(params, xs[take], ys[take])
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def finish(params, opt_state):  # exchanges still in flight (delay=, streaming_diloco)
        updates, opt_state = optimizer.finish(opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def evaluate(params):
        def accuracy(p):
            return jnp.mean(jnp.argmax(model.apply(p, x_test), -1) == y_test)

        mean = jf.allreduce(params)
        flat = jnp.concatenate([v.ravel() for v in jax.tree.leaves(params)])
        flat_mean = jnp.concatenate([v.ravel() for v in jax.tree.leaves(mean)])
        distance = jnp.sum((flat - flat_mean) ** 2)
        return accuracy(mean), accuracy(params), distance, jnp.sum(flat_mean ** 2)

    params, opt_state = agents.map(init)(xs)
    # Compiled ahead, so that the wall times are training, not compilation.
    step = agents.map(step, in_axes=(0, 0, 0, 0, None, None)).lower(
        params, opt_state, xs, ys, 0, 0).compile()
    # The exchanges a method keeps in flight are merged after the last step.
    finish = (agents.map(finish).lower(params, opt_state).compile()
              if hasattr(optimizer, "finish") and in_flight(opt_state) else None)
    evaluate = agents.map(evaluate)
    one = jax.tree.map(lambda v: np.zeros(v.shape[1:], v.dtype), params) if (
        agents.simulated) else params  # the shapes of one agent's parameters
    sent = method.bytes_per_step(one)

    def assess(params, losses):  # the evaluation's collectives, the same every time
        averaged, own, distance, norm = evaluate(params)
        own = agents.gather(own)
        step_losses = agents.mean(losses)
        return {"loss": float(np.mean(step_losses)), "step_losses": step_losses.tolist(),
                "test_accuracy": 100 * float(agents.mean(averaged)),
                "agent_accuracy": [100 * float(np.min(own)), 100 * float(np.max(own))],
                "spread": float(np.sqrt(agents.mean(distance) / agents.mean(norm)))}

    traffic = Traffic(agents, wire_bytes)
    if traffic.on:
        traffic.calibrate(lambda: assess(params, jnp.zeros(steps, jnp.float32)))
    rows, elapsed = [], 0.0
    with Progress(method.label, epochs * steps, progress and agents.is_root) as bar:
        for epoch in range(epochs):
            start = time.perf_counter()
            losses = []
            traffic.read()  # what ran between the windows counts for the run only
            for i in range(steps):
                params, opt_state, loss = step(params, opt_state, xs, ys, epoch, i)
                losses.append(loss)
                bar(epoch * steps + i + 1, f"epoch {epoch + 1}")
            if epoch == epochs - 1 and finish is not None:
                params, opt_state = finish(params, opt_state)
            losses = jax.block_until_ready(jnp.stack(losses, -1))
            elapsed += time.perf_counter() - start
            # What this rank put on the wire during the window, per step.
            measured, on_wire = traffic.read()
            run = traffic.totals()
            metrics = assess(params, losses)
            traffic.evaluated()
            rows.append({
                "epoch": epoch + 1, "steps": (epoch + 1) * steps, **metrics,
                "bytes_per_step": sent, "wall_time": elapsed,
                **({} if agents.simulated else {"measured_bytes_per_step": measured / steps}),
                **({} if on_wire is None else {"interface_bytes_per_step": on_wire / steps}),
                **run})
            if target is not None and rows[-1]["test_accuracy"] >= target:
                if finish is not None and epoch < epochs - 1:
                    finish(params, opt_state)  # stopped early: nothing left in flight
                break  # the same on every agent: the averaged model's accuracy
    return rows


def table(label: str, rows: list[dict[str, Any]]) -> str:
    lines = [f"### {label}", "",
             "| epoch | loss | test acc (averaged model) | agents' acc | spread "
             "| KB sent / step / agent | wall time |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        low, high = row["agent_accuracy"]
        lines.append(f"| {row['epoch']} | {row['loss']:.4f} | {row['test_accuracy']:.2f}% "
                     f"| {low:.1f}-{high:.1f}% | {row['spread']:.3f} "
                     f"| {row['bytes_per_step'] / 1e3:.1f} | {row['wall_time']:.2f} s |")
    return "\n".join(lines)


def summary(results: dict[str, list[dict[str, Any]]], where: str) -> str:
    base = results.get("allreduce", [{}])[-1].get("test_accuracy")
    lines = [f"### Summary ({where})", "",
             "| method | final loss | test acc | vs allreduce | KB sent / step / agent "
             "| wall time |", "|---|---:|---:|---:|---:|---:|"]
    for label, rows in results.items():
        last = rows[-1]
        gap = "" if base is None else f"{last['test_accuracy'] - base:+.2f}"
        lines.append(f"| {label} | {last['loss']:.4f} | {last['test_accuracy']:.2f}% | {gap} "
                     f"| {last['bytes_per_step'] / 1e3:.1f} | {last['wall_time']:.2f} s |")
    return "\n".join(lines)


def plot(results: dict[str, list[dict[str, Any]]], path: str, where: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time, accuracy) = plt.subplots(1, 3, figsize=(16, 4))
    for label, rows in results.items():
        losses = np.concatenate([row["step_losses"] for row in rows])
        steps = np.arange(1, len(losses) + 1)
        per_epoch = len(rows[0]["step_losses"])
        # Steps within an epoch are timed together; spread the epoch's time evenly.
        times = np.interp(steps, [0] + [r["steps"] for r in rows],
                          [0.0] + [r["wall_time"] for r in rows])
        smooth = np.convolve(losses, np.ones(per_epoch) / per_epoch, mode="valid")
        line, = by_step.plot(steps[per_epoch - 1:], smooth, label=label)
        by_time.plot(times[per_epoch - 1:], smooth, label=label)
        # The averaged model's accuracy, and the band of the agents' own models.
        at = [r["steps"] for r in rows]
        accuracy.plot(at, [r["test_accuracy"] for r in rows], color=line.get_color(),
                      label=label)
        accuracy.fill_between(at, *zip(*(r["agent_accuracy"] for r in rows)),
                              color=line.get_color(), alpha=0.15, linewidth=0)
    for axis, xlabel in ((by_step, "step"), (by_time, "wall time (s)")):
        axis.set_xlabel(xlabel)
        axis.set_ylabel("training loss (1-epoch moving average)")
        axis.set_yscale("log")
        axis.grid(True, alpha=0.3)
    accuracy.set_xlabel("step")
    accuracy.set_ylabel("test accuracy (%)")
    accuracy.set_title("line: averaged model; band: the agents' own models", fontsize="medium")
    accuracy.set_ylim(80, 100)
    accuracy.grid(True, alpha=0.3)
    by_step.legend()
    fig.suptitle(f"Flax MLP on digits split by label, {where}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict[str, list[dict[str, Any]]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--methods", default="allreduce,atc,awc")
    parser.add_argument("--graphs", default="exponential,one-peer")
    parser.add_argument("--compress", default="",
                        help="CHOCO-SGD runs with these compressors, comma separated: "
                             "top_k:0.01, rand_k:0.01, sign, qsgd:7, low_rank:4")
    parser.add_argument("--gamma", type=float, default=0.5, help="CHOCO's consensus step")
    parser.add_argument("--groups", type=int, default=None,
                        help="merge the leaves into this many groups before compressing "
                             "(MergeComp); default one group per leaf")
    parser.add_argument("--agents", type=int, default=4, help="without a launcher")
    parser.add_argument("--mesh", action="store_true",
                        help="on a device mesh (simulate(mesh=...)): one agent per device of "
                             "every process under jaxfog run (jax.distributed), --agents "
                             "spread over this process's devices without it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="train_digits_results",
                        help="directory for train_digits.{png,md,json}")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--quiet", action="store_true", help="print only the summary")
    args = parser.parse_args(argv)

    if args.mesh:
        import jaxfog.mesh

        jaxfog.mesh.init_distributed()  # before anything asks JAX for its devices
        # One process (no launcher): the --agents agents spread over its devices,
        # several per device (one GPU holds all 4); under jaxfog run, one per device.
        per_device = max(1, args.agents // jax.device_count()) if jax.process_count() == 1 else 1
        agents = jf.Agents(mesh=True, per_device=per_device)
    else:
        agents = jf.Agents(simulated=args.agents)
    n = agents.size
    where = (f"{n} agents on a device mesh" if agents.mesh is not None else
             f"{n} simulated agents" if agents.simulated else f"{n} MPI processes")
    shards, test = load(n)
    results = {}
    total_steps = args.epochs * (len(shards[0][1]) // args.batch)
    compress = [spec for spec in args.compress.split(",") if spec]
    for method in methods(n, args.methods.split(","), args.graphs.split(","), args.lr,
                          args.momentum, total_steps, compress, args.gamma, args.groups):
        rows = train(agents, method, shards, test, epochs=args.epochs, batch=args.batch,
                     seed=args.seed, progress=not args.no_progress)
        results[method.label] = rows
        if agents.is_root and not args.quiet:
            print(table(f"{method.label} ({where})", rows), "\n", flush=True)
    if agents.is_root:
        print(summary(results, where), flush=True)
        os.makedirs(args.out, exist_ok=True)
        base = os.path.join(args.out, "train_digits")
        plot(results, base + ".png", where)
        with open(base + ".md", "w") as f:
            f.write("\n\n".join([summary(results, where)] +
                                [table(label, rows) for label, rows in results.items()]) + "\n")
        with open(base + ".json", "w") as f:
            json.dump({"where": where, "results": results}, f)
        print(f"wrote {base}.png, .md and .json")
    return results


if __name__ == "__main__":
    main()
