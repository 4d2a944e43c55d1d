"""One-sided windows against mpi4py RMA (issue 11: windows).

Run with ``python benchmarks/bench_window.py`` (from the repository root). The
script launches itself on 2 and then 4 ranks (``mpiexec -n N python
bench_window.py --worker``, through ``jaxfog.launcher`` as ``jaxfog run``
would, so that oversubscribed ranks get one XLA thread each). On jaxfog's
default exponential graph and float32 arrays of 1 KB to 16 MB it times, as the
median over repetitions of the slowest rank's time for one blocking call:

* ``win_put`` / ``win_accumulate`` to the out-neighbours, as ``x = put(x)`` with
  ``put = jaxfog.jit(..., donate_argnums=0)`` (a training loop's call: no fresh
  array is written; ``block_until_ready`` on the result), against mpi4py doing the same RMA
  calls on numpy buffers in a ``Win.Allocate`` window laid out like jaxfog's
  (region 0: the published value, region 1 + s: the slot of the s-th
  in-neighbour), with one ``Lock_all(MODE_NOCHECK)`` epoch held from creation
  as jaxfog holds: per destination ``Put`` (or ``Accumulate(op=SUM)``) into
  my slot there and ``Flush(dst)``; then ``Sync``, a numpy copy of x into
  region 0, ``Sync``, which is what jaxfog's put does for the published
  value;
* ``win_update`` (default weights) against the same weighted sum as one
  ``jax.jit`` op on local arrays;
* on 2 ranks, mpi4py only: ``Win.Allocate`` + Lock/Put/Unlock to the peer
  against ``Win.Allocate_shared`` + ``Shared_query`` + Lock/numpy copy into
  the peer's segment/Sync/Unlock (should jaxfog use shared-memory windows?),
  and both again with one ``Lock_all(MODE_NOCHECK)`` epoch held instead of a
  lock per write (Put/Flush, copy/Sync); then whether a write waits for the
  peer to enter MPI (the peer computing 1 ms outside MPI), jaxfog's win_put
  included.

Diagnostics beside them: the put and the update inside a ``lax.fori_loop`` of
10 (the op without per-call dispatch) and ``jax.jit(lambda v: v * 2)`` (JAX's
dispatch plus one pass writing a fresh array: the least that returning
``self_weight * x`` costs).

Before each timed sample the ranks meet at a barrier; the functions of one
size are interleaved sample by sample (the order rotating), after a warm-up,
so drift hits every column alike. The sweep runs three times. The machine is
shared with other work, so before each block of samples the ranks sleep until
the rest of the machine is quiet (for a bounded time), the CPU the other work
took during the block is recorded, and a cell is the median of the passes
that ran quiet (else the least loaded one). Each run writes
``benchmarks/results/window_{N}ranks.md/.json`` (and, on 2 ranks,
``window_shared_memory.md``); the launching process then draws
``benchmarks/results/window.png``. ``--quick`` is a smoke run (three sizes,
no files); ``--ranks``/``--sizes`` select a partial run (no files). To
measure another jaxfog than the installed one (an exported commit with its
library built), put it first on ``PYTHONPATH``: the results name the jaxfog
they measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from jaxfog import _machine

SIZES = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
RESULTS = Path(__file__).resolve().parent / "results"
WARMUP = 10
# The sweep over sizes runs PASSES times; a cell is the median of its passes' medians,
# so that a stretch of load from other work on the machine spoils one pass only.
PASSES = 3
LOOP = 10  # ops per call in the diagnostic loops
LOOP_MAX_BYTES = 256 << 10  # the loops run up to this size
# Other work shares this machine. Before each block of samples the ranks sleep
# until the rest of the machine uses at most QUIET_CORES (waiting at most
# MAX_WAIT_S over a run); during the block, the CPU time the machine spent
# outside the benchmark's ranks is recorded ("foreign load", in cores), and a
# cell uses only the passes whose foreign load was at most QUIET_CORES (the
# least loaded one if none was).
QUIET_CORES = 0.15
MAX_WAIT_S = 45.0
# Issue 11's targets.
PUT_RATIO, PUT_SMALL_US, PUT_LARGE_BYTES = 1.25, 30.0, 64 << 10
UPDATE_RATIO = 1.25

BASELINE = ("mpi4py: `Win.Allocate` window of (1 + in-degree) regions laid out like "
            "jaxfog's, one `Lock_all(MODE_NOCHECK)` epoch held from creation (as jaxfog "
            "holds; a lock per operation makes every write wait for its target to enter "
            "MPI, see window_shared_memory.md); per out-neighbour `Put` (accumulate: "
            "`Accumulate(op=SUM)`) of the numpy array into my slot on dst, `Flush(dst)`; "
            "then `Sync`, numpy copy of x into my region 0 (the published value), `Sync`. "
            "jaxfog: `x = put(x); x.block_until_ready()` with `put = jaxfog.jit(lambda x: "
            "win_put(x, name), donate_argnums=0)` (as a loop calls it: the returned x is "
            "the donated buffer, no fresh array): its C++ handler (jaxfog/ffi: "
            "window_handlers.cc WinPutJob, mpi_window.cc): the same RMA calls, plus the version "
            "count of a put.")


LOAD_NOTE = (f"The machine is shared with other work: before each block of samples the "
             f"ranks sleep until the rest of the machine uses at most {QUIET_CORES} cores "
             f"(waiting at most {MAX_WAIT_S:.0f} s per run), and a cell keeps only the passes "
             f"during which the other work took at most {QUIET_CORES} cores (/proc/stat's "
             "busy time less the ranks' own CPU time), or the least loaded pass; the last "
             "column gives that load and the passes kept.")


def human(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all processes, /proc/stat)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:9]]
    user, nice, system, _, _, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def jaxfog_source(package_dir: Path) -> str:
    """Where jaxfog was imported from and which commit (with "+ local changes"
    when the checkout's jaxfog/ differs from it); a COMMIT file beside an
    exported tree names its commit."""
    root = package_dir.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--",
                                "jaxfog"], capture_output=True, text=True).stdout.strip()
        return f"jaxfog {commit}{' + local changes' if dirty else ''} ({root})"
    except (OSError, subprocess.CalledProcessError):
        marker = root / "COMMIT"
        commit = marker.read_text().strip()[:7] if marker.exists() else "unknown commit"
        return f"jaxfog {commit} ({root})"


def repeats_for(nbytes: int) -> int:
    return int(np.clip(2e8 / max(nbytes, 1), 30, 200))


# --- the launching process ---------------------------------------------------

def launch(ranks: list[int], extra: list[str]) -> None:
    from jaxfog.cli import _launcher as launcher

    for n in ranks:
        command = launcher.build_command(
            [sys.executable, str(Path(__file__).resolve()), "--worker", *extra], n)
        print(f"$ {' '.join(command)}", flush=True)
        start = time.perf_counter()
        code = subprocess.call(command)
        print(f"({n} ranks: {time.perf_counter() - start:.0f} s)", flush=True)
        if code:
            raise SystemExit(f"the {n}-rank run failed with exit status {code}")
    if not extra:
        plot(RESULTS / "window.png")


def plot(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for n in (2, 4):
        file = RESULTS / f"window_{n}ranks.json"
        if file.exists():
            runs.append((n, json.loads(file.read_text())["rows"]))
    if not runs:
        return
    ops = (("put", "win_put", "mpi4py Put"), ("accumulate", "win_accumulate",
                                               "mpi4py Accumulate"),
           ("update", "win_update", "jitted weighted sum"))
    fig, axes = plt.subplots(len(runs), 3, figsize=(16, 4.3 * len(runs)), squeeze=False)
    for row_axes, (n, rows) in zip(axes, runs):
        sizes = [r["bytes"] for r in rows]
        for ax, (key, ours, theirs) in zip(row_axes, ops):
            ax.loglog(sizes, [r[f"{key}_jaxfog"] for r in rows], "b-o", markersize=3,
                      label=f"jaxfog {ours}")
            ax.loglog(sizes, [r[f"{key}_base"] for r in rows], "k--s", markersize=3,
                      label=theirs)
            if key == "update":
                target = [UPDATE_RATIO * r["update_base"] for r in rows]
            else:
                target = [PUT_RATIO * r[f"{key}_base"] if r["bytes"] >= PUT_LARGE_BYTES
                          else r[f"{key}_base"] + PUT_SMALL_US for r in rows]
            ax.loglog(sizes, target, "r:", label="target")
            ax.set_title(f"{ours}, {n} ranks (exponential graph)")
            ax.set_xlabel("array (bytes, float32)")
            ax.set_ylabel("median time (us)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# --- the ranks -----------------------------------------------------------------

def worker(args) -> None:
    import jaxfog as jf
    from jaxfog.ops import window as W

    jf.init()
    from mpi4py import MPI  # after init: jaxfog picks the MPI library

    import jax
    import jax.numpy as jnp

    comm = MPI.COMM_WORLD
    source = jaxfog_source(Path(jf.__file__).resolve().parent)
    rank, size = comm.Get_rank(), comm.Get_size()
    topo = jf.load_topology()
    outs = list(topo.out_neighbors(rank))
    ins = list(topo.in_neighbors(rank))
    w_self = float(topo.weights[rank, rank])
    w_in = [float(topo.weights[rank, j]) for j in ins]
    # My slot on each destination: region 1 + my index among its in-neighbours.
    my_region = {d: 1 + list(topo.in_neighbors(d)).index(rank) for d in outs}

    waited = [0.0]  # seconds spent waiting for a quiet machine, this run

    def wait_quiet() -> float:
        """Waits (every rank asleep, not polling) until the machine's other work
        takes at most QUIET_CORES, or until MAX_WAIT_S of this run is spent;
        returns the load of the last look."""
        while True:
            comm.Barrier()
            busy, start = machine_busy_seconds(), time.perf_counter()
            time.sleep(0.25)
            load = (machine_busy_seconds() - busy) / (time.perf_counter() - start)
            load = comm.bcast(load, root=0)
            if load <= QUIET_CORES or waited[0] >= MAX_WAIT_S:
                return load
            waited[0] += 0.5
            time.sleep(0.25)

    def measure(fns: dict, repeats: int) -> dict:
        """Median over samples of the slowest rank's time (us), interleaved;
        with the CPU the machine's other work took meanwhile (cores)."""
        names = list(fns)
        wait_quiet()
        for _ in range(WARMUP):
            for name in names:
                fns[name]()
        comm.Barrier()
        busy, own, wall = machine_busy_seconds(), time.process_time(), time.perf_counter()
        times = np.empty((repeats, len(names)))
        for i in range(repeats):
            for k in range(len(names)):
                k = (k + i) % len(names)  # rotate the order
                fn = fns[names[k]]
                comm.Barrier()
                start = time.perf_counter()
                fn()
                times[i, k] = time.perf_counter() - start
        comm.Barrier()
        wall = time.perf_counter() - wall
        own = comm.allreduce(time.process_time() - own)  # every rank, all its threads
        foreign = max(machine_busy_seconds() - busy - own, 0.0) / wall
        slowest = np.empty_like(times)
        comm.Allreduce(times, slowest, op=MPI.MAX)
        result = {name: float(np.median(slowest[:, k]) * 1e6) for k, name in enumerate(names)}
        result["foreign_load"] = comm.bcast(foreign, root=0)
        return result

    def value(r: int, count: int) -> np.ndarray:
        return ((np.arange(count, dtype=np.float32) % 97) + r) * np.float32(1e-3)

    def machine() -> str:
        return (f"{_machine.cpu()}; "
                f"{size} ranks on one machine; "
                f"{MPI.Get_library_version().splitlines()[0].rstrip(chr(0))}; "
                f"mpi4py {__import__('mpi4py').__version__}; jax {jax.__version__}; "
                f"{source}")

    sizes = args.sizes or (SIZES[::3] if args.quick else SIZES)
    update_sum = jax.jit(lambda x, s: w_self * x + sum(w * y for w, y in zip(w_in, s)))
    scale = jax.jit(lambda v: v * 2.0)
    load_before = os.getloadavg()
    if rank == 0:
        print(f"machine: {machine()}\nexponential graph, {size} ranks: out-neighbours of "
              f"rank 0 {outs}, in-neighbours {ins}\n\n{HEADER}\n{RULE}", flush=True)
    def one_size(nbytes: int, run: int) -> dict:
        count = nbytes // 4
        x_np = value(rank, count)
        x = jnp.asarray(x_np)
        slots = [jnp.asarray(value(j, count)) for j in ins]
        name = f"bench_{nbytes}_{run}"

        # jaxfog
        W.win_create(x, name)
        put = jf.jit(lambda v: W.win_put(v, name))
        # As a training loop calls them, x = win_put(x): the argument is donated,
        # so the returned x (x itself, for self_weight 1) is the same buffer and
        # no fresh array is written (mpi4py's side writes none either).
        put_donated = jf.jit(lambda v: W.win_put(v, name), donate_argnums=0)
        acc_donated = jf.jit(lambda v: W.win_accumulate(v, name), donate_argnums=0)
        carried = {"put": jnp.array(x), "accumulate": jnp.array(x)}

        def carry(key: str, fn) -> None:
            carried[key] = fn(carried[key])
            carried[key].block_until_ready()
        upd = jf.jit(lambda v: W.win_update(v, name))
        # Diagnostics: the ops with no per-call dispatch (LOOP of them in one
        # call), and a jitted call that returns one fresh scaled copy of x.
        put_loop = jf.jit(lambda v: jax.lax.fori_loop(
            0, LOOP, lambda i, y: W.win_put(y, name), v))
        upd_loop = jf.jit(lambda v: jax.lax.fori_loop(
            0, LOOP, lambda i, y: W.win_update(y, name), v))

        # mpi4py, the same layout
        win = MPI.Win.Allocate((1 + len(ins)) * nbytes, 4, comm=comm)
        mem = np.frombuffer(win.tomemory(), dtype=np.float32)
        mem[:] = 0
        win.Lock_all(MPI.MODE_NOCHECK)  # one epoch, as jaxfog holds
        comm.Barrier()

        def base_put(accumulate: bool) -> None:
            for d in outs:
                target = (my_region[d] * count, count, MPI.FLOAT)
                if accumulate:
                    win.Accumulate(x_np, d, target=target, op=MPI.SUM)
                else:
                    win.Put(x_np, d, target=target)
                win.Flush(d)
            win.Sync()
            np.copyto(mem[:count], x_np)
            win.Sync()

        # Check that both sides move what they should before timing them.
        put(x).block_until_ready()
        base_put(False)
        comm.Barrier()
        expected = w_self * x_np + sum(w * value(j, count) for w, j in zip(w_in, ins))
        np.testing.assert_allclose(np.asarray(upd(x)), expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(update_sum(x, slots)), expected, rtol=1e-5,
                                   atol=1e-6)
        win.Sync()
        for s, j in enumerate(ins):
            np.testing.assert_array_equal(mem[(1 + s) * count:(2 + s) * count], value(j, count))
        comm.Barrier()

        fns = {
            "put_jaxfog": lambda: carry("put", put_donated),
            "put_base": lambda: base_put(False),
            "accumulate_jaxfog": lambda: carry("accumulate", acc_donated),
            "accumulate_base": lambda: base_put(True),
            "update_jaxfog": lambda: upd(x).block_until_ready(),
            "update_base": lambda: update_sum(x, slots).block_until_ready(),
            "scale_jit": lambda: scale(x).block_until_ready(),
        }
        if nbytes <= LOOP_MAX_BYTES:  # where dispatch matters; costly beyond
            fns["put_loop"] = lambda: put_loop(x).block_until_ready()
            fns["update_loop"] = lambda: upd_loop(x).block_until_ready()
        times = measure(fns, repeats_for(nbytes))
        for key in ("put_loop", "update_loop"):
            if key in times:
                times[key] /= LOOP
        comm.Barrier()
        win.Unlock_all()
        win.Free()
        W.win_free(name)
        return times

    passes = []
    for run in range(PASSES):
        if rank == 0:
            print(f"pass {run + 1} of {PASSES}", flush=True)
        times = {}
        for nbytes in sizes:
            times[nbytes] = one_size(nbytes, run)
            if rank == 0:
                print(format_row({"bytes": nbytes, **times[nbytes]}), flush=True)
        passes.append(times)
    rows = [combine(nbytes, [p[nbytes] for p in passes]) for nbytes in sizes]
    if rank == 0:
        print(f"\nmedian of {PASSES} passes\n{HEADER}\n{RULE}\n"
              + "\n".join(format_row(r) for r in rows)
              + f"\n\n{DIAG_HEADER}\n{DIAG_RULE}\n" + "\n".join(diag_row(r) for r in rows),
              flush=True)
    shared = shared_memory(comm, MPI, sizes, measure) if size == 2 else []

    def jaxfog_put(nbytes: int):
        name = f"busy_{nbytes}"
        x = jnp.ones(nbytes // 4, jnp.float32)
        W.win_create(x, name)
        put = jf.jit(lambda v: W.win_put(v, name))
        return (lambda: put(x).block_until_ready()), (lambda: W.win_free(name))

    busy = target_busy(comm, MPI, jaxfog_put) if size == 2 else []
    if rank == 0 and busy:
        print("\n" + "\n".join(busy_text(busy)), flush=True)
    if rank != 0:
        return
    lines = [f"# One-sided windows, {size} ranks", "", f"Machine: {machine()}", "",
             f"Topology: jaxfog's default exponential graph on {size} ranks (rank 0 puts "
             f"to {outs}); float32 arrays. Each cell: the median of up to {PASSES} passes' "
             "medians over samples (30 to 200 per pass by size, after a warm-up) of the "
             "slowest rank's time for one blocking call; the ranks meet at a barrier "
             "before every sample and the functions of a size (six compared, up to three "
             "diagnostic) are interleaved sample "
             f"by sample. {LOAD_NOTE} Load average (1 min) before / after the run: "
             f"{load_before[0]:.2f} / {os.getloadavg()[0]:.2f}; waited {waited[0]:.0f} s "
             "for a quiet machine"
             + (f"; {size} ranks on {os.cpu_count()} cores: oversubscribed, every wait "
                "is also a wait for the scheduler" if size > (os.cpu_count() or 1) else "")
             + ".", "",
             f"Baseline for put/accumulate: {BASELINE}", "",
             "Baseline for win_update: `jax.jit(lambda x, s: w0 * x + sum_j w_j * s[j])` on "
             "local arrays of the same size (the topology's row of W); jaxfog: "
             "`jaxfog.jit(lambda x: win_update(x, name))` (default weights: the same row), "
             "which also takes an exclusive self-lock, syncs twice and copies the result "
             "into the published region.", "",
             "Targets (issue 11): put/accumulate at most 1.25x mpi4py at >= 64 KB, at most "
             "mpi4py + 30 us below; win_update at most 1.25x the jitted sum.", "",
             HEADER, RULE] + [format_row(r) for r in rows]
    passed = sum(cell.count("pass") for cell in lines[-len(rows):])
    failed = sum(cell.count("FAIL") for cell in lines[-len(rows):])
    lines += ["", f"{passed} targets met, {failed} missed.", "",
              "## Where the time goes (diagnostics, same runs)", "",
              f"per op in loop: `jaxfog.jit` of a `lax.fori_loop` of {LOOP} ops, divided "
              f"by {LOOP} (no per-call JAX dispatch; up to {human(LOOP_MAX_BYTES)}); "
              "`jax.jit(v * 2)`: a jitted call that "
              "returns one fresh scaled copy of x (JAX's dispatch plus one pass over the "
              "data, what producing win_put's returned `self_weight * x` costs at least).",
              "", DIAG_HEADER, DIAG_RULE] + [diag_row(r) for r in rows]
    text = "\n".join(lines) + "\n"
    if not args.quick and not args.sizes:
        RESULTS.mkdir(parents=True, exist_ok=True)
        stem = RESULTS / f"window_{size}ranks"
        stem.with_suffix(".md").write_text(text)
        stem.with_suffix(".json").write_text(json.dumps(
            {"machine": machine(), "baseline": BASELINE, "passes": PASSES,
             "loadavg_before_after": [load_before[0], os.getloadavg()[0]],
             "waited_for_quiet_s": waited[0], "quiet_cores": QUIET_CORES, "rows": rows,
             "shared_memory": shared, "target_busy": busy}, indent=1))
        print(f"wrote {stem}.md/.json", flush=True)
        if shared:
            (RESULTS / "window_shared_memory.md").write_text(shared_text(shared, busy, machine()))
            print(f"wrote {RESULTS / 'window_shared_memory.md'}", flush=True)


HEADER = ("| size | put jaxfog (us) | put mpi4py (us) | ratio | target | "
          "accumulate jaxfog (us) | accumulate mpi4py (us) | ratio | target | "
          "update jaxfog (us) | jitted sum (us) | ratio | target | other load (cores) |")
RULE = "|---" * 14 + "|"


def combine(nbytes: int, passes: list[dict]) -> dict:
    """A row: per column the median of the quiet passes' medians; every pass's
    values are kept in the row too."""
    loads = [p["foreign_load"] for p in passes]
    kept = [i for i, load in enumerate(loads) if load <= QUIET_CORES] or [int(np.argmin(loads))]
    row = {"bytes": nbytes, "repeats_per_pass": repeats_for(nbytes),
           "passes_used": kept, "foreign_load": max(loads[i] for i in kept)}
    for key in passes[0]:
        values = [p[key] for p in passes]
        if key != "foreign_load":
            row[key] = float(np.median([values[i] for i in kept]))
        row[f"{key}_passes"] = values
    return row


def put_verdict(ours: float, theirs: float, nbytes: int) -> str:
    if nbytes >= PUT_LARGE_BYTES:
        return "pass" if ours <= PUT_RATIO * theirs else f"FAIL (> {PUT_RATIO}x)"
    return ("pass" if ours <= theirs + PUT_SMALL_US
            else f"FAIL (+{ours - theirs:.0f} us > {PUT_SMALL_US:.0f})")


def format_row(row: dict) -> str:
    cells = [human(row["bytes"])]
    for key in ("put", "accumulate"):
        ours, theirs = row[f"{key}_jaxfog"], row[f"{key}_base"]
        cells += [f"{ours:.1f}", f"{theirs:.1f}", f"{ours / theirs:.2f}",
                  put_verdict(ours, theirs, row["bytes"])]
    ours, theirs = row["update_jaxfog"], row["update_base"]
    cells += [f"{ours:.1f}", f"{theirs:.1f}", f"{ours / theirs:.2f}",
              "pass" if ours <= UPDATE_RATIO * theirs else f"FAIL (> {UPDATE_RATIO}x)",
              load_cell(row)]
    return "| " + " | ".join(cells) + " |"


DIAG_HEADER = ("| size | put jaxfog (us) | put per op in loop (us) | put mpi4py (us) | "
               "jax.jit(v * 2) (us) | update jaxfog (us) | update per op in loop (us) | "
               "jitted sum (us) |")
DIAG_RULE = "|---" * 8 + "|"


def diag_row(row: dict) -> str:
    keys = ("put_jaxfog", "put_loop", "put_base", "scale_jit", "update_jaxfog",
            "update_loop", "update_base")
    return (f"| {human(row['bytes'])} | "
            + " | ".join(f"{row[k]:.1f}" if k in row else "-" for k in keys) + " |")


def load_cell(row: dict) -> str:
    """The other work's load during the block (cores), and which passes made the cell."""
    text = f"{row['foreign_load']:.2f}"
    if "passes_used" in row:
        text += f" (passes {','.join(str(i + 1) for i in row['passes_used'])})"
    return text


# --- shared-memory windows (2 ranks, mpi4py only) -----------------------------

def shared_memory(comm, MPI, sizes, measure) -> list[dict]:
    """(a) Win.Allocate + Lock/Put/Unlock to the peer, against (b)
    Win.Allocate_shared + Shared_query + Lock/numpy copy/Sync/Unlock; for
    reference (c) Lock/Put/Unlock on the shared window, and with one
    Lock_all(MODE_NOCHECK) epoch held from creation instead of a lock per op:
    (d) Win.Allocate + Put/Flush, (e) Win.Allocate_shared + copy/Sync."""
    rank = comm.Get_rank()
    peer = 1 - rank
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    assert node.Get_size() == 2, "the shared-memory comparison needs both ranks on one node"

    def one_size(nbytes: int) -> dict:
        count = nbytes // 4
        x = np.full(count, rank + 1, np.float32)
        fns, wins = shared_variants(node, MPI, peer, x)
        own_mem = np.frombuffer(wins[1].tomemory(), dtype=np.float32)[:count]
        fns["shared_copy"]()
        node.Barrier()
        wins[1].Lock(rank, MPI.LOCK_SHARED)
        wins[1].Sync()
        assert own_mem[0] == peer + 1 and own_mem[-1] == peer + 1
        wins[1].Unlock(rank)
        node.Barrier()
        times = measure(fns, repeats_for(nbytes))
        free_variants(node, wins)
        return times

    passes = []
    for run in range(PASSES):
        if rank == 0:
            print(f"\nshared-memory windows, 2 ranks, pass {run + 1} of {PASSES}\n"
                  f"{SHARED_HEADER}\n{SHARED_RULE}", flush=True)
        times = {}
        for nbytes in sizes:
            times[nbytes] = one_size(nbytes)
            if rank == 0:
                print(shared_row({"bytes": nbytes, **times[nbytes]}), flush=True)
        passes.append(times)
    node.Free()
    rows = [combine(nbytes, [p[nbytes] for p in passes]) for nbytes in sizes]
    if rank == 0:
        print(f"\nmedian of {PASSES} passes\n{SHARED_HEADER}\n{SHARED_RULE}\n"
              + "\n".join(shared_row(r) for r in rows), flush=True)
    return rows


def shared_variants(comm, MPI, peer: int, x: np.ndarray) -> tuple[dict, list]:
    """The five ways of writing x into the peer's window, and their windows
    (to free with free_variants)."""
    count, nbytes = x.size, x.nbytes
    plain = MPI.Win.Allocate(nbytes, 4, comm=comm)
    shared = MPI.Win.Allocate_shared(nbytes, 4, comm=comm)
    plain_all = MPI.Win.Allocate(nbytes, 4, comm=comm)
    shared_all = MPI.Win.Allocate_shared(nbytes, 4, comm=comm)
    plain_all.Lock_all(MPI.MODE_NOCHECK)
    shared_all.Lock_all(MPI.MODE_NOCHECK)
    peer_mem = np.frombuffer(shared.Shared_query(peer)[0], dtype=np.float32)[:count]
    peer_all = np.frombuffer(shared_all.Shared_query(peer)[0], dtype=np.float32)[:count]
    target = (0, count, MPI.FLOAT)
    comm.Barrier()

    def allocate_put():
        plain.Lock(peer, MPI.LOCK_SHARED)
        plain.Put(x, peer, target=target)
        plain.Unlock(peer)

    def shared_copy():
        shared.Lock(peer, MPI.LOCK_SHARED)
        np.copyto(peer_mem, x)
        shared.Sync()
        shared.Unlock(peer)

    def shared_put():
        shared.Lock(peer, MPI.LOCK_SHARED)
        shared.Put(x, peer, target=target)
        shared.Unlock(peer)

    def allocate_lock_all_put():
        plain_all.Put(x, peer, target=target)
        plain_all.Flush(peer)

    def shared_lock_all_copy():
        np.copyto(peer_all, x)
        shared_all.Sync()

    fns = {"allocate_put": allocate_put, "shared_copy": shared_copy, "shared_put": shared_put,
           "allocate_lock_all_put": allocate_lock_all_put,
           "shared_lock_all_copy": shared_lock_all_copy}
    return fns, [plain, shared, plain_all, shared_all]


def free_variants(comm, wins: list) -> None:
    comm.Barrier()
    wins[2].Unlock_all()
    wins[3].Unlock_all()
    for win in wins:
        win.Free()


BUSY_US = 1000
BUSY_SIZES = [4 << 10, 64 << 10, 1 << 20]


def target_busy(comm, MPI, jaxfog_put) -> list[dict]:
    """Does a write into the peer's window wait for the peer to enter MPI?
    Rank 1 computes BUSY_US outside MPI (or waits in a barrier) while rank 0
    times one write into rank 1's window: each variant of shared_variants,
    and jaxfog's win_put (``jaxfog_put(nbytes)`` returns the call and what
    frees its window, collectively)."""
    rank = comm.Get_rank()
    rows = []
    for nbytes in BUSY_SIZES:
        x = np.ones(nbytes // 4, np.float32)
        fns, wins = shared_variants(comm, MPI, 1 - rank, x)
        fns["jaxfog_put"], jaxfog_free = jaxfog_put(nbytes)
        row = {"bytes": nbytes}
        for name, fn in fns.items():
            for busy in (0, BUSY_US):
                times = []
                for i in range(40):
                    comm.Barrier()
                    if rank == 1:
                        start = time.perf_counter()
                        while time.perf_counter() - start < busy * 1e-6:
                            pass
                    else:
                        start = time.perf_counter()
                        fn()
                        times.append(time.perf_counter() - start)
                    comm.Barrier()
                if rank == 0:
                    row[f"{name}_{'busy' if busy else 'idle'}"] = float(
                        np.median(times[10:]) * 1e6)
        free_variants(comm, wins)
        jaxfog_free()
        rows.append(row)
    return rows


BUSY_NAMES = (("allocate_put", "(a) Win.Allocate, Lock/Put/Unlock"),
              ("shared_copy", "(b) Win.Allocate_shared, Lock/copy/Sync/Unlock"),
              ("shared_put", "(c) Win.Allocate_shared, Lock/Put/Unlock"),
              ("allocate_lock_all_put", "(d) Win.Allocate + Lock_all once, Put/Flush"),
              ("shared_lock_all_copy", "(e) Win.Allocate_shared + Lock_all once, copy/Sync"),
              ("jaxfog_put", "jaxfog win_put (jaxfog.jit, 1 destination)"))


def busy_text(rows: list[dict]) -> list[str]:
    lines = ["| write into the peer's window | "
             + " | ".join(f"{human(r['bytes'])}, peer in MPI (us) | {human(r['bytes'])}, "
                          f"peer computing {BUSY_US} us (us)" for r in rows) + " |",
             "|---" * (1 + 2 * len(rows)) + "|"]
    for key, label in BUSY_NAMES:
        lines.append(f"| {label} | " + " | ".join(
            f"{r[key + '_idle']:.1f} | {r[key + '_busy']:.1f}" for r in rows) + " |")
    return lines


SHARED_HEADER = ("| size | (a) Win.Allocate, Lock/Put/Unlock (us) | (b) Win.Allocate_shared, "
                 "Lock/copy/Sync/Unlock (us) | (b) / (a) | (c) Win.Allocate_shared, "
                 "Lock/Put/Unlock (us) | (d) Win.Allocate + Lock_all, Put/Flush (us) | "
                 "(e) Win.Allocate_shared + Lock_all, copy/Sync (us) | (e) / (d) | "
                 "other load (cores) |")
SHARED_RULE = "|---" * 9 + "|"


def shared_row(row: dict) -> str:
    a, b, c = row["allocate_put"], row["shared_copy"], row["shared_put"]
    d, e = row["allocate_lock_all_put"], row["shared_lock_all_copy"]
    return (f"| {human(row['bytes'])} | {a:.1f} | {b:.1f} | {b / a:.2f} | {c:.1f} | "
            f"{d:.1f} | {e:.1f} | {e / d:.2f} | {load_cell(row)} |")


def shared_text(rows: list[dict], busy: list[dict], machine: str) -> str:
    lines = ["# Shared-memory windows, 2 ranks on one node (mpi4py only)", "",
             f"Machine: {machine}", "",
             "Should jaxfog allocate its windows with `MPI_Win_allocate_shared` for ranks "
             "on the same node? Each rank writes a float32 array into its peer's window:",
             "",
             "* (a) `Win.Allocate`; `Lock(peer, LOCK_SHARED)`, `Put`, `Unlock(peer)` "
             "(what jaxfog does now);",
             "* (b) `Win.Allocate_shared`, `Shared_query(peer)` once for the peer's "
             "segment; `Lock(peer, LOCK_SHARED)`, numpy copy into the segment, `Sync`, "
             "`Unlock(peer)`;",
             "* (c) `Win.Allocate_shared`; `Lock(peer, LOCK_SHARED)`, `Put`, `Unlock(peer)` "
             "(MPI's put on a shared window, for reference);",
             "* (d) `Win.Allocate` with one `Lock_all(MODE_NOCHECK)` epoch opened at "
             "creation and held; per write `Put`, `Flush(peer)` (no lock per op);",
             "* (e) `Win.Allocate_shared` with one `Lock_all(MODE_NOCHECK)` epoch held; per "
             "write numpy copy into the peer's segment, `Sync`.", "",
             f"Each cell: the median of up to {PASSES} passes' medians over samples (30 to "
             "200 per pass by size, after a warm-up) of the slower rank's time; both ranks "
             "write at once (each into the other), a barrier before every sample; (a) to "
             f"(e) interleaved sample by sample. {LOAD_NOTE}", "",
             SHARED_HEADER, SHARED_RULE] + [shared_row(r) for r in rows]
    lines += ["", "## Does a write wait for the peer to enter MPI?", "",
              f"Rank 1 either waits in a barrier (in MPI) or computes {BUSY_US} us outside "
              "MPI (a Python busy loop) while rank 0 times one write into rank 1's window; "
              "median of 30 samples after 10 discarded. A write that takes the peer's "
              f"~{BUSY_US} us waits for the peer's MPI progress (a lock request the target "
              "must serve), so it is not one-sided in practice.", ""] + busy_text(busy)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, no files (smoke run)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4],
                        help="rank counts to launch (default: 2 4)")
    parser.add_argument("--worker", action="store_true",
                        help="run as one rank (the script launches these itself)")
    parser.add_argument("--sizes", type=int, nargs="+",
                        help="array sizes in bytes (a partial run: no files written)")
    parser.add_argument("--plot-only", action="store_true",
                        help="redraw results/window.png from the JSON files")
    args = parser.parse_args()
    if args.worker:
        worker(args)
    elif args.plot_only:
        plot(RESULTS / "window.png")
    else:
        extra = (["--quick"] if args.quick else []) + (
            ["--sizes", *map(str, args.sizes)] if args.sizes else [])
        launch(args.ranks, extra)


if __name__ == "__main__":
    main()
