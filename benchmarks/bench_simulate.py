"""The simulation backend's neighbor averaging against the memory bound and dense W @ X.

    python benchmarks/bench_simulate.py

For n agents x d float32 values on the exponential graph and the ring, times
one jitted ``simulate(neighbor_allreduce)`` step against the physical bound:
one read and one write of the agents' values (2 * n * d * 4 bytes), timed as a
plain jitted copy in the same run; and against dense ``W @ X`` in HIGHEST
precision (float32 products, not TF32 or bf16 passes). Medians of repeated
blocking calls.
Writes a markdown table and JSON under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxfog as jf
import jaxfog.topology as T

RESULTS = Path(__file__).resolve().parent / "results"


def median_seconds(fn, *args, repeats: int = 7) -> float:
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _line(r: dict) -> str:
    return (f"| {r['graph']} | {r['n']} | {r['d']:.0e} | {r['degree']} | "
            f"{r['simulate_ms']:.2f} | {r['bound_ms']:.2f} | {100 * r['of_bound']:.0f}% | "
            f"{r['dense_ms']:.2f} | {r['dense_ms'] / r['simulate_ms']:.1f}x |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-elements", type=float, default=6.4e7,
                        help="skip n * d above this (memory and time on small machines)")
    parser.add_argument("--agents", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--dims", type=float, nargs="+", default=[1e4, 1e5, 1e6],
                        help="values per agent (the GPU check: 1e4 to 1e7)")
    args = parser.parse_args()
    device = jax.devices()[0]
    rows = []
    copy = jax.jit(lambda x: x * 1.0)
    header = ("| graph | n | d | in-degree | simulate (ms) | 1R+1W bound (ms) | % of bound | "
              "dense W@X (ms) | dense / simulate |")
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}\n")
    print(header + "\n" + "|---" * 9 + "|", flush=True)
    for n in args.agents:
        for d in map(int, args.dims):
            if n * d > args.max_elements:
                continue
            x = jax.random.normal(jax.random.key(0), (n, d), jnp.float32)
            copy_s = median_seconds(copy, x)
            for name, topo in (("exponential", T.exponential(n)), ("ring", T.ring(n))):
                degree = max(topo.in_degree(r) for r in range(n))
                step = jax.jit(jf.simulate(jf.neighbor_allreduce, topo))
                w = jnp.asarray(topo.weights, jnp.float32)
                dense = jax.jit(lambda x, w=w: jnp.matmul(w, x,
                                                          precision=jax.lax.Precision.HIGHEST))
                sim_s = median_seconds(step, x)
                dense_s = median_seconds(dense, x)
                row = {"graph": name, "n": n, "d": d, "degree": degree,
                       "simulate_ms": sim_s * 1e3, "bound_ms": copy_s * 1e3,
                       "of_bound": copy_s / sim_s, "dense_ms": dense_s * 1e3}
                rows.append(row)
                print(_line(row), flush=True)
    machine = (f"{device.device_kind} ({device.platform}); {os.cpu_count()} host cores; "
               f"{platform.system()} {platform.release()}; jax {jax.__version__}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"simulate_{device.platform}"
    lines = [f"# simulate(neighbor_allreduce), {device.platform}", "", f"Machine: {machine}", "",
             "Bound = one read and one write of the n x d float32 values (a jitted copy "
             "in the same run); % of bound = bound / simulate. Dense W@X in HIGHEST "
             "precision. Medians of 7 blocking calls.", "", header,
             "|---" * 9 + "|", *map(_line, rows)]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps({"machine": machine, "rows": rows},
                                                    indent=1))
    print(f"\nwrote {stem}.md/.json")


if __name__ == "__main__":
    main()
