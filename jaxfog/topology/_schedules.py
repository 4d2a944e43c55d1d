"""Time-varying communication: :class:`Schedule` (an immutable periodic
sequence of same-size topologies), the built-in dynamic schedules, and
:func:`send_recv_ranks`. Numpy only; every entry is a
:class:`~jaxfog.topology.Topology`.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Iterator, Optional, Sequence, Union

import numpy as np

from jaxfog.topology._graphs import (Topology, _as_int, _check_rank, _check_size, _name,
                                     _uniform_rows)


# --------------------------------------------------------------------------------------
# Small private helpers
# --------------------------------------------------------------------------------------


def _ceil_log2(x: int) -> int:
    """``ceil(log2(x))`` for an integer x >= 1, exactly (0 for x == 1)."""
    return (x - 1).bit_length()


def _lcm(values: Iterable[int]) -> int:
    """Least common multiple of positive integers (1 for none)."""
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


def _one_peer_matrix(n: int, sends: dict) -> np.ndarray:
    """W for one step where rank s sends to ``sends[s]``; receivers average 1/2-1/2.

    Raises AssertionError (internal bug) when a receiver would get two peers.
    """
    w = np.eye(n, dtype=np.float64)
    seen = set()
    for src, dst in sends.items():
        if dst == src:
            continue
        assert dst not in seen, f"rank {dst} would receive from two peers"
        seen.add(dst)
        w[dst, dst] = 0.5
        w[dst, src] = 0.5
    return w


def _restore_schedule(topologies: tuple, name: str) -> "Schedule":
    """Unpickling hook for :class:`Schedule`."""
    return Schedule(topologies, name=name)


# --------------------------------------------------------------------------------------
# Schedule
# --------------------------------------------------------------------------------------


class Schedule:
    """An immutable, hashable periodic sequence of same-size :class:`Topology` objects.

    Step ``t`` uses ``schedule.at(t) == schedule[t % period]``. Equality and hash come
    from the entries (not ``name``), so a Schedule can be a static ``jax.jit`` argument.

    Args:
      topologies: a non-empty sequence of Topology objects of one size.
      name: informational label.

    Raises:
      TypeError: an entry that is not a Topology.
      ValueError: empty, or entries of different sizes.
    """

    __slots__ = ("_topologies", "_name", "_stacked", "_hash")
    # The slots' types (set once, in __init__, through object.__setattr__).
    _topologies: tuple[Topology, ...]
    _name: str
    _stacked: np.ndarray
    _hash: int

    def __init__(self, topologies: Iterable[Topology], name: Optional[str] = None) -> None:
        what = "jaxfog.topology.Schedule"
        if isinstance(topologies, Topology):
            raise TypeError(f"{what}: takes a sequence of Topology objects, got a single "
                            "Topology (wrap it in a list)")
        if isinstance(topologies, (str, bytes)) or not hasattr(topologies, "__iter__"):
            raise TypeError(f"{what}: topologies must be a sequence of Topology objects, "
                            f"got {type(topologies).__name__}")
        topos = tuple(topologies)
        if not topos:
            raise ValueError(f"{what}: a Schedule needs at least one Topology")
        for k, t in enumerate(topos):
            if not isinstance(t, Topology):
                raise TypeError(f"{what}: entry {k} is a {type(t).__name__}, "
                                "not a Topology")
            if t.size != topos[0].size:
                raise ValueError(f"{what}: all topologies of a Schedule must have the same size: "
                                 f"entry 0 has size {topos[0].size}, entry {k} has "
                                 f"size {t.size}")
        stacked = np.stack([t.weights for t in topos]).astype(np.float64)
        stacked.flags.writeable = False
        object.__setattr__(self, "_topologies", topos)
        object.__setattr__(self, "_name", "schedule" if name is None else _name(name, what))
        object.__setattr__(self, "_stacked", stacked)
        object.__setattr__(self, "_hash", hash(("Schedule", topos)))

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"Schedule is immutable (cannot set {key!r})")

    def __delattr__(self, key: str) -> None:
        raise AttributeError(f"Schedule is immutable (cannot delete {key!r})")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return self._topologies == other._topologies

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return (_restore_schedule, (self._topologies, self._name))

    def __repr__(self) -> str:
        return f"Schedule({self._name!r}, size={self.size}, period={self.period})"

    def __len__(self) -> int:
        return len(self._topologies)

    def __iter__(self) -> Iterator[Topology]:
        return iter(self._topologies)

    def __getitem__(self, index: Any) -> Union[Topology, tuple]:
        """Entry ``index`` of one period (plain tuple indexing; see :meth:`at`)."""
        return self._topologies[index]

    @property
    def name(self) -> str:
        """Informational label (not part of equality or hash)."""
        return self._name

    @property
    def period(self) -> int:
        """Number of distinct steps before the schedule repeats."""
        return len(self._topologies)

    @property
    def size(self) -> int:
        """Number of agents n."""
        return self._topologies[0].size

    @property
    def topologies(self) -> tuple[Topology, ...]:
        """The entries of one period."""
        return self._topologies

    @property
    def stacked_weights(self) -> np.ndarray:
        """Read-only (period, n, n) float64 array; entry ``t % period`` is step t's W."""
        return self._stacked

    def at(self, step: int) -> Topology:
        """The topology used at ``step`` (any integer; taken modulo the period)."""
        return self._topologies[_as_int(step, "step", "Schedule.at") % self.period]

    def product(self, start: int = 0, num_steps: Optional[int] = None) -> np.ndarray:
        """``W_{start+k-1} @ ... @ W_{start}``: the mixing of ``k = num_steps`` steps.

        Args:
          start: first step.
          num_steps: number of steps (default: one period).
        """
        what = "Schedule.product"
        k = self.period if num_steps is None else _as_int(num_steps, "num_steps", what)
        if k < 0:
            raise ValueError(f"{what}: num_steps must be >= 0, got {k}")
        start = _as_int(start, "start", what)
        out = np.eye(self.size)
        for t in range(start, start + k):
            out = self._stacked[t % self.period] @ out
        return out

    def union(self, *, name: Optional[str] = None) -> Topology:
        """The Topology whose W is the mean of one period's matrices.

        Its edge set is the union of the entries' edge sets, and it is row / column /
        doubly stochastic whenever every entry is.
        """
        return Topology(self._stacked.mean(axis=0),
                        name=f"union({self._name})" if name is None else name,
                        check_connected=False)


# --------------------------------------------------------------------------------------
# Built-in dynamic schedules
# --------------------------------------------------------------------------------------


def _schedule_from_sends(n: int, sends_per_step: Sequence[dict], name: str) -> Schedule:
    """Schedule of one-peer steps; ``sends_per_step[t]`` maps sender -> receiver."""
    return Schedule([Topology._from_trusted(_one_peer_matrix(n, sends), f"{name}[t={t}]")
                     for t, sends in enumerate(sends_per_step)], name=name)


def one_peer_exponential(n: int) -> Schedule:
    """Dynamic one-peer exponential graph.

    With ``tau = ceil(log2 n)``, at step t rank r sends only to
    ``(r + 2**(t mod tau)) % n``; every rank then receives from exactly one peer and
    averages 1/2-1/2 (each step is doubly stochastic). For n a power of 2 the product
    of any tau consecutive matrices is exactly ``(1/n) 11^T``. n = 1: period 1, identity.
    """
    n = _check_size(n, "jaxfog.topology.one_peer_exponential")
    tau = max(_ceil_log2(n), 1)
    steps = [{r: (r + 2 ** t) % n for r in range(n)} if n > 1 else {} for t in range(tau)]
    return _schedule_from_sends(n, steps, f"one_peer_exponential({n})")


def one_peer(topology: Topology, *, max_period: int = 4096) -> Schedule:
    """One-peer dynamic schedule over a static topology (BlueFog's
    ``GetDynamicSendRecvRanks``).

    Each rank's out-neighbours are sorted clockwise, by ``(dst - r) % n``; at step t rank
    r sends to ``sorted_out[r][t % len(sorted_out[r])]`` (a rank without out-neighbours
    sends nothing). Each receiver weights itself and its k senders of that step uniformly
    ``1 / (k + 1)`` (row-stochastic; doubly stochastic when k <= 1 everywhere, e.g. on
    circulant graphs). The period is the lcm of the nonzero out-degrees (1 if none).

    Args:
      topology: the static base graph.
      max_period: refuse (ValueError) irregular graphs whose period would exceed this.
    """
    what = "jaxfog.topology.one_peer"
    if not isinstance(topology, Topology):
        raise TypeError(f"{what}: needs a Topology, got {type(topology).__name__}")
    max_period = _as_int(max_period, "max_period", what)
    if max_period < 1:
        raise ValueError(f"{what}: max_period must be >= 1, got {max_period}")
    n = topology.size
    # sorted() calls the key during the iteration of its r.
    outs = [sorted(topology.out_neighbors(r), key=lambda d: (d - r) % n)
            for r in range(n)]
    period = _lcm(len(o) for o in outs if o)
    if period > max_period:
        raise ValueError(f"{what}: one_peer({topology.name}) would have period {period} (lcm of "
                         f"the out-degrees) > max_period={max_period}")
    name = f"one_peer({topology.name})"
    entries = []
    for t in range(period):
        senders: list[list[int]] = [[] for _ in range(n)]
        for r, o in enumerate(outs):
            if o:
                senders[o[t % len(o)]].append(r)
        entries.append(Topology._from_trusted(_uniform_rows(n, senders), f"{name}[t={t}]"))
    return Schedule(entries, name=name)


def _check_machines(n: Any, local_size: Any, what: str) -> tuple[int, int, int]:
    """Validates (n, local_size) and returns (n, local_size, num_machines)."""
    what = f"jaxfog.topology.{what}"
    n = _check_size(n, what)
    local_size = _check_size(local_size, what, "local_size")
    if n % local_size:
        raise ValueError(f"{what}: n={n} must be a multiple of local_size={local_size} "
                         "(homogeneous machines)")
    return n, local_size, n // local_size


def inner_outer_ring(n: int, local_size: int) -> Schedule:
    """Inner-ring / outer-ring dynamic schedule (BlueFog's
    ``GetInnerOuterRingDynamicSendRecvRanks``).

    Ranks are ``r = m * local_size + l`` on M = n // local_size machines; period is
    local_size. At step t, on every machine the rank with local rank ``o = t % L`` is in
    the outer ring: it sends to local rank o of machine ``(m + 1) % M`` (and receives
    from machine ``(m - 1) % M``). The other local ranks form an inner ring skipping o:
    l sends to the next local rank after l (mod L) that is not o. A rank whose target is
    itself (L = 2 inner, or M = 1 outer) does not exchange that step (identity row).
    Receivers average 1/2 own, 1/2 received; every step is doubly stochastic.

    Raises:
      ValueError: n not a multiple of local_size.
    """
    n, big_l, big_m = _check_machines(n, local_size, "inner_outer_ring")
    steps = []
    for t in range(big_l):
        o = t % big_l
        sends = {}
        for m in range(big_m):
            for l in range(big_l):
                if l == o:
                    dst = ((m + 1) % big_m) * big_l + l
                else:
                    nl = (l + 1) % big_l
                    if nl == o:
                        nl = (nl + 1) % big_l
                    dst = m * big_l + nl
                sends[m * big_l + l] = dst
        steps.append(sends)
    return _schedule_from_sends(n, steps, f"inner_outer_ring({n},{big_l})")


def inner_outer_exponential(n: int, local_size: int) -> Schedule:
    """Inner / outer one-peer exponential dynamic schedule.

    Same structure as :func:`inner_outer_ring`, with exponential jumps (this differs
    from BlueFog's ``GetInnerOuterExp2DynamicSendRecvRanks`` so that every rank receives
    from exactly one peer or none, making every step doubly stochastic):

    * outer: at step t the rank with local rank ``o = t % L`` of machine m sends to
      local rank o of machine ``(m + 2**k_out) % M`` with
      ``k_out = (t // L) % ceil(log2 M)`` (k_out advances every L steps, so each local
      rank uses each distance once); no outer exchange when M = 1.
    * inner: the K = L - 1 other local ranks, re-indexed 0..K-1 in increasing order,
      send to the inner rank at distance ``2**k_in`` (mod K) with
      ``k_in = t % ceil(log2 K)``; no inner exchange when K <= 1.

    Receivers average 1/2 own, 1/2 received. The period is
    ``lcm(L * max(ceil(log2 M), 1), max(ceil(log2 K), 1))``.

    Raises:
      ValueError: n not a multiple of local_size.
    """
    n, big_l, big_m = _check_machines(n, local_size, "inner_outer_exponential")
    tau_out = max(_ceil_log2(big_m), 1)
    k_inner = big_l - 1
    tau_in = max(_ceil_log2(k_inner), 1) if k_inner >= 1 else 1
    period = _lcm([big_l * tau_out, tau_in])
    steps = []
    for t in range(period):
        o = t % big_l
        d_out = 2 ** ((t // big_l) % tau_out)
        d_in = 2 ** (t % tau_in)
        inner = [l for l in range(big_l) if l != o]
        sends = {}
        for m in range(big_m):
            sends[m * big_l + o] = ((m + d_out) % big_m) * big_l + o
            for j, l in enumerate(inner):
                sends[m * big_l + l] = m * big_l + inner[(j + d_in) % k_inner]
        steps.append(sends)
    return _schedule_from_sends(n, steps, f"inner_outer_exponential({n},{big_l})")


def machine_one_peer_exponential(n: int, local_size: int) -> Schedule:
    """Machine-level one-peer exponential schedule.

    With M = n // L machines and ``tau_M = ceil(log2 M)``, at step t rank
    ``m * L + l`` sends to the same local rank l on machine
    ``(m + 2**(t mod tau_M)) % M``; receivers average 1/2-1/2. M = 1: period 1, identity.

    Raises:
      ValueError: n not a multiple of local_size.
    """
    n, big_l, big_m = _check_machines(n, local_size, "machine_one_peer_exponential")
    tau = max(_ceil_log2(big_m), 1)
    steps = []
    for t in range(tau):
        d = 2 ** t
        steps.append({m * big_l + l: ((m + d) % big_m) * big_l + l
                      for m in range(big_m) for l in range(big_l)} if big_m > 1 else {})
    return _schedule_from_sends(n, steps, f"machine_one_peer_exponential({n},{big_l})")


def send_recv_ranks(schedule_or_topology: Union[Schedule, Topology],
                    rank: int) -> Iterator[tuple[list[int], list[int]]]:
    """Infinite BlueFog-style generator of ``(send_ranks, recv_ranks)`` for one rank.

    Step t yields the sorted out- and in-neighbours of ``rank`` in ``schedule.at(t)``;
    for a static Topology it yields the same pair forever.

    Example:
      >>> gen = send_recv_ranks(one_peer_exponential(8), 0)
      >>> [next(gen) for _ in range(3)]
      [([1], [7]), ([2], [6]), ([4], [4])]
    """
    if isinstance(schedule_or_topology, Topology):
        entries: Sequence[Topology] = (schedule_or_topology,)
    elif isinstance(schedule_or_topology, Schedule):
        entries = schedule_or_topology.topologies
    else:
        raise TypeError("jaxfog.topology.send_recv_ranks: needs a Schedule or a Topology, "
                        f"got {type(schedule_or_topology).__name__}")
    rank = _check_rank(rank, entries[0].size, "jaxfog.topology.send_recv_ranks")
    pairs = [(t.out_neighbors(rank), t.in_neighbors(rank)) for t in entries]
    return _cycle_pairs(pairs)


def _cycle_pairs(pairs: list) -> Iterator[tuple[list[int], list[int]]]:
    """Yields fresh copies of ``pairs`` cyclically, forever."""
    while True:
        for send, recv in pairs:
            yield list(send), list(recv)
