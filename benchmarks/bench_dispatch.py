"""Dispatch cost of a jitted step with one jaxfog op: jaxfog.jit vs jax.jit.

Run with ``jaxfog run -np 2 python benchmarks/bench_dispatch.py``. A jitted
function takes N arrays of 256 float32 (N = 1, 100, 300: the leaves of a train
state) and doubles each; the communicating variants also average leaf 0 (1 KB)
with the neighbours (ring). All columns come from one run; each is the median
over repetitions of the slowest rank's time for one blocking call:

* ``plain``: ``jax.jit`` of the function without the op (what a step costs
  with no communication at all);
* ``comm floor``: mpi4py Isend/Irecv of the same 1 KB numpy buffer with the
  same neighbours;
* ``jax.jit + op``: ``jax.jit`` of the function with the op (ordered effect:
  JAX's Python dispatch path, runtime token);
* ``jaxfog.jit + op``: ``jaxfog.jit`` of the same function (C++ dispatch).

Targets (issue "fast path"): ``jaxfog.jit + op`` at most ``plain + comm floor
+ 20 us`` at every N, and at most 1.3x ``plain + comm floor`` at N = 1. Rank 0
prints the table and writes ``benchmarks/results/dispatch_{n}ranks.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

import jaxfog as jf
import jaxfog.topology as T

jf.init()
from mpi4py import MPI  # noqa: E402  (after init: jaxfog picks the MPI library)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_neighbor_allreduce import machine, timeit  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
RESULTS = Path(__file__).resolve().parent / "results"


def row(leaves: int, repeats: int) -> dict:
    ring = T.ring(SIZE)
    xs = [jnp.full((256,), float(i), jnp.float32) for i in range(leaves)]

    def plain(xs):
        return [x * 2 for x in xs]

    def with_op(xs):
        return [jf.neighbor_allreduce(xs[0], topology=ring)] + [x * 2 for x in xs[1:]]

    ins, outs = ring.in_neighbors(RANK), ring.out_neighbors(RANK)
    buf = np.ones(256, np.float32)
    got = [np.empty_like(buf) for _ in ins]

    def comm_floor():
        reqs = [COMM.Irecv(b, source=j, tag=3) for b, j in zip(got, ins)]
        reqs += [COMM.Isend(buf, dest=i, tag=3) for i in outs]
        MPI.Request.Waitall(reqs)

    fns = {"plain": jax.jit(plain), "jax.jit + op": jax.jit(with_op),
           "jaxfog.jit + op": jf.jit(with_op)}
    want = np.asarray(fns["jax.jit + op"](xs)[0])
    np.testing.assert_array_equal(np.asarray(fns["jaxfog.jit + op"](xs)[0]), want)
    result = {"leaves": leaves, "comm floor": timeit(comm_floor, repeats)}
    # Interleaved rounds, so that drift on this shared machine hits all alike.
    samples = {name: [] for name in fns}
    for _ in range(5):
        for name, fn in fns.items():
            samples[name].append(timeit(lambda: jax.block_until_ready(fn(xs)), repeats // 5))
    result.update({name: float(np.median(v)) for name, v in samples.items()})
    return result


HEADER = ("| leaves | plain jax.jit (us) | comm floor (us) | jax.jit + op (us) | "
          "jaxfog.jit + op (us) | jaxfog.jit - (plain + floor) (us) | "
          "jaxfog.jit / (plain + floor) | jax.jit / jaxfog.jit |")


def format_row(r: dict) -> str:
    base = r["plain"] + r["comm floor"]
    fast = r["jaxfog.jit + op"]
    return (f"| {r['leaves']} | {r['plain']:.1f} | {r['comm floor']:.1f} | "
            f"{r['jax.jit + op']:.1f} | {fast:.1f} | {fast - base:+.1f} | "
            f"{fast / base:.2f} | {r['jax.jit + op'] / fast:.1f}x |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=1000)
    args = parser.parse_args()
    rows = [row(n, args.repeats if n < 300 else args.repeats // 2) for n in (1, 100, 300)]
    if RANK != 0:
        return
    lines = [f"# Dispatch: one jaxfog op in a jitted step, {SIZE} ranks", "",
             f"Machine: {machine()}", "",
             "Median of the slowest rank's time per blocking call (5 interleaved rounds, "
             "median of their medians). Leaves: arrays of 256 float32 doubled by the step; "
             "the op averages leaf 0 (1 KB) over the ring.", "", HEADER,
             "|---" * 8 + "|"] + [format_row(r) for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"dispatch_{SIZE}ranks"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps({"machine": machine(), "rows": rows},
                                                    indent=1))
    print(f"wrote {stem}.md/.json")


if __name__ == "__main__":
    main()
