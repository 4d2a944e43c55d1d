"""The collectives against the MPI floor and against mpi4jax (issue 35).

Run with ``jaxfog run -np 2 python benchmarks/bench_collectives.py`` (and
``-np 4``). For ``allreduce`` (sum), ``allgather`` and ``broadcast`` of float32
arrays from 1 KB to 64 MB it times, as the median of the slowest rank's time
per blocking call:

* ``floor``: mpi4py's same call on numpy into a freshly allocated output (a
  JAX op returns a new array, so the floor pays for allocating and first
  touching it too; a broadcast's root copies its value into that output);
* ``mpi4jax``: mpi4jax's same op inside ``jax.jit``;
* ``jaxfog``: the jaxfog op inside ``jaxfog.jit``;
* ``jit``: ``jaxfog.jit`` of ``x * 1`` on the same array, no communication:
  what any JAX op costs to call (a few microseconds MPI's floor has not to pay).

The three are interleaved: every cell is the median of ``ROUNDS`` rounds, each
round timing all three, so drift on a shared machine hits them alike. Rank 0
writes ``benchmarks/results/collectives_{N}ranks.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import jaxfog as jf
from jaxfog import _machine

jf.init()
from mpi4py import MPI  # noqa: E402  (after init: jaxfog picks the MPI library)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
SIZES = [1 << k for k in range(10, 27, 2)]  # 1 KB .. 64 MB
OPS = ("allreduce", "allgather", "broadcast")
ROUNDS = 9
RESULTS = Path(__file__).resolve().parent / "results"


def timeit(fn, repeats: int, warmup: int = 2) -> float:
    """Median over ``repeats`` of the slowest rank's time for one blocking call (us)."""
    for _ in range(warmup):
        fn()
    times = np.empty(repeats)
    for k in range(repeats):
        COMM.Barrier()
        start = time.perf_counter()
        fn()
        times[k] = time.perf_counter() - start
    slowest = np.empty_like(times)
    COMM.Allreduce(times, slowest, op=MPI.MAX)
    return float(np.median(slowest) * 1e6)


def floor(op: str, x: np.ndarray):
    """mpi4py on numpy, the output allocated per call."""
    if op == "allreduce":
        def run():
            out = np.empty_like(x)
            COMM.Allreduce(x, out, op=MPI.SUM)
            return out
    elif op == "allgather":
        def run():
            out = np.empty((SIZE, *x.shape), x.dtype)
            COMM.Allgather(x, out)
            return out
    else:
        def run():
            out = np.empty_like(x)
            if RANK == 0:
                out[...] = x
            COMM.Bcast(out, root=0)
            return out
    return run


def with_mpi4jax(op: str, x):
    import mpi4jax

    if op == "allreduce":
        step = jax.jit(lambda v: mpi4jax.allreduce(v, op=MPI.SUM, comm=COMM))
    elif op == "allgather":
        step = jax.jit(lambda v: mpi4jax.allgather(v, comm=COMM))
    else:
        step = jax.jit(lambda v: mpi4jax.bcast(v, root=0, comm=COMM))
    return lambda: jax.block_until_ready(step(x))


def with_jaxfog(op: str, x):
    if op == "allreduce":
        step = jf.jit(lambda v: jf.allreduce(v, "sum"))
    elif op == "allgather":
        step = jf.jit(jf.allgather)
    else:
        step = jf.jit(lambda v: jf.broadcast(v, root=0))
    return lambda: jax.block_until_ready(step(x))


def check(op: str, x: np.ndarray) -> None:
    """The three agree before any is timed."""
    want = floor(op, x)()
    got = {"mpi4jax": with_mpi4jax, "jaxfog": with_jaxfog}
    for name, make in got.items():
        value = make(op, jnp.asarray(x))()
        value = value[0] if isinstance(value, tuple) else value  # mpi4jax < 0.8: (x, token)
        np.testing.assert_allclose(np.asarray(value).reshape(want.shape), want, rtol=1e-6,
                                   err_msg=f"{name} {op}")


def bench(op: str, nbytes: int) -> dict:
    x = (np.arange(nbytes // 4, dtype=np.float32) % 97 + RANK).astype(np.float32)
    check(op, x)
    device = jnp.asarray(x)
    scale = jf.jit(lambda v: v * 1)
    fns = {"floor": floor(op, x), "mpi4jax": with_mpi4jax(op, device),
           "jaxfog": with_jaxfog(op, device),
           "jit": lambda: jax.block_until_ready(scale(device))}
    repeats = int(np.clip(2e8 / nbytes, 9, 200)) // ROUNDS + 1
    samples = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            samples[name].append(timeit(fn, repeats))
    return {"op": op, "bytes": nbytes, **{k: float(np.median(v)) for k, v in samples.items()}}


def human(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


HEADER = ("| op | message | floor (us) | jit (us) | mpi4jax (us) | jaxfog (us) | "
          "jaxfog / floor | jaxfog / (floor + jit) | mpi4jax / jaxfog |")
COLUMNS = 9


def row_line(r: dict) -> str:
    return (f"| {r['op']} | {human(r['bytes'])} | {r['floor']:.1f} | {r['jit']:.1f} | "
            f"{r['mpi4jax']:.1f} | {r['jaxfog']:.1f} | {r['jaxfog'] / r['floor']:.2f} | "
            f"{r['jaxfog'] / (r['floor'] + r['jit']):.2f} | {r['mpi4jax'] / r['jaxfog']:.2f}x |")


def machine() -> str:
    return (f"{_machine.cpu()}; {SIZE} ranks on one machine; "
            f"{MPI.Get_library_version().splitlines()[0].rstrip(chr(0))}; jax {jax.__version__}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(OPS), figsize=(5.5 * len(OPS), 4.2), squeeze=False)
    for ax, op in zip(axes[0], OPS):
        sub = [r for r in rows if r["op"] == op]
        sizes = [r["bytes"] for r in sub]
        for key, style in (("floor", "k--"), ("mpi4jax", "r-o"), ("jaxfog", "b-o")):
            ax.loglog(sizes, [r[key] for r in sub], style, label=key, markersize=3)
        ax.set_title(f"{op}, {SIZE} ranks")
        ax.set_xlabel("message per rank (bytes, float32)")
        ax.set_ylabel("median time (us)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="every third size (smoke run)")
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of "
                        + ", ".join(OPS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    sizes = SIZES[::3] if args.quick else SIZES
    ops = [op for op in args.ops.split(",") if op]
    if RANK == 0:
        print(f"machine: {machine()}\n\n{HEADER}\n" + "|---" * COLUMNS + "|", flush=True)
    rows = []
    for op in ops:
        for nbytes in sizes:
            rows.append(bench(op, nbytes))
            if RANK == 0:
                print(row_line(rows[-1]), flush=True)
    if RANK != 0:
        return
    lines = [f"# Collectives against the MPI floor and mpi4jax, {SIZE} ranks", "",
             f"Machine: {machine()}", "",
             "Median of the slowest rank's time per blocking call; each cell the median of "
             f"{ROUNDS} interleaved rounds. floor: mpi4py on numpy into a fresh output; "
             "mpi4jax: inside `jax.jit`; jaxfog: inside `jaxfog.jit`. allreduce sums.", "",
             HEADER, "|---" * COLUMNS + "|", *map(row_line, rows)]
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"collectives_{SIZE}ranks"
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps({"machine": machine(), "rows": rows},
                                                    indent=1))
    plot(rows, stem.with_suffix(".png"))


if __name__ == "__main__":
    main()
