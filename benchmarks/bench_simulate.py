"""The simulation backend's neighbor averaging against the memory bound and dense W @ X.

    python benchmarks/bench_simulate.py [--agents N...] [--dims D...]
        [--graphs exponential ring one-peer regular4] [--paths gather tiled] [--tile N]

For n agents x d float32 values on each graph (the exponential graph, the
ring, one entry of the one-peer exponential schedule, a random regular graph
of in- and out-degree 4), times one jitted ``simulate(neighbor_allreduce)``
step on each mixing path (``JAXFOG_SIM_MIXING``, jaxfog/simulation/_tiled.py:
``gather``, today's ppermute rows; ``tiled``, the column-tiled Pallas kernel,
by default timed on a GPU only: elsewhere it runs in Pallas' interpreter)
against the physical bound: one read and one write of the agents' values
(2 * n * d * 4 bytes), timed as a plain jitted copy in the same run; and
against dense ``W @ X`` in HIGHEST precision (float32 products, not TF32 or
bf16 passes). Medians of repeated blocking calls.
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
from jaxfog.simulation import _tiled

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


def random_regular(n: int, degree: int = 4, seed: int = 0) -> T.Topology:
    """Every agent receives from ``degree`` others (at most n - 1) and sends to
    as many: the union of random fixed-point-free permutations sharing no edge
    (drawn again from the start where one cannot be completed)."""
    degree, rows = min(degree, n - 1), np.arange(n)
    rng = np.random.default_rng(seed)
    while True:
        w = np.eye(n)
        for _ in range(degree):
            for _ in range(10000):
                p = rng.permutation(n)
                if not (w[rows, p] > 0).any():  # the diagonal is set: no fixed point
                    break
            else:
                break
            w[rows, p] = 1.0
        else:
            return T.from_weights(w / (degree + 1))


GRAPHS = {
    "exponential": T.exponential,
    "ring": T.ring,
    "one-peer": lambda n: T.one_peer_exponential(n).at(1),
    "regular4": random_regular,
}


def _ms(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def _pct(value) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _ratio(a, b) -> str:
    return "-" if a is None or b is None else f"{a / b:.1f}x"


def _line(r: dict) -> str:
    gather, tiled = r.get("simulate_ms"), r.get("tiled_ms")
    return (f"| {r['graph']} | {r['n']} | {r['d']:.0e} | {r['degree']} | "
            f"{_ms(gather)} | {_pct(r.get('of_bound'))} | {_ms(tiled)} | "
            f"{_pct(r.get('tiled_of_bound'))} | {r['bound_ms']:.2f} | {r['dense_ms']:.2f} | "
            f"{_ratio(r['dense_ms'], gather)} | {_ratio(r['dense_ms'], tiled)} |")


def _compiled(topology, path: str, x):
    """The jitted step on one mixing path, compiled for ``x`` (the switch is
    read when the simulation is traced)."""
    with _tiled.forcing(path):
        return jax.jit(jf.simulate(jf.neighbor_allreduce, topology)).lower(x).compile()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-elements", type=float, default=6.4e7,
                        help="skip n * d above this (memory and time on small machines)")
    parser.add_argument("--agents", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--dims", type=float, nargs="+", default=[1e4, 1e5, 1e6],
                        help="values per agent (the GPU check: 1e4 to 1e7)")
    parser.add_argument("--graphs", nargs="+", choices=tuple(GRAPHS),
                        default=["exponential", "ring"])
    parser.add_argument("--paths", nargs="+", choices=("gather", "tiled"), default=None,
                        help="mixing paths to time (default: both on a GPU, gather elsewhere: "
                             "off a GPU the tiled kernel runs in Pallas' interpreter)")
    parser.add_argument("--out", default=str(RESULTS), help="where the table and JSON go")
    parser.add_argument("--tile", type=int, default=None,
                        help="the tiled kernel's columns per program on a GPU (a power of 2; "
                             "default jaxfog.simulation._tiled.GPU_TILE)")
    args = parser.parse_args()
    if args.tile is not None:
        _tiled.GPU_TILE = args.tile
    device = jax.devices()[0]
    paths = args.paths or (["gather", "tiled"] if device.platform == "gpu" else ["gather"])
    rows = []
    copy = jax.jit(lambda x: x * 1.0)
    header = ("| graph | n | d | in-degree | gather (ms) | gather % of bound | tiled (ms) | "
              "tiled % of bound | 1R+1W bound (ms) | dense W@X (ms) | dense / gather | "
              "dense / tiled |")
    print(f"device: {device.device_kind} ({device.platform}), jax {jax.__version__}\n")
    print(header + "\n" + "|---" * 12 + "|", flush=True)
    for n in args.agents:
        for d in map(int, args.dims):
            if n * d > args.max_elements:
                continue
            x = jax.random.normal(jax.random.key(0), (n, d), jnp.float32)
            copy_s = median_seconds(copy, x)
            for name in args.graphs:
                topo = GRAPHS[name](n)
                degree = max(topo.in_degree(r) for r in range(n))
                w = jnp.asarray(topo.weights, jnp.float32)
                dense = jax.jit(lambda x, w=w: jnp.matmul(w, x,
                                                          precision=jax.lax.Precision.HIGHEST))
                times = {path: median_seconds(_compiled(topo, path, x), x) for path in paths}
                dense_s = median_seconds(dense, x)
                row = {"graph": name, "n": n, "d": d, "degree": degree,
                       "bound_ms": copy_s * 1e3, "dense_ms": dense_s * 1e3}
                # simulate_ms / of_bound: today's (gather) path, as in earlier tables.
                gather_s = times.get("gather")
                row["simulate_ms"] = None if gather_s is None else gather_s * 1e3
                row["of_bound"] = None if gather_s is None else copy_s / gather_s
                if "tiled" in times:
                    row["tiled_ms"] = times["tiled"] * 1e3
                    row["tiled_of_bound"] = copy_s / times["tiled"]
                rows.append(row)
                print(_line(row), flush=True)
    machine = (f"{device.device_kind} ({device.platform}); {os.cpu_count()} host cores; "
               f"{platform.system()} {platform.release()}; jax {jax.__version__}; "
               "tiled kernel: " + (f"{_tiled.GPU_TILE} columns a program" if
                                   device.platform == "gpu" else "Pallas' interpreter"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"simulate_{device.platform}"
    lines = [f"# simulate(neighbor_allreduce), {device.platform}", "", f"Machine: {machine}", "",
             ("Bound = one read and one write of the n x d float32 values (a jitted copy "
              "in the same run); % of bound = bound / the path's time. gather: today's "
              "path (JAXFOG_SIM_MIXING=gather, ppermute rows); tiled: the column-tiled "
              "Pallas kernel (JAXFOG_SIM_MIXING=tiled; '-': not timed, as off a GPU). "
              "Dense W@X in HIGHEST precision. Medians of 7 blocking calls."), "", header,
             "|---" * 12 + "|", *map(_line, rows)]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps({"machine": machine, "rows": rows},
                                                    indent=1))
    print(f"\nwrote {stem}.md/.json")


if __name__ == "__main__":
    main()
