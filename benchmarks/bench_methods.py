"""Which method when the agents' data differ: every jaxfog.optax method, with
SGD-momentum and with Adam, on digits split by label and split i.i.d.

    nice -n 10 python benchmarks/bench_methods.py          # ~5 CPU-minutes, 44 runs
    python benchmarks/bench_methods.py --quick             # a smoke run, nothing written

The digits MLP of ``examples/train_digits.py`` (two hidden layers of 128) on
8 simulated agents, every agent starting from the same model, minibatches of
32 drawn from its own shard, 2,000 steps (the configuration of issue 34's
report). Two splits of scikit-learn's digits training set (1,347 images,
168 per agent):

* ``label``: sorted by label and dealt in contiguous blocks, so that every
  agent sees one or two digits (strongly heterogeneous: each agent's optimum
  is "always answer my digits");
* ``iid``: a random permutation dealt the same way.

Two inner optimizers, constant step sizes as a newcomer writes them:
``optax.sgd(0.05, momentum=0.9)`` and ``optax.adam(1e-3)``. The methods:
``gradient_allreduce`` (the baseline), ``atc`` and ``awc`` on the static
exponential graph (3 in-neighbours, the runtime's default), ``atc`` on the
one-peer exponential schedule (the guide's snippet), ``push_sum`` on the
exponential graph, ``gradient_tracking`` with the inner optimizer fed the
tracked gradient (and with a plain step size), ``exact_diffusion`` (a step
size only; on ``symmetric_exponential(8)``, since its analysis needs a
symmetric W), ``diloco`` (H = 10 and 50, allreduce rounds, the paper's outer
Nesterov step) and ``noloco`` (H = 10, one random peer per round).

Reported: the test accuracy (450 images: 0.22% is one image) of the agents'
averaged model after the last step, the mean over the last 5 evaluations
(steps 1,600-2,000, every 100 steps: less noisy than the last one), and the
consensus distance ``sqrt(mean_i ||x_i - x_mean||^2 / ||x_mean||^2)`` at the
end. One seed.

Writes ``benchmarks/results/methods_8agents.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

from _examples import example  # beside this script
from jaxfog import _machine

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
N = 8
INNERS = ("sgdm", "adam")
INNER_LABELS = {"sgdm": "sgd(0.05, momentum=0.9)", "adam": "adam(1e-3)", "sgd": "step size 0.05"}


class Run(NamedTuple):
    label: str          # the method, one row of the table
    inner: str          # "sgdm", "adam" or "sgd" (a plain step size): the column
    make: Callable[[Any], Any]   # inner optimizer -> the jaxfog.optax transformation


def inner_optimizer(kind: str):
    import optax

    return {"sgdm": lambda: optax.sgd(0.05, momentum=0.9),
            "adam": lambda: optax.adam(1e-3),
            "sgd": lambda: 0.05}[kind]()


def runs(n: int) -> list[Run]:
    import jaxfog.optax as jfo
    import jaxfog.topology as T

    expo, one_peer = T.exponential(n), T.one_peer_exponential(n)
    both = []
    for kind in INNERS:
        both += [
            Run("gradient_allreduce (baseline)", kind, jfo.gradient_allreduce),
            Run("atc, exponential", kind, lambda o: jfo.atc(o, topology=expo)),
            Run("atc, one-peer exponential", kind, lambda o: jfo.atc(o, topology=one_peer)),
            Run("awc, exponential", kind, lambda o: jfo.awc(o, topology=expo)),
            Run("push_sum, exponential", kind, lambda o: jfo.push_sum(o, topology=expo)),
            Run("gradient_tracking(inner), exponential", kind,
                lambda o: jfo.gradient_tracking(o, topology=expo)),
            Run("gradient_tracking(inner), one-peer exponential", kind,
                lambda o: jfo.gradient_tracking(o, topology=one_peer)),
            Run("diloco H=10", kind, lambda o: jfo.diloco(o, every=10)),
            Run("diloco H=50", kind, lambda o: jfo.diloco(o, every=50)),
            Run("noloco H=10", kind, lambda o: jfo.noloco(o, every=10)),
        ]
    sym = T.symmetric_exponential(n)
    both += [
        Run("gradient_tracking(lr), exponential", "sgd",
            lambda lr: jfo.gradient_tracking(lr, topology=expo)),
        Run("exact_diffusion(lr), symmetric exponential", "sgd",
            lambda lr: jfo.exact_diffusion(lr, topology=sym)),
    ]
    return both


def shards(n: int, split: str):
    """Per-agent (images, labels) of equal length, and the test set."""
    import numpy as np
    load = example("train_digits").load

    if split == "label":
        return load(n)
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    images = (images / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(  # the split of load()
        images, labels, test_size=0.25, stratify=labels, random_state=0)
    blocks = np.array_split(np.random.default_rng(0).permutation(len(y_train)), n)
    length = min(len(block) for block in blocks)
    return ([(x_train[b[:length]], y_train[b[:length]].astype(np.int32)) for b in blocks],
            (x_test, y_test.astype(np.int32)))


def train(optimizer, data, *, steps: int, every: int, batch: int, seed: int = 0):
    """Trains on N simulated agents; every `every` steps the averaged model's
    test accuracy, the consensus distance and the mean training loss."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxfog as jf
    MLP = example("train_digits").MLP

    parts, (x_test, y_test) = data
    xs = jnp.stack([jnp.asarray(x) for x, _ in parts])
    ys = jnp.stack([jnp.asarray(y) for _, y in parts])
    length = xs.shape[1]
    model = MLP()

    def loss_fn(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

    def init(x):
        params = model.init(jax.random.key(seed), x[:1])  # the same on every agent
        return params, optimizer.init(params)

    def chunk(params, state, x, y, start):
        def step(carry, k):
            params, state = carry
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed + 1), jf.rank()), k)
            take = jax.random.choice(key, length, (batch,), replace=False)
            loss, grads = jax.value_and_grad(loss_fn)(params, x[take], y[take])
            updates, state = optimizer.update(grads, state, params)
            return (optax.apply_updates(params, updates), state), loss

        (params, state), losses = jax.lax.scan(step, (params, state), start + jnp.arange(every))
        return params, state, losses.mean()

    params, state = jax.jit(jf.simulate(init, N))(xs)
    run = jax.jit(jf.simulate(chunk, N, in_axes=(0, 0, 0, 0, None)))

    @jax.jit
    def evaluate(params):
        mean = jax.tree.map(lambda v: v.mean(0), params)
        acc = jnp.mean(jnp.argmax(model.apply(mean, x_test), -1) == y_test)
        flat = jnp.concatenate([v.reshape(N, -1) for v in jax.tree.leaves(params)], 1)
        centre = flat.mean(0)
        spread = jnp.sqrt(jnp.mean(jnp.sum((flat - centre) ** 2, 1)) / jnp.sum(centre ** 2))
        return acc, spread

    rows = []
    for start in range(0, steps, every):
        params, state, losses = run(params, state, xs, ys, start)
        acc, spread = evaluate(params)
        if not np.isfinite(float(spread)):
            acc, spread = jnp.nan, jnp.nan
        rows.append({"step": start + every, "test_accuracy": 100 * float(acc),
                     "consensus_distance": float(spread), "loss": float(losses.mean())})
    return rows


def summary(rows):
    import numpy as np

    last = rows[-1]
    tail = [r["test_accuracy"] for r in rows[-5:]]
    return {"final": last["test_accuracy"], "last5": float(np.mean(tail)),
            "distance": last["consensus_distance"], "loss": last["loss"]}


def cell(result) -> str:
    if result is None:
        return ""
    if result["final"] != result["final"]:  # NaN: diverged
        return "diverged"
    return f"{result['final']:.1f}% ({result['last5']:.1f}) d={result['distance']:.2g}"


def table(results: dict, where: str) -> list[str]:
    labels = list(dict.fromkeys(r.label for r in runs(N)))
    lines = [f"# Which method when the agents' data differ: {where}", "",
             f"Machine: {_machine.cpu()}. `nice -n 10 python benchmarks/bench_methods.py` "
             "(the defaults). One seed; the test set has 450 images, so 0.22% is one image.", "",
             "Each cell: test accuracy of the averaged model after the last step (in brackets "
             "the mean of the last 5 evaluations, steps 1,600-2,000), and d, the consensus "
             "distance sqrt(mean_i ||x_i - x_mean||^2 / ||x_mean||^2) at the end. Columns: "
             "the inner optimizer, `sgd(0.05, momentum=0.9)` or `adam(1e-3)` (for the two "
             "methods that take a step size: 0.05, in the SGD-momentum column).", "",
             "| method | label split, SGD-momentum | label split, Adam "
             "| i.i.d. split, SGD-momentum | i.i.d. split, Adam |",
             "|---|---:|---:|---:|---:|"]
    for label in labels:
        cells = []
        for split in ("label", "iid"):
            for kind in INNERS:
                got = results[split].get(f"{label} | {kind}")
                if got is None and kind == "sgdm":
                    got = results[split].get(f"{label} | sgd")
                cells.append(cell(None if got is None else summary(got)))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def plot(results: dict, path: Path, where: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9), sharex=True, sharey=True)
    for row, split in enumerate(("label", "iid")):
        for col, kind in enumerate(INNERS):
            axis = axes[row, col]
            for key, rows in results[split].items():
                label, inner = key.split(" | ")
                if inner != kind and not (inner == "sgd" and kind == "sgdm"):
                    continue
                style = "--" if inner == "sgd" else "-"
                width = 2.5 if "allreduce" in label or "gradient_tracking(inner), exp" in label \
                    else 1.2
                axis.plot([r["step"] for r in rows], [r["test_accuracy"] for r in rows],
                          style, lw=width, label=label + (" (step size)" if inner == "sgd"
                                                          else ""))
            axis.set_title(f"{'label' if split == 'label' else 'i.i.d.'} split, "
                           f"{INNER_LABELS[kind]}")
            axis.set_ylim(40, 100)
            axis.grid(True, alpha=0.3)
            if row == 1:
                axis.set_xlabel("step")
            if col == 0:
                axis.set_ylabel("test accuracy of the averaged model (%)")
    axes[0, 0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Digits MLP, {where}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100, help="steps between evaluations")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--only", default="", help="run only the methods whose label "
                        "contains this (nothing written)")
    parser.add_argument("--quick", action="store_true", help="200 steps, nothing written")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.every = 200, 100
    where = f"{N} simulated agents, {args.steps} steps of minibatch {args.batch}"
    data = {split: shards(N, split) for split in ("label", "iid")}
    results: dict[str, dict[str, Any]] = {"label": {}, "iid": {}}
    seconds = {}
    # Interleaved: for each method, both splits one after the other, so that
    # the machine's load is shared alike.
    for run in runs(N):
        if args.only and args.only not in run.label:
            continue
        for split in ("label", "iid"):
            start = time.perf_counter()
            rows = train(run.make(inner_optimizer(run.inner)), data[split], steps=args.steps,
                         every=args.every, batch=args.batch)
            key = f"{run.label} | {run.inner}"
            results[split][key] = rows
            seconds[f"{split} | {key}"] = time.perf_counter() - start
            print(f"{split:<5} {key:<58} {cell(summary(rows)):<28} "
                  f"{seconds[f'{split} | {key}']:.0f} s", flush=True)
    if args.quick or args.only:
        return
    lines = table(results, where)
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"methods_{N}agents"
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(
        {"where": where, "machine": _machine.cpu(), "inners": INNER_LABELS,
         "results": results, "seconds": seconds}))
    plot(results, stem.with_suffix(".png"), where)
    print("\n".join(lines))
    print(f"wrote {stem}.md, .json and .png")


if __name__ == "__main__":
    main()
