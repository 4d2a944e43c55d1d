"""The hot path does not fault in fresh pages every call: freed memory stays in
the process (JAXFOG_KEEP_FREED_BYTES), so MPI's temporaries and XLA's new
outputs land on pages already mapped. And an op that runs out of memory for
its buffers fails with an error naming it, on the communication thread as
inline, and the rank goes on."""

from __future__ import annotations

import json

import pytest

from jaxfog.testing import run_mpi

pytestmark = pytest.mark.jax_internals


def faults_per_step_body():
    import os
    import resource

    import jax.numpy as jnp
    import numpy as np

    import jaxfog as jf

    jf.init()
    r, n = jf.rank(), jf.size()
    x = jnp.full(1 << 20, float(r))  # 4 MiB: 1024 pages
    step = jf.jit(lambda x: jf.allreduce(x, op="sum"))
    for _ in range(30):  # malloc settles on the sizes a step uses
        step(x).block_until_ready()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        total = step(x).block_until_ready()
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20
    np.testing.assert_allclose(total[::4096], n * (n - 1) / 2)
    with open(os.path.join(os.environ["RESULT_DIR"], f"rank{r}.json"), "w") as f:
        json.dump(faults, f)


def _faults(tmp_path, keep: str) -> float:
    folder = tmp_path / keep
    folder.mkdir()
    result = run_mpi(2, __file__, "faults_per_step_body", timeout=120,
                     env={"RESULT_DIR": str(folder), "JAXFOG_KEEP_FREED_BYTES": keep})
    assert result.ok, result.report()
    return max(json.loads(p.read_text()) for p in folder.glob("rank*.json"))


def test_steady_state_steps_reuse_mapped_pages(tmp_path):
    kept = _faults(tmp_path, str(512 << 20))  # the default
    returned = _faults(tmp_path, "0")  # malloc as it is
    # Measured here: 0-154 against 500-880 faults per step on jax 0.10 (1024
    # pages a buffer); on jax 0.12, whose CPU client reuses more on its own,
    # 154 against 277. A step that faulted in a fresh 4 MiB buffer would
    # take 1024: the bound is absolute, malloc's figure is for the message.
    assert kept < 300, (kept, returned)


def out_of_memory_body():
    import resource

    import jax.numpy as jnp
    import numpy as np
    import pytest

    import jaxfog as jf

    jf.init()
    r = jf.rank()
    count = 16 << 20  # float32: 64 MiB a message; the op's receive buffer is as large
    x = jnp.full(count, float(r))
    step = jf.jit(lambda x: jf.neighbor_allreduce(x, self_weight=0.5, src_weights={1 - r: 0.5}))
    step(x).block_until_ready()  # compiled, threads and their malloc arenas made
    want = np.full(4, 0.5)

    def mapped_bytes() -> int:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) << 10
        raise RuntimeError("no VmSize")

    # A real memory limit (as under ulimit -v or a container's): room for XLA's
    # output and some slack, not for the op's receive buffer. No scratch buffer
    # is kept between calls (JAXFOG_SCRATCH_KEEP_BYTES=0), so the op allocates
    # one, fails with std::bad_alloc, and the rank must get an error, not die.
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (mapped_bytes() + 4 * count + 2 * count, hard))
    try:
        with pytest.raises(Exception, match=r"jaxfog neighbor_allreduce: out of memory for its "
                                            r"buffers \(std::bad_alloc\)"):
            step(x).block_until_ready()
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    # Every rank failed before sending anything: they are still in step.
    np.testing.assert_allclose(np.asarray(step(x)[:4]), want)
    jf.barrier()


@pytest.mark.parametrize("comm_thread_min_bytes", ["0", "off"])
def test_an_op_out_of_memory_fails_with_an_error_and_the_rank_goes_on(comm_thread_min_bytes):
    # "0": the op runs on the communication thread; "off": inline in XLA's.
    result = run_mpi(2, __file__, "out_of_memory_body", timeout=120,
                     env={"JAXFOG_SCRATCH_KEEP_BYTES": "0",
                          "JAXFOG_COMM_THREAD_MIN_BYTES": comm_thread_min_bytes})
    assert result.ok, result.report()
