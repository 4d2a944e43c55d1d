"""How long a process that used jaxfog takes to exit, phase by phase.

    python scripts/exit_probe.py [--platform cpu|cuda] [--ranks N] [--limit S]

Starts one process (or ``jaxfog run -np N``) that initialises jaxfog, runs
ops (jitted neighbour averages, an allreduce, a window, a simulated step),
leaves one computation dispatched but not waited for, and returns. Each rank
stamps the exit phases on stderr through ``atexit`` hooks placed between the
hooks of jaxfog and JAX (atexit runs them last registered first):

* ``atexit-start``: Python began its exit;
* ``jaxfog-shutdown-done``: ``jaxfog.shutdown`` waited for dispatched
  communication and freed the communicators (NCCL: fence, then destroy);
* ``python-atexit-done``: JAX's own hooks ran too (its backends, hence the
  GPU client, torn down; ``jax.distributed`` shut down);
* the process end, seen here: C-level exit handlers (mpi4py's
  ``MPI_Finalize``), native threads, the CUDA driver.

Prints a table and exits 1 when a rank took more than ``--limit`` seconds from
its last op to the end of the launch. ``scripts/gpu_check.sh`` runs it on the
GPU (stage ``exit``); ``tests/gpu/test_gpu_check_script.py`` runs it on the CPU.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time

MARK = "exit-probe"
PHASES = ("ops-done", "atexit-start", "jaxfog-shutdown-done", "python-atexit-done")


def _say(line: str) -> None:
    # One write per line: mpiexec merges the ranks' output, print() may split it.
    os.write(2, (line + "\n").encode())


def _mark(rank: str, what: str) -> None:
    _say(f"{MARK} {rank} {what} {time.time():.4f}")


def body() -> None:
    """One rank: use jaxfog, stamp the phases of the exit."""
    import atexit

    rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    atexit.register(_mark, rank, "python-atexit-done")  # first registered: runs last
    import jax
    import jax.numpy as jnp
    import numpy as np

    # After JAX's hooks (registered at its import), before jaxfog's (registered by init).
    atexit.register(_mark, rank, "jaxfog-shutdown-done")
    import jaxfog as jf

    jf.init()
    x = jnp.arange(1 << 16, dtype=jnp.float32) + jf.rank()
    mix = jf.jit(lambda v: jf.neighbor_allreduce(v))
    mean = jf.jit(lambda v: jf.allreduce(v))
    for _ in range(5):
        x = mix(x)
    jax.block_until_ready(mean(x))
    jf.win_create(x, "exit_probe")
    y = jf.win_update(jf.win_put(x, "exit_probe"), "exit_probe")
    jf.barrier()
    jf.win_free("exit_probe")
    topo = jf.topology.ring(4)
    stacked = jnp.ones((4, 8)) * jnp.arange(4.0)[:, None]
    np.testing.assert_allclose(jf.simulate(jf.neighbor_allreduce, topo)(stacked),
                               topo.weights @ np.asarray(stacked), rtol=1e-6)
    mix(y)  # dispatched, not waited for: shutdown must wait for its communication
    _mark(rank, "ops-done")
    atexit.register(_mark, rank, "atexit-start")  # last registered: runs first
    _say(f"{MARK} {rank} platform {x.devices().pop().platform} "
         f"gpu_backend {jf.runtime.gpu_backend()}")


def measure(ranks: int = 1, platform: str = "cpu", timeout: float = 300,
            env: dict | None = None) -> dict:
    """Runs the probe; returns {"rc", "ended", "ranks": {rank: {phase: time}}, "output"}."""
    command = [sys.executable, os.path.abspath(__file__), "--body"]
    if ranks > 1:
        command = [sys.executable, "-m", "jaxfog.cli", "run", "-np", str(ranks), *command]
    full_env = {**os.environ, "JAX_PLATFORMS": platform, "XLA_PYTHON_CLIENT_PREALLOCATE":
                "false", "JAXFOG_TIMEOUT": "60", **(env or {})}
    # A session of its own: a timeout ends mpiexec's ranks too, not only the launcher.
    process = subprocess.Popen(command, env=full_env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
    ended = time.time()
    marks: dict[str, dict[str, float]] = {}
    for rank, what, when in re.findall(rf"^{MARK} (\S+) (\S+) ([0-9.]+)$", output, re.M):
        marks.setdefault(rank, {})[what] = float(when)
    return {"rc": process.returncode, "ended": ended, "ranks": marks, "output": output}


def report(result: dict) -> tuple[list[str], float]:
    """Table lines and the worst seconds from a rank's last op to the launch's end."""
    lines = ["| rank | jaxfog.shutdown (s) | JAX atexit (s) | after atexit to exit (s) | "
             "last op to exit (s) |", "|---|---|---|---|---|"]
    worst = float("inf") if not result["ranks"] else 0.0
    for rank, m in sorted(result["ranks"].items()):
        def span(a, b):
            return f"{b - a:.2f}" if a is not None and b is not None else "?"
        stamps = [m.get(p) for p in PHASES] + [result["ended"]]
        total = result["ended"] - m["ops-done"] if "ops-done" in m else float("inf")
        worst = max(worst, total if all(s is not None for s in stamps) else float("inf"))
        lines.append(f"| {rank} | {span(stamps[1], stamps[2])} | {span(stamps[2], stamps[3])} "
                     f"| {span(stamps[3], stamps[4])} | {total:.2f} |")
    return lines, worst


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--platform", default="cpu", help="JAX_PLATFORMS of the probe")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--limit", type=float, default=10.0,
                        help="seconds allowed from the last op to the end of the launch")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--body", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.body:
        body()
        return 0
    result = measure(args.ranks, args.platform, args.timeout)
    lines, worst = report(result)
    print(f"exit probe: {args.ranks} rank(s) on {args.platform}, exit status {result['rc']}")
    print("\n".join(lines))
    if result["rc"] != 0 or worst > args.limit:
        print(f"FAILED: exit status {result['rc']}, {worst:.2f} s from the last op to the "
              f"end (limit {args.limit} s); output:\n{result['output'][-4000:]}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
