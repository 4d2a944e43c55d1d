"""Bytes on the wire: what each op of this process sent (``jaxfog.comm_stats``)."""

from __future__ import annotations

from typing import NamedTuple

from jaxfog import _context, ffi
from jaxfog import _validate as V
from jaxfog.errors import BackendError


class CommStats(NamedTuple):
    """What one op sent from this process since the start (or the last reset)."""

    #: Times the op ran.
    calls: int
    #: Messages sent: one per peer for point-to-point ops; for collectives,
    #: the peers this rank's data reaches (allgather, broadcast from the root)
    #: or ``2 (n - 1)`` for allreduce.
    messages: int
    #: Data bytes sent. Point-to-point ops count exactly the bytes of every
    #: message (a compressed payload's bytes, never a dense array); allgather
    #: counts ``(n - 1)`` times the block, broadcast ``(n - 1)`` times the data
    #: on the root, allreduce ``2 (n - 1) / n`` times the data (what a
    #: bandwidth-optimal ring sends; MPI picks its own algorithm).
    bytes: int
    #: Bytes of the headers that travel with point-to-point messages, 128 per
    #: message (op, sequence number, signature, size, and the layout in words
    #: that a mismatch error shows).
    header_bytes: int


def comm_stats(reset: bool = False) -> dict[str, CommStats]:
    """Traffic this process sent, by op name (ops that ran at least once).

    Counted by the MPI transport where it hands data to MPI, so it is what
    the neighbour ops and collectives sent on every call of every compiled
    function, including inside ``scan`` and ``while_loop``. Not counted: the
    one-sided window ops (MPI RMA) and the 64-byte agreement check each
    collective runs first. Each rank counts its own sends: gather the figures
    with :func:`jaxfog.allgather` for a per-rank table. Read the counters
    between steps: a reset while an op runs may split that op's fields
    between two readings.

    Args:
      reset: zero the counters after reading them.

    Raises:
      RuntimeError: inside :func:`jaxfog.simulate`, where nothing travels;
        a compressor's ``bytes(x)`` gives what its payload would weigh.

    Example::

        jaxfog.comm_stats(reset=True)
        params, state = step(params, state)  # e.g. an atc step: one neighbor_allreduce
        sent = jaxfog.comm_stats()["neighbor_allreduce"].bytes
    """
    V.flag("jaxfog.comm_stats", "reset", reset)
    if _context.current() is not None:
        raise BackendError("jaxfog.comm_stats counts what the MPI transport sends; simulated "
                           "agents send nothing (a compressor's bytes(x) is what its payload "
                           "would weigh)")
    names = {spec.code: name for name, spec in ffi.op_table().items()}
    return {names.get(code, f"op {code}"): CommStats(*row)
            for code, row in sorted(ffi.traffic(reset).items())}


__all__ = ["CommStats", "comm_stats"]
