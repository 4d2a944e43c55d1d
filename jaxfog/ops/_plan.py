"""Communication plans of neighbor averaging: who sends what to whom, per step.

A :class:`Plan` is this rank's view of one or more steps (a ``Schedule``
gives one entry per step of its period): a self weight, the ranks it sends to
with the weight it scales each send by, and the ranks it receives from with
the weight it gives each. On rank i, one step computes

    out_i = self_weight * x_i + sum_{j in recv} recv_weight_j * send_weight_j(i) * x_j

which is row i of ``W @ X`` for the plans built from a topology. Plans are
hashable (static primitive parameters), and a program names its plan by an
id (:meth:`Plan.define`); their transpose is the adjoint:
cotangents travel back along every edge with the same two weights.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import numbers
from typing import Any, Mapping, Sequence, cast

import jax
import numpy as np

from jaxfog import ffi
from jaxfog import topology as T

Edges = tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-step (self weight, sends, receives) of one rank; hashable."""

    self_weights: tuple[float, ...]
    sends: tuple[Edges, ...]
    recvs: tuple[Edges, ...]

    @property
    def period(self) -> int:
        return len(self.self_weights)

    def transpose(self) -> "Plan":
        """The adjoint plan: every send becomes a receive with the same weight."""
        return Plan(self.self_weights, sends=self.recvs, recvs=self.sends)

    def define(self) -> int:
        """Defines this plan in the process's table of plans and returns its id,
        the custom call's ``plan_id`` (``jaxfog/ffi/plan_table.h``).

        A program names its plan rather than holding it, so that the same
        step traced for another size (after a recovery in place) is the same
        program, found in JAX's persistent compilation cache: the table is
        emptied when jaxfog is set up again, and ids count from 0.
        """
        def table(entries: Sequence[Edges]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            offsets = np.cumsum([0] + [len(e) for e in entries]).astype(np.int64)
            ranks = np.array([r for e in entries for r, _ in e], dtype=np.int64)
            weights = np.array([w for e in entries for _, w in e], dtype=np.float64)
            return offsets, ranks, weights

        self_weights = np.array(self.self_weights, dtype=np.float64)
        (send_offsets, send_ranks, send_weights), (recv_offsets, recv_ranks, recv_weights) = (
            table(self.sends), table(self.recvs))
        error = ctypes.create_string_buffer(1024)
        plan_id = ffi.library().jaxfog_define_plan(
            self.period, self_weights.ctypes.data, len(send_ranks), send_offsets.ctypes.data,
            send_ranks.ctypes.data, send_weights.ctypes.data, len(recv_ranks),
            recv_offsets.ctypes.data, recv_ranks.ctypes.data, recv_weights.ctypes.data, error,
            len(error))
        if plan_id < 0:
            raise ValueError(error.value.decode())
        return int(plan_id)


def _entry_from_topology(topo: T.Topology, rank: int) -> tuple[float, Edges, Edges]:
    w = topo.weights
    recvs = tuple((j, float(w[rank, j])) for j in topo.in_neighbors(rank))
    sends = tuple((i, 1.0) for i in topo.out_neighbors(rank))
    return float(w[rank, rank]), sends, recvs


def from_topology(topo: T.Topology | T.Schedule, rank: int) -> Plan:
    """Row ``rank`` of W (one entry per step of a Schedule)."""
    entries = topo.topologies if isinstance(topo, T.Schedule) else (topo,)
    self_weights, sends, recvs = zip(*(_entry_from_topology(t, rank) for t in entries))
    return Plan(tuple(self_weights), tuple(sends), tuple(recvs))


def weight(value: Any, what: str) -> float:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"{what} is a traced value, but a number or a {{rank: weight}} "
                        "entry must be known when the op is traced (on MPI processes the "
                        "C++ op takes its weights when it is compiled). Pass a rank-indexed "
                        "array instead: a concrete one works on every backend, a traced one "
                        "on simulated agents")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a real number, got {type(value).__name__} "
                        f"{value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{what} must be finite, got {value}")
    return value


def rank_tuple(ranks: Any, size: int, rank: int, what: str) -> tuple[int, ...]:
    """Distinct ranks other than ``rank``, each in ``[0, size)``."""
    ranks = list(ranks)
    check_ranks(ranks, size, rank, what)
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{what} lists a rank twice: {ranks}")
    return tuple(int(r) for r in ranks)


def check_ranks(ranks: Any, size: int, rank: int, what: str) -> None:
    for r in ranks:
        if isinstance(r, (bool, np.bool_)) or not isinstance(r, numbers.Integral):
            raise TypeError(f"{what}: rank {r!r} is not an integer")
        if not 0 <= cast(int, r) < size:  # an Integral: typeshed's has no __ge__
            raise ValueError(f"{what}: rank {r} is out of range for {size} ranks")
        if r == rank:
            raise ValueError(f"{what}: rank {rank} cannot be its own neighbor (use "
                             "self_weight)")


def weights_dict(weights: Any, what: str, allow_list: bool) -> dict[int, float]:
    if isinstance(weights, Mapping):
        return {k: weight(v, f"{what}[{k}]") for k, v in weights.items()}
    if allow_list and isinstance(weights, (list, tuple)):
        if len(set(weights)) != len(weights):
            raise ValueError(f"{what} lists a rank twice: {list(weights)}")
        return {k: 1.0 for k in weights}
    kind = "a dict {rank: weight} or a list of ranks" if allow_list else "a dict {rank: weight}"
    raise TypeError(f"{what} must be {kind}, got {type(weights).__name__}")


def _must_be_static(given: dict, static: list[int], rank: int, label: str, direction: str,
                    other: str, what: str) -> None:
    """In pull (push) form, the ranks given must be the static in- (out-)neighbours."""
    if sorted(given) != static:
        raise ValueError(
            f"{what} on rank {rank}: {label} names ranks {sorted(given)} but the "
            f"static topology's {direction}-neighbours are {static}; give {other} too for "
            "a dynamic graph")


def from_local_view(topo: T.Topology, rank: int, self_weight: Any, src_weights: Any,
                    dst_weights: Any, what: str = "neighbor_allreduce",
                    labels: tuple[str, str] = ("src_weights", "dst_weights")) -> Plan:
    """BlueFog's local view, validated on the calling rank.

    * pull (self + src): receive from ``src_weights`` (which must be exactly
      the static in-neighbours), send to the static out-neighbours;
    * push (self + dst): send to ``dst_weights`` (exactly the static
      out-neighbours), receive from the static in-neighbours with weight 1;
    * push-pull (self + src + dst): any ranks, empty lists allowed.
    """
    size = topo.size
    src_label, dst_label = labels
    self_w = weight(self_weight, f"{what}: self_weight")
    src = None if src_weights is None else weights_dict(src_weights, f"{what}: {src_label}",
                                                        False)
    dst = None if dst_weights is None else weights_dict(dst_weights, f"{what}: {dst_label}",
                                                        True)
    if src is not None:
        check_ranks(src, size, rank, f"{what}: {src_label}")
    if dst is not None:
        check_ranks(dst, size, rank, f"{what}: {dst_label}")
    if dst is None:  # pull: the static graph says where to send
        assert src is not None  # _args.local_view refuses a view with neither side
        _must_be_static(src, topo.in_neighbors(rank), rank, src_label, "in", dst_label, what)
        dst = {i: 1.0 for i in topo.out_neighbors(rank)}
    elif src is None:  # push: the static graph says whom to receive from
        _must_be_static(dst, topo.out_neighbors(rank), rank, dst_label, "out", src_label,
                        what)
        src = {j: 1.0 for j in topo.in_neighbors(rank)}
    sends = tuple(sorted(dst.items()))
    recvs = tuple(sorted(src.items()))
    return Plan((self_w,), (sends,), (recvs,))


def check_matching(plan: Plan, comm, rank: int, what: str) -> None:
    """Raises ValueError on every rank if senders and receivers disagree.

    Collective (mpi4py, at trace time): every rank must call it together.
    """
    size = comm.Get_size()
    problems = []
    for t in range(plan.period):
        sends_to = [0] * size
        for peer, _ in plan.sends[t]:
            sends_to[peer] = 1
        senders = comm.alltoall(sends_to)  # senders[j] == 1: j sends to me
        expected = {peer for peer, _ in plan.recvs[t]}
        actual = {j for j in range(size) if senders[j]}
        for j in sorted(actual - expected):
            problems.append(f"rank {j} sends to rank {rank} but rank {rank} does not "
                            f"receive from it" + (f" (step {t})" if plan.period > 1 else ""))
        for j in sorted(expected - actual):
            problems.append(f"rank {rank} receives from rank {j} but rank {j} does not "
                            f"send to it" + (f" (step {t})" if plan.period > 1 else ""))
    everyone = [p for ps in comm.allgather(problems) for p in ps]
    if everyone:
        raise ValueError(f"{what}: send and receive sets do not match: "
                         + "; ".join(everyone))
