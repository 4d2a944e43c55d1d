"""The GPU benchmarks (issue 14), run by ``scripts/gpu_check.sh`` on the GPU machine.

    python benchmarks/bench_gpu.py [--out benchmarks/results] [--part simulate|exchange|dispatch]
                                   [--short] [--platform cuda|cpu] [--sizes BYTES...]

1. The simulation backend on the GPU: ``bench_simulate.py`` with n = 16 to
   1024 agents and d = 1e4 to 1e7, each row on today's gather path and on the
   column-tiled Pallas kernel (``JAXFOG_SIM_MIXING``, issue 45), against a
   jitted device copy (the one-read-one-write bound) and dense ``W @ X`` in the
   same run; the exponential graph and the ring, and with the full grid also
   a one-peer schedule entry and a random regular graph of degree 4.
2. Exchange bandwidth, 1 KB to 256 MB per message: NCCL and host-staged MPI
   (``jaxfog.allgather`` and, with two or more ranks, ``neighbor_allgather``)
   against a jitted device copy and a host round trip (device to pinned host
   memory and back) of the same bytes, all in one run (``exchange_gpu.md``);
   the host-staged allgather against its floor, each part on pinned host
   buffers as jaxfog's staging uses (``cudaHostAlloc``, jaxfog/ffi/cuda_copier.cc).
3. The dispatch figure of the fast-path issue on GPU: ``bench_dispatch.py``.

``--short`` is the GPU check's cut (scripts/gpu_check.sh: fewer agents, dims and
message sizes, fewer dispatch repeats). ``--platform cpu --sizes ...`` runs the
exchange part on CPU arrays over MPI (the floor included), and ``--platform cpu
--part simulate`` the simulate part on 5 agents x 1e3 values (the tiled kernel
in Pallas' interpreter), so both are tested where there is no GPU
(tests/gpu/test_bench_gpu.py).

Each part runs as its own process so that one failure does not hide the rest;
``--part`` runs one (``scripts/gpu_check.sh`` gives each its own device call).
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

HERE = Path(__file__).resolve().parent
SIZES = [2 ** k for k in range(10, 29, 2)]  # 1 KB .. 256 MB
SHORT_SIZES = [2 ** k for k in range(12, 27, 4)]  # 4 KB .. 64 MB


def _median(fn, repeats: int = 9) -> float:
    import jax

    for _ in range(2):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def exchange_body(out: str, sizes: list[int]) -> None:
    """On every rank (launched by ``jaxfog run``): times each path per size;
    rank 0 writes the rows."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    import jaxfog as jf

    jf.init()
    device = jax.devices()[0]  # this rank's (jaxfog run gives each its own GPU)
    on_device = SingleDeviceSharding(device)
    # Page-locked host memory, as staging's: pageable copies ran at a fraction
    # of the link's rate on the H200 (device to host of 256 MB: 188 ms), so a
    # floor of pageable copies said nothing about staging.
    pinned = SingleDeviceSharding(device, memory_kind="pinned_host")
    rows = []
    for nbytes in sizes:
        x = jnp.zeros(nbytes // 4, jnp.float32) + jf.rank()
        copy = jax.jit(lambda v: v * 1.0)
        row = {"bytes": nbytes, "backend": jf.runtime.gpu_backend() or device.platform,
               "ranks": jf.size(), "copy_ms": _median(lambda: copy(x)) * 1e3,
               "host_memory": jax.device_put(x, pinned).sharding.memory_kind,
               "host_round_trip_ms": _median(
                   lambda: jax.device_put(jax.device_put(x, pinned), on_device)) * 1e3}
        gather = jf.jit(lambda v: jf.allgather(v))
        row["allgather_ms"] = _median(lambda: gather(x)) * 1e3
        if jf.size() > 1:
            neighbors = jf.jit(lambda v: jf.neighbor_allgather(v))
            row["neighbor_allgather_ms"] = _median(lambda: neighbors(x)) * 1e3
        if row["backend"] != "nccl":  # staged (on CPU arrays: MPI's own path)
            row.update(_staging_floor(x, pinned, on_device))
        rows.append(row)
    if jf.rank() == 0:
        Path(out).write_text(json.dumps(rows))


def _staging_floor(x, pinned, on_device) -> dict:
    """The three parts a host-staged allgather cannot avoid, each timed alone:
    device to pinned host memory, MPI's allgather of host buffers, pinned host
    to device of the gathered bytes."""
    import jax
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    host = np.asarray(x)
    # Kept between calls and written once, as staging's pooled buffers are:
    # MPI copies these with the CPU, which runs as fast on pageable pages once
    # they are mapped; a fresh 256 MB output paid its page faults every call.
    gathered = np.zeros((comm.size, *host.shape), host.dtype)
    gathered_pinned = jax.device_put(gathered, pinned)

    def mpi_allgather():
        comm.Allgather(host, gathered)
        return gathered

    return {"d2h_ms": _median(lambda: jax.device_put(x, pinned)) * 1e3,
            "host_allgather_ms": _median(mpi_allgather) * 1e3,
            "h2d_ms": _median(lambda: jax.device_put(gathered_pinned, on_device)) * 1e3}


def _launch(nprocs: int, env: dict, out: Path, platform: str, sizes: list[int]) -> list[dict]:
    command = [sys.executable, "-m", "jaxfog.cli", "run", "-np", str(nprocs), sys.executable,
               __file__, "--exchange-body", str(out), "--sizes", *map(str, sizes)]
    done = subprocess.run(command, env={**os.environ, "JAX_PLATFORMS": platform, **env},
                          timeout=600, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        print(f"exchange {env} x{nprocs} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        return []
    return json.loads(out.read_text())


def exchange(out_dir: Path, platform: str, sizes: list[int]) -> None:
    rows = []
    launches = [(2, {"JAXFOG_BACKEND": "mpi"}), (4, {"JAXFOG_BACKEND": "mpi"})]
    if platform == "cuda":
        import jax

        # NCCL takes one rank per GPU: two ranks only where there are two GPUs.
        nccl_ranks = (1, 2) if jax.device_count("gpu") > 1 else (1,)
        launches = [(n, {"JAXFOG_BACKEND": "nccl"}) for n in nccl_ranks] + launches
    else:  # the CPU check of this code: MPI only, the smaller launch
        launches = launches[:1]
    for nprocs, env in launches:
        rows += _launch(nprocs, env, out_dir / f"exchange_{nprocs}_{env['JAXFOG_BACKEND']}.json",
                        platform, sizes)
    header = ("| backend | ranks | bytes | device copy (ms) | host round trip, pinned (ms) | "
              "allgather (ms) | neighbor_allgather (ms) | allgather GB/s |")
    lines = ["# Exchange on GPU arrays: NCCL and host-staged MPI", "",
             "Medians of 9 blocking calls (jaxfog.jit); host-staged ranks share the GPUs. "
             "Host round trip: device to pinned host memory and back.",
             "", header,
             "|---" * 8 + "|"]
    for r in rows:
        neighbor = r.get("neighbor_allgather_ms")
        lines.append(f"| {r['backend']} | {r['ranks']} | {r['bytes']} | {r['copy_ms']:.3f} | "
                     f"{r['host_round_trip_ms']:.3f} | {r['allgather_ms']:.3f} | "
                     f"{'' if neighbor is None else f'{neighbor:.3f}'} | "
                     f"{r['bytes'] * r['ranks'] / r['allgather_ms'] / 1e6:.2f} |")
    staged = [r for r in rows if "d2h_ms" in r]
    if staged:
        lines += ["", "Host-staged allgather against its floor: device-to-host copy into "
                  "pinned memory + MPI's allgather of host buffers (mpi4py, buffers kept "
                  "between calls, as staging's pool keeps its own) + host-to-device copy of "
                  "the result from pinned memory, each timed alone in the same run.", "",
                  "| ranks | bytes | D2H pinned (ms) | MPI on host (ms) | H2D pinned (ms) | "
                  "floor (ms) | staged allgather (ms) | staged / floor |", "|---" * 8 + "|"]
        for r in staged:
            floor = r["d2h_ms"] + r["host_allgather_ms"] + r["h2d_ms"]
            lines.append(f"| {r['ranks']} | {r['bytes']} | {r['d2h_ms']:.3f} | "
                         f"{r['host_allgather_ms']:.3f} | {r['h2d_ms']:.3f} | {floor:.3f} | "
                         f"{r['allgather_ms']:.3f} | {r['allgather_ms'] / floor:.2f} |")
    (out_dir / "exchange_gpu.md").write_text("\n".join(lines) + "\n")
    (out_dir / "exchange_gpu.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--part", choices=("all", "simulate", "exchange", "dispatch"),
                        default="all")
    parser.add_argument("--short", action="store_true",
                        help="the GPU check's shorter grids (scripts/gpu_check.sh)")
    parser.add_argument("--platform", choices=("cuda", "cpu"), default="cuda",
                        help="the exchange part's arrays (cpu: a check of this code); cpu "
                             "also cuts the simulate part to 5 agents x 1e3 values, the "
                             "tiled kernel in Pallas' interpreter")
    parser.add_argument("--sizes", type=int, nargs="+",
                        help="exchange message sizes in bytes (multiples of 4)")
    parser.add_argument("--exchange-body", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = args.sizes or (SHORT_SIZES if args.short else SIZES)
    if args.exchange_body:
        exchange_body(args.exchange_body, sizes)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    if args.part in ("all", "simulate"):
        grid = (["--agents", "5", "--dims", "1e3", "--paths", "gather", "tiled", "--graphs",
                 "exponential", "ring", "one-peer", "regular4"] if args.platform == "cpu" else
                ["--agents", "16", "128", "1024", "--dims", "1e4", "1e6", "1e7",
                 "--max-elements", "1.1e9"] if args.short else
                ["--agents", "16", "32", "64", "128", "256", "512", "1024",
                 "--dims", "1e4", "1e5", "1e6", "1e7", "--max-elements", "2.6e9",
                 "--graphs", "exponential", "ring", "one-peer", "regular4"])
        env = dict(os.environ, **({"JAX_PLATFORMS": "cpu"} if args.platform == "cpu" else {}))
        failed |= subprocess.run([sys.executable, str(HERE / "bench_simulate.py"),
                                  *grid, "--out", str(out)], env=env).returncode
    if args.part in ("all", "exchange"):
        exchange(out, args.platform, sizes)
    if args.part in ("all", "dispatch"):
        failed |= subprocess.run([sys.executable, "-m", "jaxfog.cli", "run", "-np", "2",
                                  sys.executable, str(HERE / "bench_dispatch.py"),
                                  *(["--repeats", "300"] if args.short else [])]).returncode
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
