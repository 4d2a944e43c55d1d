"""Several hosts on one machine: ranks in network namespaces over real TCP links.

The rig (scripts/netns_cluster.py, tests/netns_rig.py) makes every host a
network namespace with its own hostname on a bridge; ``jaxfog run --hostfile``
or ``--hosts`` starts the ranks through hydra's ssh launcher pointed at
``ip netns exec``, so what crosses hosts crosses veth links, where the tests
count it. Values are checked against numpy. Skipped where namespaces cannot
be made (not root).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

from netns_rig import body, launch, netns_cluster_factory  # noqa: F401 (fixture)

#: A payload big enough that its crossing dwarfs the launch's own traffic.
PAYLOAD = 1 << 20  # float32 elements, 4 MB


def layout_and_hierarchical():
    """2 hosts x 2 ranks: machines and local ranks from MPI, hierarchical
    averaging between the hosts against numpy, ``jaxfog info``'s hosts."""
    import socket

    import jax.numpy as jnp

    import jaxfog as jf
    import jaxfog.topology as T
    from jaxfog.cli._command import info_lines

    jf.init()
    r, n = jf.rank(), jf.size()
    assert n == 4
    assert socket.gethostname() == f"node{r // 2}"
    assert (jf.local_rank(), jf.local_size()) == (r % 2, 2)
    assert (jf.machine_rank(), jf.machine_size()) == (r // 2, 2)
    assert jf.is_homogeneous()
    W = np.array([[0.75, 0.25], [0.25, 0.75]])
    jf.set_machine_topology(T.from_weights(W))
    X = np.random.default_rng(0).standard_normal((n, PAYLOAD)).astype(np.float32)
    y = jf.hierarchical_neighbor_allreduce(jnp.asarray(X[r]))
    machine_means = X.reshape(2, 2, PAYLOAD).mean(axis=1)
    np.testing.assert_allclose(y, (W @ machine_means)[r // 2], rtol=1e-5, atol=1e-6)
    lines = info_lines()  # collective
    if r == 0:
        assert "hosts: 2: node0 (ranks 0-1), node1 (ranks 2-3)" in lines, lines
        print("\n".join(lines), flush=True)


def test_two_hosts_layout_hierarchical_and_bytes_on_the_links(netns_cluster_factory):
    cluster = netns_cluster_factory(2)
    before = [cluster.counters(i) for i in range(2)]
    result = body(cluster, 4, __file__, "layout_and_hierarchical", slots=2, timeout=240)
    assert result.ok, result.report()
    after = [cluster.counters(i) for i in range(2)]
    # The leaders exchange the machine means (4 MB each way) over eth0: with
    # shared memory between namespaces (UCX's default) about 16 KB crossed.
    for i in range(2):
        for way in ("rx", "tx"):
            assert after[i][way] - before[i][way] > 4 * PAYLOAD, (i, way, before, after)
