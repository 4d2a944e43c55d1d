"""The op timeline (``JAXFOG_TIMELINE``) on 2 ranks, and ``jaxfog timeline merge``.

The body runs every op inside ``jax.jit`` with the timeline on; the test then
reads each rank's file: one span per op run with its name, bytes and peers,
the phases inside their op's span, the ranks agreeing on the op sequence, and
the merged trace holding both ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxfog.testing import run_mpi

N = 1000  # float32 elements of the array ops
TREE_BYTES = 4 * (3 * 4 + 7)  # the pytree: float32 (3, 4) and (7,)
STEPS = 2

# (op, bytes, phases inside it) in the order one step runs them.
SEQUENCE = [
    ("neighbor_allreduce", 4 * N, ["post", "wait {peer}", "weighted sum"]),
    ("neighbor_allreduce", TREE_BYTES, ["post", "wait {peer}", "weighted sum"]),
    ("allreduce", 4 * N, ["agree", "MPI_Iallreduce"]),
    ("broadcast", 4 * N, ["agree", "MPI_Ibcast"]),
    ("allgather", 4 * N, ["agree", "MPI_Iallgather"]),
    ("neighbor_allgather", 4 * N, ["post", "wait {peer}"]),
    ("barrier", None, ["MPI_Ibarrier"]),
]


def ops_body():
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxfog as jf

    jf.init()
    r = jf.rank()
    x = jnp.full(N, float(r), jnp.float32)
    tree = {"a": jnp.full((3, 4), float(r), jnp.float32), "b": jnp.full(7, float(r), jnp.float32)}

    @jax.jit
    def step(x, tree):
        y = jf.neighbor_allreduce(x)
        t = jf.neighbor_allreduce(tree)
        s = jf.allreduce(x, op="sum")
        b = jf.broadcast(x, root=0)
        g = jf.allgather(x)
        ng = jf.neighbor_allgather(x)
        jf.barrier()
        return y, t, s, b, g, ng

    for _ in range(STEPS):
        y, t, s, b, g, ng = jax.block_until_ready(step(x, tree))
    np.testing.assert_allclose(y, 0.5)  # the 2-rank exponential graph: mean
    np.testing.assert_allclose(t["a"], 0.5)
    np.testing.assert_allclose(s, 1.0)
    np.testing.assert_allclose(b, 0.0)
    np.testing.assert_allclose(g, np.repeat([0.0, 1.0], N))
    np.testing.assert_allclose(ng, 1.0 - r)
    jf.shutdown()  # writes the files


def nonblocking_body():
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxfog as jf

    jf.init()
    r = jf.rank()
    x = jnp.full(1 << 18, float(r), jnp.float32)  # 1 MB
    start, finish = jax.jit(jf.neighbor_allreduce_nonblocking), jax.jit(jf.wait)
    jax.block_until_ready(finish(start(x)))  # compiled
    jf.barrier()
    if r == 1:
        time.sleep(0.3)  # the peer starts late: rank 0's wait waits for the op
    handle = start(x)
    np.testing.assert_allclose(finish(handle), 0.5)
    jf.shutdown()


def no_timeline_body():
    import os

    import jax.numpy as jnp

    import jaxfog as jf
    from jaxfog import ffi

    os.chdir(os.environ["OUT_DIR"])
    jf.init()
    jf.neighbor_allreduce(jnp.ones(N))
    jf.barrier()
    assert ffi.flush_timeline()  # nothing to write: still fine
    jf.shutdown()


def _spans(trace, cat=None):
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and (cat is None or
                                                                    e["cat"] == cat)]


def _inside(inner, outer, slack=1e-3):  # ts + dur in float may exceed by an ulp
    return (inner["tid"] == outer["tid"] and inner["ts"] >= outer["ts"] - slack and
            inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + slack)


def _merge(*argv):
    return subprocess.run([sys.executable, "-m", "jaxfog.cli", "timeline", "merge", *argv],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    folder = tmp_path_factory.mktemp("timeline")
    env = {"JAXFOG_TIMELINE": str(folder / "trace.json"), "JAXFOG_COMM_THREAD_MIN_BYTES": "0"}
    result = run_mpi(2, __file__, "ops_body", timeout=180, env=env)
    assert result.ok, result.report()
    assert sorted(os.listdir(folder)) == ["trace.rank0.json", "trace.rank1.json"]
    return folder, [json.loads((folder / f"trace.rank{r}.json").read_text()) for r in (0, 1)]


def test_every_op_has_a_span_with_its_args(traces):
    _, both = traces
    for rank, trace in enumerate(both):
        assert trace["displayTimeUnit"] == "ns"
        assert trace["otherData"]["rank"] == rank and trace["otherData"]["dropped_spans"] == 0
        ops = sorted(_spans(trace, "op"), key=lambda e: e["ts"])
        assert [op["name"] for op in ops] == [name for name, _, _ in SEQUENCE] * STEPS
        peer = 1 - rank
        for op, (name, nbytes, _) in zip(ops, SEQUENCE * STEPS):
            assert op["pid"] == rank and op["dur"] >= 0
            assert op["args"]["comm"] == 0
            if nbytes is not None:
                assert op["args"]["bytes"] == nbytes, op
                assert op["args"]["signature"].startswith("0x")
            if name.startswith("neighbor_"):
                assert (op["args"]["send_to"], op["args"]["recv_from"]) == ([peer], [peer])
            if name == "broadcast":
                assert op["args"]["root"] == 0
        # Sequenced ops number 1, 2, ... in order (the barrier is not sequenced).
        seqs = [op["args"]["seq"] for op in ops if op["name"] != "barrier"]
        assert seqs == list(range(1, len(seqs) + 1))
    # The ranks agree on every op's number and message signature.
    keys = [[(op["name"], op["args"].get("seq"), op["args"].get("signature"))
             for op in sorted(_spans(trace, "op"), key=lambda e: e["ts"])] for trace in both]
    assert keys[0] == keys[1]


def test_phases_nest_inside_their_op(traces):
    _, both = traces
    for rank, trace in enumerate(both):
        ops = sorted(_spans(trace, "op"), key=lambda e: e["ts"])
        phases = _spans(trace, "phase")
        for phase in phases:  # no phase outside an op
            assert any(_inside(phase, op) for op in ops), phase
        for op, (name, _, expected) in zip(ops, SEQUENCE * STEPS):
            names = [p["name"] for p in phases if _inside(p, op)]
            for want in expected:
                assert want.format(peer=1 - rank) in names, (op, names)
        # "post" ends before the waits start; each wait names its peer.
        for op in ops:
            inner = [p for p in phases if _inside(p, op)]
            posts = [p for p in inner if p["name"] == "post"]
            for wait in (p for p in inner if p["name"].startswith("wait ")):
                assert wait["args"]["peer"] == 1 - rank
                assert all(p["ts"] + p["dur"] <= wait["ts"] + 1e-3 for p in posts)


def test_async_ops_show_their_time_queued(traces):
    _, both = traces
    for trace in both:
        names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
                 if e["ph"] == "M" and e["name"] == "thread_name"}
        ops = _spans(trace, "op")
        queued = _spans(trace, "queue")
        # JAXFOG_COMM_THREAD_MIN_BYTES=0: every op ran on the communication thread.
        assert len(queued) == len(ops)
        for op in ops:
            assert names.get(op["tid"]) == "jaxfog communication thread"
            before = [q for q in queued if q["tid"] == op["tid"] and
                      abs(q["ts"] + q["dur"] - op["ts"]) < 1.0]
            assert len(before) == 1, op


def test_a_nonblocking_op_shows_its_copies_and_its_wait(tmp_path):
    """The start's copy in (XLA's thread), the op (the communication thread),
    then the wait: how long it waited for the op, and its copy out."""
    env = {"JAXFOG_TIMELINE": str(tmp_path / "trace-{rank}.json")}
    result = run_mpi(2, __file__, "nonblocking_body", timeout=120, env=env)
    assert result.ok, result.report()
    trace = json.loads((tmp_path / "trace-0.json").read_text())
    spans = sorted(_spans(trace), key=lambda e: e["ts"])
    last = [e for e in spans if e["name"] == "neighbor_allreduce"][-1]  # the timed one
    before = [e for e in spans if e["ts"] < last["ts"]]
    stage_in = [e for e in before if e["name"] == "stage in"][-1]
    assert stage_in["tid"] != last["tid"] and stage_in["dur"] > 0  # XLA's thread
    after = [e for e in spans if e["ts"] >= stage_in["ts"] + stage_in["dur"] - 1e-3]
    waited = [e for e in after if e["name"] == "wait for the op"]
    out = [e for e in after if e["name"] == "stage out"]
    assert len(waited) == 1 and len(out) == 1, [e["name"] for e in after]
    # Rank 1 was 0.3 s late: the wait waited for most of it, until the op ended.
    assert waited[0]["dur"] > 0.1e6, waited
    assert abs(waited[0]["ts"] + waited[0]["dur"] - (last["ts"] + last["dur"])) < 5e3
    assert out[0]["ts"] >= last["ts"] + last["dur"] - 1e-3


def test_merge_joins_the_ranks(traces):
    folder, both = traces
    out = folder / "merged.out"
    done = _merge(str(out), str(folder / "trace.rank*.json"))  # a glob, as a shell would not
    assert done.returncode == 0, done.stderr
    merged = json.loads(out.read_text())
    assert merged["otherData"]["ranks"] == [0, 1]
    process_names = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"]
                     if e["ph"] == "M" and e["name"] == "process_name"}
    assert process_names == {0: "rank 0", 1: "rank 1"}
    spans = _spans(merged)
    assert {e["pid"] for e in spans} == {0, 1}
    assert len(spans) == sum(len(_spans(t)) for t in both)
    # On one clock: the last barrier ends at about the same time on both ranks.
    last = [max((e for e in spans if e["pid"] == r and e["name"] == "barrier"),
                key=lambda e: e["ts"]) for r in (0, 1)]
    ends = [e["ts"] + e["dur"] for e in last]
    assert abs(ends[0] - ends[1]) < 50_000, ends  # 50 ms: slack for a loaded machine
    # The same rank twice, or a file that is no trace, is refused.
    rank0 = str(folder / "trace.rank0.json")
    assert _merge(str(folder / "bad.json"), rank0, rank0).returncode == 1
    assert "both rank 0" in _merge(str(folder / "bad.json"), rank0, rank0).stderr
    (folder / "junk.txt").write_text("not json")
    assert _merge(str(folder / "bad.json"), str(folder / "junk.txt")).returncode == 1


def test_no_file_without_the_variable(tmp_path):
    env = {"JAXFOG_TIMELINE": "", "OUT_DIR": str(tmp_path)}
    result = run_mpi(2, __file__, "no_timeline_body", timeout=120, env=env)
    assert result.ok, result.report()
    assert os.listdir(tmp_path) == []


def test_unwritable_path_warns_and_runs_on(tmp_path):
    code = ("import warnings, jax.numpy as jnp, jaxfog as jf\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    jf.init()\n"
            "assert any('JAXFOG_TIMELINE' in str(w.message) for w in caught), caught\n"
            "jf.neighbor_allreduce(jnp.ones(3))\n"
            "jf.shutdown()\n")
    env = {**os.environ, "JAXFOG_TIMELINE": str(tmp_path / "missing" / "t-{rank}.json"),
           "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (tmp_path / "missing").exists()
    # "{rank}" is replaced where it stands.
    env["JAXFOG_TIMELINE"] = str(tmp_path / "t-{rank}.json")
    done = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp, jaxfog as jf\n"
                           "jf.init(); jf.allreduce(jnp.ones(3))\n"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    trace = json.loads((tmp_path / "t-0.json").read_text())
    assert [e["name"] for e in _spans(trace, "op")] == ["allreduce"]
