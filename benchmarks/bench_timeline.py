"""What the op timeline (``JAXFOG_TIMELINE``) costs a neighbor_allreduce.

Run with ``jaxfog run -np 2 python benchmarks/bench_timeline.py``.

A jitted ``fori_loop`` of ``--loop`` neighbor_allreduce calls on a float32
array (1 MB and 4 KB by default) is timed with the timeline off and on, in
alternating blocks so that drift of a shared machine hits both alike; the
timeline is switched with the C entry point ``jaxfog_timeline_start`` (what
``jaxfog.init()`` calls with ``JAXFOG_TIMELINE``). Each sample is the slowest
rank's time for one loop divided by ``--loop``; the table gives the median
per call, for ops run inline on XLA's thread and from the communication
thread. Rank 0 writes ``benchmarks/results/timeline_overhead.{md,json}``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

import jaxfog as jf

jf.init()
from mpi4py import MPI  # noqa: E402  (after init: jaxfog picks the MPI library)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxfog import ffi  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
RESULTS = Path(__file__).resolve().parent / "results"


def set_timeline(path: str | None) -> None:
    error = ctypes.create_string_buffer(1024)
    if ffi.library().jaxfog_timeline_start((path or "").encode(), RANK, error, 1024) != 0:
        raise RuntimeError(error.value.decode())


def samples(fn, x, loop: int, repeats: int) -> list[float]:
    """Per-call microseconds: the slowest rank's time for one loop / loop."""
    times = []
    for _ in range(repeats):
        COMM.Barrier()
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - start)
    slowest = np.empty(repeats)
    COMM.Allreduce(np.array(times), slowest, op=MPI.MAX)
    return list(slowest / loop * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1048576,4096", help="message bytes")
    parser.add_argument("--loop", type=int, default=100, help="calls per jitted loop")
    parser.add_argument("--blocks", type=int, default=8, help="off/on block pairs")
    parser.add_argument("--repeats", type=int, default=5, help="loops per block")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="jaxfog_timeline_bench_")
    path = os.path.join(folder, "trace.json")  # per rank: trace.rank<r>.json

    @jax.jit
    def loop(x):
        return jax.lax.fori_loop(0, args.loop, lambda _, y: jf.neighbor_allreduce(y), x)

    rows = []
    for nbytes in map(int, args.sizes.split(",")):
        x = jnp.full(nbytes // 4, float(RANK), jnp.float32)
        for mode, threshold in (("inline", None), ("async", 0)):
            jf.set_comm_thread_min_bytes(threshold)
            jax.block_until_ready(loop(x))  # compile, warm up
            times: dict[str, list[float]] = {"off": [], "on": []}
            for block in range(args.blocks):
                for state in (("off", "on") if block % 2 == 0 else ("on", "off")):
                    set_timeline(path if state == "on" else None)
                    times[state] += samples(loop, x, args.loop, args.repeats)
            set_timeline(None)
            off, on = (float(np.median(times[s])) for s in ("off", "on"))
            rows.append({"bytes": nbytes, "mode": mode, "off_us": off, "on_us": on,
                         "overhead_us": on - off, "overhead_pct": 100 * (on - off) / off,
                         "samples": len(times["on"])})
    jf.shutdown()  # writes the timeline
    trace_file = Path(folder, f"trace.rank{RANK}.json")
    trace = json.loads(trace_file.read_text())
    trace_bytes = trace_file.stat().st_size
    shutil.rmtree(folder)
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    ops = sum(e["cat"] == "op" for e in spans)
    if RANK != 0:
        return
    lines = [f"# Op timeline overhead ({SIZE} ranks, neighbor_allreduce, float32)", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
             f"jax {jax.__version__}. A jitted fori_loop of {args.loop} calls, timed "
             f"{args.blocks} x {args.repeats} times each with the timeline off and on, in "
             "alternating blocks; median per call of the slowest rank (us). inline: the op "
             "runs on XLA's thread; async: on jaxfog's communication thread.", "",
             "| message | mode | timeline off | timeline on | overhead | overhead % |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        size = f"{r['bytes'] / 2**20:g} MB" if r["bytes"] >= 2**20 else f"{r['bytes'] / 1024:g} KB"
        lines.append(f"| {size} | {r['mode']} | {r['off_us']:.1f} | {r['on_us']:.1f} "
                     f"| {r['overhead_us']:+.1f} | {r['overhead_pct']:+.1f}% |")
    lines += ["", f"Recorded: {len(spans)} spans for {ops} ops on rank 0 "
              f"({len(spans) / max(ops, 1):.1f} per op), "
              f"{trace_bytes / max(ops, 1):.0f} bytes "
              "of JSON per op."]
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "timeline_overhead.md").write_text(text + "\n")
    (RESULTS / "timeline_overhead.json").write_text(json.dumps(
        {"ranks": SIZE, "loop": args.loop, "rows": rows, "spans_per_op": len(spans) / max(ops, 1)},
        indent=1))


if __name__ == "__main__":
    main()
