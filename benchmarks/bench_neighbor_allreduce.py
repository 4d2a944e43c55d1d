"""Neighbor averaging against the floors and against mpi4jax (issue: FFI ops).

Run with ``jaxfog run -np 2 python benchmarks/bench_neighbor_allreduce.py``
(and ``-np 4``). For ring and exponential graphs and float32 messages from
1 KB to 16 MB it times, as the median over repetitions of the slowest rank's
blocking time:

* ``comm``: the communication floor, mpi4py Isend/Irecv of numpy buffers to
  the same neighbours, no arithmetic;
* ``arith``: the arithmetic floor, the same weighted sum as one jitted XLA op
  on local arrays;
* ``comm+np``: (comm) plus an in-place numpy weighted sum;
* ``mpi4jax``: mpi4jax ``sendrecv`` compositions plus the sum, inside ``jax.jit``;
* ``jaxfog``: ``jaxfog.neighbor_allreduce`` inside ``jaxfog.jit`` (C++ dispatch);
* ``jaxfog jax.jit``: the same inside plain ``jax.jit`` (ordered effect: JAX's
  Python dispatch path), for reference.

Then a pytree of 100 leaves of 4 KB against one 400 KB array, and
``jaxfog.allreduce`` against mpi4py ``Allreduce``. Rank 0 prints the tables and
writes them (markdown and JSON) and a plot under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import jaxfog as jf
import jaxfog.topology as T
from jaxfog import _machine

jf.init()
from mpi4py import MPI  # noqa: E402  (after init: jaxfog picks the MPI library)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
SIZES = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
RESULTS = Path(__file__).resolve().parent / "results"


def timeit(fn, repeats: int, warmup: int = 3) -> float:
    """Median over repeats of the slowest rank's time for one blocking call (us)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        COMM.Barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times = np.array(times)
    slowest = np.empty_like(times)
    COMM.Allreduce(times, slowest, op=MPI.MAX)
    return float(np.median(slowest) * 1e6)


ROUNDS = 5


def rounds(fns: dict, repeats: int) -> dict:
    """The median over ROUNDS interleaved rounds of each function's timeit, so
    that drift on a shared machine hits every column alike."""
    samples = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            samples[name].append(timeit(fn, max(repeats // ROUNDS, 5)))
    return {name: float(np.median(v)) for name, v in samples.items()}


def repeats_for(nbytes: int) -> int:
    return int(np.clip(2e8 / max(nbytes, 1), 15, 400))


def mpi4jax_average(topo, rank):
    """The same average composed of mpi4jax sendrecv calls (None if unavailable)."""
    try:
        import mpi4jax
    except ImportError:
        return None
    w = topo.weights
    outs, ins = topo.out_neighbors(rank), topo.in_neighbors(rank)
    # Pair the k-th out-neighbour with the k-th in-neighbour by offset, as a
    # user would for circulant graphs (ring, exponential).
    offsets = sorted({(d - rank) % SIZE for d in outs})
    comm = COMM.Clone()

    @jax.jit
    def average(x):
        acc = w[rank, rank] * x
        for off in offsets:
            src, dst = (rank - off) % SIZE, (rank + off) % SIZE
            got = mpi4jax.sendrecv(x, x, source=src, dest=dst, comm=comm)
            if isinstance(got, tuple):
                got = got[0]
            acc = acc + w[rank, src] * got
        return acc

    assert sorted((rank - o) % SIZE for o in offsets) == ins
    return average


def neighbor_rows(topo):
    outs, ins = topo.out_neighbors(RANK), topo.in_neighbors(RANK)
    w = topo.weights
    return outs, ins, float(w[RANK, RANK]), [float(w[RANK, j]) for j in ins]


def bench_graph(name: str, topo, sizes) -> list[dict]:
    rows = []
    outs, ins, sw, ws = neighbor_rows(topo)
    m4j = mpi4jax_average(topo, RANK)
    jaxfog_avg = jf.jit(lambda x: jf.neighbor_allreduce(x, topology=topo))
    jaxfog_plain = jax.jit(lambda x: jf.neighbor_allreduce(x, topology=topo))
    arith = jax.jit(lambda x, ys: sw * x + sum(w * y for w, y in zip(ws, ys)))
    for nbytes in sizes:
        count = nbytes // 4
        x_np = np.random.default_rng(RANK).standard_normal(count).astype(np.float32)
        bufs = [np.empty_like(x_np) for _ in ins]
        out_np = np.empty_like(x_np)
        x = jnp.asarray(x_np)
        ys = [jnp.asarray(x_np) for _ in ins]
        reps = repeats_for(nbytes)

        def comm_only():
            reqs = [COMM.Irecv(b, source=j, tag=7) for b, j in zip(bufs, ins)]
            reqs += [COMM.Isend(x_np, dest=i, tag=7) for i in outs]
            MPI.Request.Waitall(reqs)

        def comm_numpy():
            comm_only()
            np.multiply(x_np, np.float32(sw), out=out_np)
            for w, b in zip(ws, bufs):  # in place, no temporaries
                np.multiply(b, np.float32(w), out=b)
                np.add(out_np, b, out=out_np)

        fns = {"comm": comm_only,
               "arith": lambda: arith(x, ys).block_until_ready(),
               "comm+np": comm_numpy,
               "jaxfog": lambda: jaxfog_avg(x).block_until_ready(),
               "jaxfog jax.jit": lambda: jaxfog_plain(x).block_until_ready()}
        if m4j is not None:
            fns["mpi4jax"] = lambda: m4j(x).block_until_ready()
        row = {"graph": name, "bytes": nbytes, "mpi4jax": float("nan"),
               **rounds(fns, reps)}
        expected = np.asarray(jaxfog_avg(x))
        if m4j is not None:
            np.testing.assert_allclose(np.asarray(m4j(x)), expected, rtol=1e-5, atol=1e-6)
        rows.append(row)
        if RANK == 0:
            print(format_row(row), flush=True)
    return rows


def bench_pytree() -> dict:
    """100 leaves of 4 KB against one 400 KB array: per call (JAX's dispatch of
    100 argument leaves included) and per op inside a loop of 20 (the op alone)."""
    topo = T.ring(SIZE)
    avg = jf.jit(lambda x: jf.neighbor_allreduce(x, topology=topo))
    loop = jf.jit(lambda x: jax.lax.fori_loop(
        0, 20, lambda i, y: jf.neighbor_allreduce(y, topology=topo), x))
    leaves = [jnp.full((1024,), float(i), jnp.float32) for i in range(100)]
    single = jnp.zeros((100 * 1024,), jnp.float32)
    times = rounds({"tree_100x4KB": lambda: jax.block_until_ready(avg(leaves)),
                    "array_400KB": lambda: avg(single).block_until_ready(),
                    "tree_100x4KB_loop": lambda: jax.block_until_ready(loop(leaves)),
                    "array_400KB_loop": lambda: loop(single).block_until_ready()}, 300)
    for key in ("tree_100x4KB_loop", "array_400KB_loop"):
        times[key] /= 20
    return times


def bench_allreduce(sizes) -> list[dict]:
    rows = []
    mean = jf.jit(lambda x: jf.allreduce(x, op="sum"))
    for nbytes in sizes:
        x_np = np.ones(nbytes // 4, np.float32)
        out = np.empty_like(x_np)
        x = jnp.asarray(x_np)
        reps = repeats_for(nbytes)
        rows.append({"bytes": nbytes, **rounds(
            {"mpi4py": lambda: COMM.Allreduce(x_np, out, op=MPI.SUM),
             "jaxfog": lambda: mean(x).block_until_ready()}, reps)})
    return rows


HEADER = ("| graph | size | comm floor (us) | arith floor (us) | comm+numpy (us) | "
          "mpi4jax (us) | jaxfog jax.jit (us) | jaxfog (us) | jaxfog / (comm+arith) | "
          "jaxfog - comm (us) | mpi4jax / jaxfog |")


def human(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def format_row(row: dict) -> str:
    floor = row["comm"] + row["arith"]
    return (f"| {row['graph']} | {human(row['bytes'])} | {row['comm']:.1f} | "
            f"{row['arith']:.1f} | {row['comm+np']:.1f} | {row['mpi4jax']:.1f} | "
            f"{row['jaxfog jax.jit']:.1f} | {row['jaxfog']:.1f} | {row['jaxfog'] / floor:.2f} | "
            f"{row['jaxfog'] - row['comm']:.1f} | {row['mpi4jax'] / row['jaxfog']:.1f}x |")


def machine() -> str:
    return (f"{_machine.cpu()}; "
            f"{SIZE} ranks on one machine; "
            f"{MPI.Get_library_version().splitlines()[0].rstrip(chr(0))}; "
            f"jax {jax.__version__}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    graphs = sorted({r["graph"] for r in rows})
    fig, axes = plt.subplots(1, len(graphs), figsize=(6 * len(graphs), 4.5), squeeze=False)
    for ax, graph in zip(axes[0], graphs):
        sub = [r for r in rows if r["graph"] == graph]
        sizes = [r["bytes"] for r in sub]
        for key, style in (("comm", "k--"), ("arith", "k:"), ("comm+np", "g-."),
                           ("mpi4jax", "r-o"), ("jaxfog jax.jit", "m-^"), ("jaxfog", "b-o")):
            ax.loglog(sizes, [r[key] for r in sub], style, label=key, markersize=3)
        ax.loglog(sizes, [r["comm"] + r["arith"] for r in sub], "c-", label="comm+arith",
                  alpha=0.6)
        ax.set_title(f"{graph}, {SIZE} ranks")
        ax.set_xlabel("message (bytes, float32)")
        ax.set_ylabel("median time (us)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer sizes (smoke run)")
    args = parser.parse_args()
    sizes = SIZES[::3] if args.quick else SIZES
    if RANK == 0:
        print(f"machine: {machine()}\n\n{HEADER}\n" + "|---" * 11 + "|", flush=True)
    rows = []
    graphs = [("ring", T.ring(SIZE)), ("exponential", T.exponential(SIZE))]
    for name, topo in graphs:
        rows += bench_graph(name, topo, sizes)
    tree = bench_pytree()
    allreduce_rows = bench_allreduce([s for s in sizes if s >= 1 << 20] or sizes[-1:])
    if RANK != 0:
        return
    lines = [f"# neighbor_allreduce, {SIZE} ranks", "", f"Machine: {machine()}", "",
             "Median of the slowest rank's time per blocking call, after warm-up; each "
             f"cell the median of {ROUNDS} interleaved rounds. "
             "jaxfog: inside `jaxfog.jit`; jaxfog jax.jit: inside plain `jax.jit`.", "",
             HEADER, "|---" * 11 + "|"] + [format_row(r) for r in rows]
    lines += ["", "## Pytree fusion (ring)", "",
              "Per call: a `jaxfog.jit` call whose argument is the pytree (JAX's dispatch "
              "of 100 argument leaves included); per op: inside a `fori_loop` of 20 in one "
              "call.", "",
              "| | 100 leaves x 4 KB (us) | one 400 KB array (us) | ratio |",
              "|---|---|---|---|",
              f"| per call | {tree['tree_100x4KB']:.1f} | {tree['array_400KB']:.1f} | "
              f"{tree['tree_100x4KB'] / tree['array_400KB']:.2f} |",
              f"| per op | {tree['tree_100x4KB_loop']:.1f} | {tree['array_400KB_loop']:.1f} | "
              f"{tree['tree_100x4KB_loop'] / tree['array_400KB_loop']:.2f} |", "",
              "## allreduce (sum, float32)", "",
              "| size | mpi4py Allreduce (us) | jaxfog.allreduce (us) | ratio |",
              "|---|---|---|---|"]
    lines += [f"| {human(r['bytes'])} | {r['mpi4py']:.1f} | {r['jaxfog']:.1f} | "
              f"{r['jaxfog'] / r['mpi4py']:.2f} |" for r in allreduce_rows]
    text = "\n".join(lines) + "\n"
    print("\n".join(lines[lines.index("## Pytree fusion (ring)"):]))
    if not args.quick:
        RESULTS.mkdir(parents=True, exist_ok=True)
        stem = RESULTS / f"neighbor_allreduce_{SIZE}ranks"
        stem.with_suffix(".md").write_text(text)
        stem.with_suffix(".json").write_text(json.dumps(
            {"machine": machine(), "rows": rows, "pytree": tree,
             "allreduce": allreduce_rows}, indent=1))
        plot(rows, stem.with_suffix(".png"))
        print(f"wrote {stem}.md/.json/.png")


if __name__ == "__main__":
    main()
