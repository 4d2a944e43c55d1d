"""The simulation backend's neighbor averaging against the memory bound and dense W @ X.

    python benchmarks/bench_simulate.py

For n agents x d float32 values on the exponential graph and the ring, times
one jitted ``simulate(neighbor_allreduce)`` step and reports the bytes it must
move, ((in-degree + 1) reads + 1 write) * n * d * 4, per second, next to the
rate of a plain jitted copy (1 read + 1 write) measured in the same run -- the
bound -- and the time of dense ``W @ X``. Medians of repeated blocking calls.
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
    header = ("| graph | n | d | in-degree | simulate (ms) | GB/s | copy GB/s | % of bound | "
              "dense W@X (ms) | dense / simulate |")
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}\n")
    print(header + "\n" + "|---" * 10 + "|", flush=True)
    for n in args.agents:
        for d in map(int, args.dims):
            if n * d > args.max_elements:
                continue
            x = jax.random.normal(jax.random.key(0), (n, d), jnp.float32)
            copy_s = median_seconds(copy, x)
            copy_rate = 2 * n * d * 4 / copy_s
            for name, topo in (("exponential", T.exponential(n)), ("ring", T.ring(n))):
                degree = max(topo.in_degree(r) for r in range(n))
                step = jax.jit(jf.simulate(jf.neighbor_allreduce, topo))
                w = jnp.asarray(topo.weights, jnp.float32)
                dense = jax.jit(lambda x, w=w: w @ x)
                sim_s = median_seconds(step, x)
                dense_s = median_seconds(dense, x)
                rate = (degree + 2) * n * d * 4 / sim_s
                row = {"graph": name, "n": n, "d": d, "degree": degree,
                       "simulate_ms": sim_s * 1e3, "gbps": rate / 1e9,
                       "copy_gbps": copy_rate / 1e9, "of_bound": rate / copy_rate,
                       "dense_ms": dense_s * 1e3}
                rows.append(row)
                print(f"| {name} | {n} | {d:.0e} | {degree} | {row['simulate_ms']:.2f} | "
                      f"{row['gbps']:.1f} | {row['copy_gbps']:.1f} | "
                      f"{100 * row['of_bound']:.0f}% | {row['dense_ms']:.2f} | "
                      f"{dense_s / sim_s:.1f}x |", flush=True)
    machine = (f"{device.device_kind} ({device.platform}); {os.cpu_count()} host cores; "
               f"{platform.system()} {platform.release()}; jax {jax.__version__}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"simulate_{device.platform}"
    lines = [f"# simulate(neighbor_allreduce), {device.platform}", "", f"Machine: {machine}", "",
             "Bytes moved = (in-degree + 1 reads + 1 write) x n x d x 4; bound = the rate of "
             "a jitted copy in the same run. Medians of 7 blocking calls.", "", header,
             "|---" * 10 + "|"]
    lines += [f"| {r['graph']} | {r['n']} | {r['d']:.0e} | {r['degree']} | "
              f"{r['simulate_ms']:.2f} | {r['gbps']:.1f} | {r['copy_gbps']:.1f} | "
              f"{100 * r['of_bound']:.0f}% | {r['dense_ms']:.2f} | "
              f"{r['dense_ms'] / r['simulate_ms']:.1f}x |" for r in rows]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps({"machine": machine, "rows": rows},
                                                    indent=1))
    print(f"\nwrote {stem}.md/.json")


if __name__ == "__main__":
    main()
