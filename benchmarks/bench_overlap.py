"""How much of an exchange hides behind the backward pass? (issue 37.4)

Run with ``jaxfog run -np 2 python benchmarks/bench_overlap.py``.

Rank 0 computes the gradient of an MLP (the backward pass) and exchanges its
parameters with rank 1 (``neighbor_allreduce``, the exchange of awc); rank 1
is a *peer* that only communicates (``--both``: it computes too). Timed on
rank 0, interleaved, as the median over repeats of one blocking step (ms):

* ``compute``: the gradient alone; ``comm``: the exchange alone;
* ``sequential``: the exchange, waited for, then the gradient (no overlap);
* ``in one step``: one jitted step holding both, independent (XLA runs
  jaxfog's asynchronous custom call beside the backward pass);
* ``start/wait``: ``neighbor_allreduce_nonblocking`` in one compiled call,
  the gradient in a second, ``wait`` in a third (BlueFog's Listing 5
  across calls).

``hidden`` is the part of the exchange that no longer adds to the step,
``(sequential - t) / comm``: 0 for none, 1 for all of it. XLA computes on one
thread (``--xla_cpu_multi_thread_eigen=false``) so that the communication
thread has a core: on a 2-core machine rank 0's compute, its communication
thread and the peer's share the 2 cores. Rank 0 writes
``benchmarks/results/overlap_<label>.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_multi_thread_eigen=false"
                           + " intra_op_parallelism_threads=1")

import numpy as np  # noqa: E402

import jaxfog as jf  # noqa: E402

jf.init()
from mpi4py import MPI  # noqa: E402  (after init: jaxfog picks the MPI library)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxfog.topology as T  # noqa: E402
from _mlp import loss, mlp  # noqa: E402
from jaxfog._machine import cpu  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
RESULTS = Path(__file__).resolve().parent / "results"


def variants(params, batch: int, width: int, computes: bool) -> dict:
    """Each variant as a function that runs one step and blocks."""
    x = jax.random.normal(jax.random.key(RANK + 1), (batch, width), jnp.float32)
    grad = jax.jit(jax.grad(loss)) if computes else None
    exchange = jax.jit(jf.neighbor_allreduce)
    start = jax.jit(jf.neighbor_allreduce_nonblocking)
    finish = jax.jit(jf.wait)

    @jax.jit
    def one_step(params):  # both in one computation, independent of each other
        return jf.neighbor_allreduce(params), jax.grad(loss)(params, x)

    def compute():
        return grad(params, x) if computes else None

    def sequential():
        jax.block_until_ready(exchange(params))
        return compute()

    def start_wait():
        handle = start(params)
        jax.block_until_ready(compute())
        return finish(handle)

    fns = {"compute": compute, "comm": lambda: exchange(params), "sequential": sequential,
           "start/wait": start_wait}
    if computes:
        fns["in one step"] = lambda: one_step(params)
    else:  # the peer's part of one step: the exchange alone
        fns["in one step"] = lambda: exchange(params)
    return fns


def measure(fns: dict, repeats: int, late: float = 0.0) -> dict:
    """Interleaved: each repeat runs every variant once, after a barrier; with
    ``late``, ranks > 0 sleep that long (using no core) before their part."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            COMM.Barrier()
            began = time.perf_counter()
            if late and RANK > 0:
                time.sleep(late)
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - began)
    return {name: float(np.median(t) * 1e3) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--both", action="store_true",
                        help="every rank computes (default: ranks > 0 only communicate)")
    parser.add_argument("--late", type=float, default=0.0,
                        help="ranks > 0 start each step this many seconds late, asleep: "
                             "the exchange is slow without using a core (needs ranks > 0 "
                             "to only communicate)")
    parser.add_argument("--label", default=None, help="results file suffix")
    args = parser.parse_args()
    jf.set_topology(T.exponential(SIZE))
    jf.set_comm_thread_min_bytes(0)  # the exchange on the communication thread
    params = mlp(args.width, args.depth)
    megabytes = sum(p.nbytes for p in params) / 1e6
    if args.late and args.both:
        parser.error("--late needs ranks > 0 that only communicate (no --both)")
    computes = args.both or RANK == 0
    rows = []
    for batch in map(int, args.batches.split(",")):
        times = measure(variants(params, batch, args.width, computes), args.repeats,
                        args.late)
        times = COMM.bcast(times, root=0)
        sequential = times["sequential"]
        row = {"batch": batch, **times}
        for name in ("in one step", "start/wait"):
            row[f"hidden {name}"] = (sequential - times[name]) / times["comm"]
            # Of what could hide: 1 when the step takes max(compute, comm).
            row[f"hidden of possible {name}"] = ((sequential - times[name])
                                                 / min(times["comm"], times["compute"]))
        rows.append(row)
    if RANK != 0:
        return
    if args.late:
        write_late(args, rows, megabytes)
        return
    peer = "every rank computes" if args.both else "rank 0 computes, the others only communicate"
    label = args.label or (f"{SIZE}ranks" + ("_both" if args.both else "_peer"))
    lines = [f"# Overlap: exchange vs backward pass, start/wait ({SIZE} ranks, {peer})", "",
             f"Machine: {cpu()}; jax {jax.__version__}; XLA on one thread. MLP "
             f"{args.depth} x {args.width}^2 float32, {megabytes:.1f} MB exchanged "
             "(neighbor_allreduce of the parameters, on the communication thread). Rank 0's "
             f"median of {args.repeats} interleaved repeats (ms); hidden = (sequential - t) / "
             "comm.", "",
             "| batch | compute | comm | sequential | in one step | start/wait "
             "| hidden, one step | hidden, start/wait |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['compute']:.2f} | {r['comm']:.2f} "
                     f"| {r['sequential']:.2f} | {r['in one step']:.2f} "
                     f"| {r['start/wait']:.2f} | {r['hidden in one step']:.2f} "
                     f"| {r['hidden start/wait']:.2f} |")
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"overlap_{label}.md").write_text(text + "\n")
    (RESULTS / f"overlap_{label}.json").write_text(json.dumps(
        {"ranks": SIZE, "megabytes": megabytes, "both": args.both, "machine": cpu(),
         "rows": rows}, indent=1))


def write_late(args, rows: list, megabytes: float) -> None:
    """The late-peer table: the exchange is slow (the peer asleep), not busy."""
    lines = [f"# Overlap with a late peer ({SIZE} ranks; ranks > 0 sleep {args.late * 1e3:.0f} ms "
             "before each step's exchange, using no core)", "",
             f"Machine: {cpu()}; jax {jax.__version__}; XLA on one thread. MLP "
             f"{args.depth} x {args.width}^2 float32, {megabytes:.1f} MB exchanged; rank 0 "
             f"computes. Rank 0's median of {args.repeats} interleaved repeats (ms). The "
             "ideal step is max(compute, comm); hidden of possible = (sequential - t) / "
             "min(compute, comm): 1 when t is the ideal (above 1 where sequential took more than "
             "compute + comm measured apart).", "",
             "| batch | compute | comm | sequential | start/wait | in one step "
             "| max(compute, comm) | above it, start/wait | above it, one step "
             "| hidden of possible, start/wait | hidden of possible, one step |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ideal = max(r['compute'], r['comm'])
        lines.append(f"| {r['batch']} | {r['compute']:.1f} | {r['comm']:.1f} "
                     f"| {r['sequential']:.1f} | {r['start/wait']:.1f} "
                     f"| {r['in one step']:.1f} | {ideal:.1f} "
                     f"| {r['start/wait'] - ideal:.1f} | {r['in one step'] - ideal:.1f} "
                     f"| {r['hidden of possible start/wait']:.2f} "
                     f"| {r['hidden of possible in one step']:.2f} |")
    text = "\n".join(lines)
    print(text)
    label = args.label or f"{SIZE}ranks_late"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"overlap_{label}.md").write_text(text + "\n")
    (RESULTS / f"overlap_{label}.json").write_text(json.dumps(
        {"ranks": SIZE, "megabytes": megabytes, "late_s": args.late, "machine": cpu(),
         "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
