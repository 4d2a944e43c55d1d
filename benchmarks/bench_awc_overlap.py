"""Does XLA overlap AWC's exchange with the backward pass? (issue: optax)

Run with ``jaxfog run -np 2 python benchmarks/bench_awc_overlap.py``.

In ``awc`` (x+ = W x + u) the exchange of x does not depend on the gradient,
so within one jitted train step XLA is free to run it while the backward pass
computes; in ``atc`` (x+ = W (x + u)) it must wait for the gradient. For an
MLP whose exchange and backward pass take similar time it times, as the
median of the slowest rank's blocking time per step:

* ``compute``: the train step without communication (``communication="none"``),
* ``comm``: ``neighbor_allreduce`` of the parameters alone,
* ``atc`` and ``awc``: the full steps,

each with the exchange run inline on XLA's thread (``set_comm_thread_min_bytes(None)``)
and from jaxfog's communication thread (``set_comm_thread_min_bytes(0)``). Overlap is
``(compute + comm - awc) / min(compute, comm)``: 0 for none, 1 for complete.

A second scenario makes rank 1 a straggler: it starts each step ``compute`` ms
late, and rank 0's ``awc`` step is timed. Inline, rank 0 waits and then computes
(about 2 x compute); async, its backward pass fills the wait (about 1 x).

Then it records one async ``awc`` step with ``jax.profiler`` (a Perfetto trace)
on rank 0 and lists the XLA ops in start order: the timeline. Rank 0 writes
the tables under ``benchmarks/results/awc_overlap.{md,json}``.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

import jaxfog as jf

jf.init()
from mpi4py import MPI  # noqa: E402  (after init: jaxfog picks the MPI library)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import jaxfog.optax as jfo  # noqa: E402
import jaxfog.topology as T  # noqa: E402
from _mlp import loss, mlp  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
RESULTS = Path(__file__).resolve().parent / "results"


def timeit(fn, repeats: int, warmup: int = 3) -> float:
    """Median over repeats of the slowest rank's time for one blocking call (ms)."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        COMM.Barrier()
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    slowest = np.empty(repeats)
    COMM.Allreduce(np.array(times), slowest, op=MPI.MAX)
    return float(np.median(slowest) * 1e3)


def late_peer_time(fn, delay: float, repeats: int) -> float:
    """Median of rank 0's time for one call while rank 1 starts ``delay`` s late (ms)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        COMM.Barrier()
        if RANK == 1:
            time.sleep(delay)
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return COMM.bcast(float(np.median(times) * 1e3), root=0)


def steps(params, batch: int, width: int):
    x = jax.random.normal(jax.random.key(RANK + 1), (batch, width), jnp.float32)

    def train(optimizer):
        state = optimizer.init(params)

        @jax.jit
        def step(params, state):
            updates, state = optimizer.update(jax.grad(loss)(params, x), state, params)
            return optax.apply_updates(params, updates), state

        compiled = step.lower(params, state).compile()  # compile before the timing
        return lambda: compiled(params, state)

    inner = optax.sgd(1e-3)
    exchange = jax.jit(jf.neighbor_allreduce)
    return {"compute": train(jfo.awc(inner, communication="none")),
            "comm": lambda: exchange(params),
            "atc": train(jfo.atc(inner)),
            "atc unfused": train(jfo.atc(inner, fused=False)),
            "awc": train(jfo.awc(inner))}


def trace_events(fn) -> list[dict]:
    """Complete events ("X") of one call of ``fn`` from a jax.profiler Perfetto trace."""
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as directory:
        jax.profiler.start_trace(directory, create_perfetto_trace=True)
        jax.block_until_ready(fn())
        jax.profiler.stop_trace()
        files = glob.glob(os.path.join(directory, "**", "*.trace.json.gz"), recursive=True)
        if not files:
            return []
        with gzip.open(files[0]) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def timeline(events: list[dict]) -> list[tuple[str, float, float, object]]:
    """(name, start ms, end ms, thread) of the step's XLA ops (thunks), by start."""
    executor = {e.get("tid") for e in events if e["name"].startswith("ThunkExecutor")}
    ops = [e for e in events if e.get("tid") in executor and e["dur"] >= 50
           and not e["name"].startswith(("$", "ThunkExecutor", "SlinkyThreadPool"))]
    if not ops:
        return []
    t0 = min(e["ts"] for e in ops)
    return sorted(((e["name"], (e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3,
                    e.get("tid")) for e in ops), key=lambda row: row[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batches", default="64,256,1024")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    jf.set_topology(T.exponential(SIZE))
    params = mlp(args.width, args.depth)
    megabytes = sum(p.nbytes for p in params) / 1e6
    rows = []
    for batch in map(int, args.batches.split(",")):
        fns = steps(params, batch, args.width)
        row = {"batch": batch}
        for mode, threshold in (("inline", None), ("async", 0)):
            jf.set_comm_thread_min_bytes(threshold)
            times = {name: timeit(fn, args.repeats) for name, fn in fns.items()}
            if mode == "inline":
                row.update(compute=times["compute"], comm=times["comm"])
            row[f"atc {mode}"], row[f"awc {mode}"] = times["atc"], times["awc"]
            row[f"atc unfused {mode}"] = times["atc unfused"]
            row[f"overlap {mode}"] = ((times["compute"] + times["comm"] - times["awc"])
                                      / min(times["compute"], times["comm"]))
            row[f"late peer {mode}"] = late_peer_time(fns["awc"], row["compute"] / 1e3,
                                                      args.repeats)
        rows.append(row)
    jf.set_comm_thread_min_bytes(0)
    last = steps(params, int(args.batches.split(",")[-1]), args.width)
    events = trace_events(last["awc"])
    unfused_events = trace_events(last["atc unfused"])
    if RANK != 0:
        return
    lines = [f"# AWC: exchange vs backward pass ({SIZE} ranks, MLP {args.depth} x "
             f"{args.width}^2 float32 = {megabytes:.1f} MB exchanged per step)", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
             f"jax {jax.__version__}. Median of the slowest rank's time per step (ms); "
             "inline: the exchange runs on XLA's thread, async: on jaxfog's "
             "communication thread.", "",
             "| batch | compute | comm | atc inline | atc async | atc unfused inline "
             "| atc unfused async | awc inline | awc async | overlap inline | overlap async |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['compute']:.2f} | {r['comm']:.2f} "
                     f"| {r['atc inline']:.2f} | {r['atc async']:.2f} "
                     f"| {r['atc unfused inline']:.2f} | {r['atc unfused async']:.2f} "
                     f"| {r['awc inline']:.2f} | {r['awc async']:.2f} "
                     f"| {r['overlap inline']:.2f} | {r['overlap async']:.2f} |")
    lines += ["", "Rank 1 a straggler, starting each step `compute` ms late: rank 0's awc "
              "step (ms) and its ratio to `compute`.", "",
              "| batch | compute | awc inline | ratio | awc async | ratio |",
              "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['compute']:.2f} | {r['late peer inline']:.2f} "
                     f"| {r['late peer inline'] / r['compute']:.2f} "
                     f"| {r['late peer async']:.2f} "
                     f"| {r['late peer async'] / r['compute']:.2f} |")
    ops = timeline(events)
    lines += ["", f"Timeline of one async awc step (batch {rows[-1]['batch']}, rank 0, "
              "jax.profiler), XLA ops of 50 us or more in start order (the custom call "
              "returns at once; its messages move on the communication thread):", "",
              "| op | start (ms) | end (ms) | thread |", "|---|---:|---:|---|"]
    lines += [f"| {name} | {start:.3f} | {end:.3f} | {tid} |" for name, start, end, tid in ops]
    if not ops:
        lines.append("| (the profiler recorded no XLA op events) | | | |")
    ops = timeline(unfused_events)
    lines += ["", "The same for one async atc(fused=False) step: one exchange per layer, "
              "the last layer's first, each started as the backward pass reaches it:", "",
              "| op | start (ms) | end (ms) | thread |", "|---|---:|---:|---|"]
    lines += [f"| {name} | {start:.3f} | {end:.3f} | {tid} |" for name, start, end, tid in ops]
    if not ops:
        lines.append("| (the profiler recorded no XLA op events) | | | |")
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "awc_overlap.md").write_text(text + "\n")
    (RESULTS / "awc_overlap.json").write_text(json.dumps(
        {"ranks": SIZE, "megabytes": megabytes, "rows": rows, "timeline": ops}, indent=1))


if __name__ == "__main__":
    main()
