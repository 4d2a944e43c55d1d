"""The ``jaxfog`` command: ``run``, ``exec``, ``info``, ``demo``, ``timeline``."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Sequence

import jaxfog
from jaxfog import ffi, timeline
from jaxfog.cli import _demo, _launcher


# Options of `jaxfog run` that take a value; everything else starting with "-"
# before the command is handed to mpiexec.
_RUN_VALUE_OPTIONS = ("-np", "-n", "-H", "--hosts", "--hostfile", "--mpi-args",
                      "--max-restarts", "--min-np", "--host-discovery-script")
_RUN_FLAGS = ("--dry-run", "--rank-prefix", "-h", "--help")


def split_run_argv(argv: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """Splits ``jaxfog run``'s arguments into (its options, mpiexec's, the command).

    The command starts after ``--`` or at the first word that is neither an
    option nor an option's value. Unknown options before it go to mpiexec; one
    that takes a value must then be written ``--opt=value``, passed with
    ``--mpi-args``, or placed before ``--``.
    """
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        head, command = argv[:cut], argv[cut + 1:]
    else:
        head, command = argv, []
    ours: list[str] = []
    passthrough: list[str] = []
    i = 0
    while i < len(head):
        word = head[i]
        if word in _RUN_VALUE_OPTIONS:
            ours += head[i:i + 2]
            i += 2
        elif word.split("=")[0] in _RUN_VALUE_OPTIONS or word in _RUN_FLAGS:
            ours.append(word)
            i += 1
        elif word.startswith("-"):
            passthrough.append(word)
            i += 1
        elif "--" in argv:  # a value of an mpiexec option, e.g. "--bind-to core --"
            passthrough.append(word)
            i += 1
        else:
            command = head[i:]
            break
    return ours, passthrough, command


def _run(argv: Sequence[str]) -> int:
    ours, passthrough, command = split_run_argv(argv)
    args = _run_parser().parse_args(ours)
    try:
        if args.max_restarts is not None or args.host_discovery_script:
            return _launcher.run_elastic(
                command, args.np, max_restarts=args.max_restarts or 0,
                min_np=args.min_np or 1, hosts=args.hosts, hostfile=args.hostfile,
                discovery_script=args.host_discovery_script,
                mpi_args=passthrough + shlex.split(args.mpi_args or ""),
                rank_prefix=args.rank_prefix, dry_run=args.dry_run)
        if args.min_np is not None:
            raise ValueError("--min-np is for elastic runs: give --max-restarts too")
        return _launcher.run(command, args.np, hosts=args.hosts, hostfile=args.hostfile,
                            mpi_args=passthrough + shlex.split(args.mpi_args or ""),
                            dry_run=args.dry_run, rank_prefix=args.rank_prefix)
    except (ValueError, FileNotFoundError) as err:
        print(f"jaxfog run: {err}", file=sys.stderr)
        return 2


def _run_parser() -> argparse.ArgumentParser:
    run = argparse.ArgumentParser(
        prog="jaxfog run",
        usage="jaxfog run -np N [-H host:slots,...] [--hostfile F] [mpiexec options] "
              "[--] COMMAND [ARGS...]",
        description="Launch COMMAND on N ranks with the installed MPI's mpiexec "
                    "(MPICH/hydra or Open MPI), forwarding the environment, one GPU per "
                    "local rank when GPUs exist, and one XLA CPU thread per rank when "
                    "ranks outnumber cores. Other options before COMMAND go to mpiexec "
                    "(write a valued one as --opt=value, or put all mpiexec options "
                    "before a '--').")
    run.add_argument("-np", "-n", dest="np", type=int, required=True, help="number of ranks")
    run.add_argument("-H", "--hosts", help="host:slots,... (e.g. node1:4,node2:4)")
    run.add_argument("--hostfile", help="MPI hostfile")
    run.add_argument("--mpi-args", help="extra mpiexec arguments, one quoted string")
    run.add_argument("--max-restarts", type=int, metavar="R",
                     help="elastic: relaunch the job when it fails, at most R times, on the "
                          "hosts still reachable; ranks resume from jaxfog.elastic snapshots "
                          "(docs/guide/elastic.rst)")
    run.add_argument("--min-np", type=int, metavar="M",
                     help="elastic: give up when fewer than M slots are reachable (default 1)")
    run.add_argument("--host-discovery-script", metavar="SCRIPT",
                     help="elastic: a program printing the available hosts, one host:slots "
                          "a line; run before each launch and while the job runs (new hosts "
                          "join at the next snapshot; -np is then the most ranks)")
    run.add_argument("--dry-run", action="store_true", help="print the mpiexec command only")
    run.add_argument("--rank-prefix", action="store_true",
                     help="start every output line with [rank] (lines are never joined "
                          "either way)")
    return run


def _exec(args: argparse.Namespace) -> int:
    _launcher.exec_rank(args.command)
    return 0  # not reached: exec_rank exits with the command's status


def info_lines() -> list[str]:
    """What ``jaxfog info`` prints, one line per fact."""
    import jax
    import jaxlib

    lines = [f"jaxfog {jaxfog.__version__}", f"jax {jax.__version__}",
             f"jaxlib {jaxlib.__version__}"]
    try:
        lib = ffi.library()
        from mpi4py import MPI

        levels = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED:
                  "MPI_THREAD_FUNNELED", MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
                  MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE"}
        build = ffi.build_info()
        version = ffi.mpi_library_version().splitlines()
        lines += [
            f"MPI library: {version[0] if version else '?'}",
            f"MPI thread level: {levels.get(lib.jaxfog_mpi_query_thread(), '?')}",
            f"one-sided windows: {one_sided_component()}",
            hosts_line(),
            tcp_line(),
            f"mpi4py {MPI.get_vendor()[0]} {'.'.join(map(str, MPI.get_vendor()[1]))} "
            f"(mpi4py {__import__('mpi4py').__version__})",
            f"FFI library: {ffi.LIBRARY_PATH}",
            f"XLA FFI API: {'.'.join(map(str, ffi.ffi_api_version()))} (built against jaxlib "
            f"{build.get('jaxlib') or '?'}; this jaxlib's: "
            f"{'.'.join(map(str, ffi.jaxlib_ffi_api_version() or '?'))})",
            "built with: " + ("bazel" if build.get("builder") == "bazel" else
                              f"{build.get('mpicxx')} ("
                              f"{'system MPI' if build.get('system_mpi') else 'mpich wheel'})"),
            f"CUDA support built: {'yes' if build.get('cuda_built') else 'no'}"
            f" (CUDA toolkit: {build.get('cuda_home') or 'not found'})",
            f"NCCL support built: {'yes' if build.get('nccl_built') else 'no'}"
            f" (NCCL headers: {build.get('nccl_include') or 'not found'})",
            f"NCCL library: {_nccl_version() if build.get('nccl_built') else 'not used'}",
            *_link_lines(ffi.link_info()),
        ]
    except ImportError as err:
        lines.append(f"FFI library: NOT USABLE: {err}")
    return lines


def hosts_line() -> str:
    """The hosts of this job and which ranks each runs, from every rank's
    ``MPI_Get_processor_name`` (collective, like the window probe)."""
    from mpi4py import MPI

    ranks: dict[str, list[int]] = {}
    for rank, name in enumerate(MPI.COMM_WORLD.allgather(MPI.Get_processor_name())):
        ranks.setdefault(name, []).append(rank)
    hosts = ", ".join(f"{name} (rank{'s' * (len(r) > 1)} {_spans(r)})"
                      for name, r in ranks.items())
    return f"hosts: {len(ranks)}: {hosts}"


def tcp_settings() -> tuple[str, str]:
    """This host's TCP congestion control and whether a connection idle for a
    retransmission timeout restarts in slow start (its network namespace's)."""
    def read(name: str) -> str:
        try:
            return Path("/proc/sys/net/ipv4", name).read_text().strip()
        except OSError:
            return "?"

    idle = {"1": "on", "0": "off"}.get(read("tcp_slow_start_after_idle"), "?")
    return read("tcp_congestion_control"), idle


def tcp_line() -> str:
    """Each host's TCP settings that decide how much of a slow link an exchange
    gets (collective), with a pointer where they are the ones that lose it."""
    from mpi4py import MPI

    facts = MPI.COMM_WORLD.allgather((MPI.Get_processor_name(), *tcp_settings()))
    hosts = {name: (control, idle) for name, control, idle in facts}
    settings = {f"congestion control {c}, slow start after idle {i}" for c, i in hosts.values()}
    text = (settings.pop() if len(settings) == 1 else
            "; ".join(f"{name}: congestion control {c}, slow start after idle {i}"
                      for name, (c, i) in hosts.items()))
    if len(hosts) > 1 and any(c == "bbr" or i == "on" for c, i in hosts.values()):
        text += (" (on slow links between hosts, cubic and slow start after idle off "
                 "lose less: docs/performance.rst, 'Where a step's exchange loses the link')")
    return f"TCP: {text}"


def _spans(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def one_sided_component() -> str:
    """Which one-sided (RMA) implementation jaxfog's windows get here, probed with
    an 8-byte window on ``COMM_WORLD`` (collective: under ``jaxfog run`` every
    rank runs ``jaxfog info``), and how the window mutex takes its lock."""
    import os

    from mpi4py import MPI

    size = MPI.COMM_WORLD.Get_size()
    try:
        window = MPI.Win.Allocate(8, 8, comm=MPI.COMM_WORLD)
        try:
            name = window.Get_name()
        finally:
            window.Free()
    except MPI.Exception as err:
        return f"NOT USABLE: {err}"
    mutex = "mutex by 32-bit MPI_Compare_and_swap"
    if MPI.get_vendor()[0] != "Open MPI":
        return f"{MPI.get_vendor()[0]} RMA; {mutex}"
    # Open MPI's osc components name their windows "<component> window <id>";
    # osc/sm leaves the name empty.
    component = name.split(" window")[0] if " window" in name else "sm"
    chosen = os.environ.get("OMPI_MCA_osc")
    how = f"OMPI_MCA_osc={chosen}" if chosen else "Open MPI's default"
    hint = "" if size > 1 else " (several ranks may get another, e.g. osc/rdma with " \
        "Open MPI 4: jaxfog run -np 2 jaxfog info)"
    # 32 bits because Open MPI <= 4.1.4's osc/rdma crashes on a 64-bit one on
    # one node (see jaxfog/ffi/mpi_window.cc and docs/launching.rst).
    return f"osc/{component} ({how}, probed on {size} rank{'s' * (size > 1)}); {mutex}{hint}"


def _link_lines(links: dict[str, str]) -> list[str]:
    """How the FFI library links its runtimes; a static one is private to it
    (only ``jaxfog_*`` symbols are exported)."""
    def how(name: str) -> str:
        where = links.get(name)
        if where is None:
            return "not linked"
        return "static (private to the library)" if where == "static" else f"shared ({where})"

    return [f"libstdc++: {how('libstdc++')}", f"MPI library file: {how('libmpi')}",
            f"CUDA runtime: {how('cudart')}"]


def _nccl_version() -> str:
    """The version of the libnccl jaxfog would open, or why none opens."""
    try:
        code = ffi.load_nccl()
    except ffi.FfiLibraryError as err:
        return f"NOT LOADABLE: {err}"
    return (f"{code // 10000}.{code // 100 % 100}.{code % 100} "
            f"({ffi.nccl_library_path() or 'the loader search path'})")


def _info(args: argparse.Namespace) -> int:
    print("\n".join(info_lines()))
    return 0


def _timeline_merge(args: argparse.Namespace) -> int:
    try:
        trace = timeline.merge_files(args.out, args.inputs)
    except timeline.TimelineError as err:
        print(f"jaxfog timeline merge: {err}", file=sys.stderr)
        return 1
    ranks = trace["otherData"]["ranks"]
    print(f"{args.out}: {len(ranks)} ranks ({', '.join(map(str, ranks))}), "
          f"{sum(e.get('ph') == 'X' for e in trace['traceEvents'])} spans")
    return 0


def _demo_command(argv: Sequence[str]) -> int:
    return _demo.main(list(argv)) or 0


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="jaxfog", description=__doc__)
    commands = top.add_subparsers(dest="subcommand", required=True)

    # `run` and `demo` parse their own arguments (see main()).
    commands.add_parser("run", help="launch COMMAND on N MPI ranks (wraps mpiexec); "
                                    "jaxfog run -h")
    exec_ = commands.add_parser(
        "exec", help="per-rank set-up then exec COMMAND (for srun or a plain mpiexec)")
    exec_.add_argument("command", nargs=argparse.REMAINDER)
    exec_.set_defaults(handler=_exec)

    info = commands.add_parser("info", help="versions, MPI library, FFI library, NCCL")
    info.set_defaults(handler=_info)

    commands.add_parser("demo", help="consensus speed of the built-in graphs (jaxfog demo -h)")

    timeline = commands.add_parser("timeline", help="op timelines (JAXFOG_TIMELINE): merge")
    timeline_commands = timeline.add_subparsers(dest="timeline_command", required=True)
    merge = timeline_commands.add_parser(
        "merge", help="join the ranks' timeline files into one trace",
        description="Join the per-rank JAXFOG_TIMELINE files into one Chrome trace / "
                    "Perfetto JSON file, one process per rank, on one clock.")
    merge.add_argument("out", metavar="OUT.json", help="the merged trace to write")
    merge.add_argument("inputs", metavar="IN.json", nargs="+",
                       help="per-rank files, or a quoted glob such as 'trace.rank*.json'")
    merge.set_defaults(handler=_timeline_merge)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        return _demo_command(argv[1:])
    if argv[:1] == ["run"]:
        return _run(argv[1:])
    args = parser().parse_args(argv)
    return args.handler(args)

