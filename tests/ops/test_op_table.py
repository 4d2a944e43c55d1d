"""The FFI library's op table (jaxfog/ffi/ops.h), read without an MPI launch."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from jaxfog import ffi

pytestmark = pytest.mark.jax_internals

#: Exported C entry points of c_api.cc: everything else named jaxfog_* is a handler.
C_API = {"jaxfog_register_mpi_comm", "jaxfog_release_comm", "jaxfog_timeline_start",
         "jaxfog_timeline_flush", "jaxfog_keep_freed_memory", "jaxfog_set_scratch_keep_bytes",
         "jaxfog_set_comm_thread_min_bytes", "jaxfog_comm_thread_min_bytes",
         "jaxfog_mpi_library_version",
         "jaxfog_mpi_query_thread", "jaxfog_xla_ffi_api_version", "jaxfog_link_info",
         "jaxfog_build_info", "jaxfog_op_table", "jaxfog_win_create", "jaxfog_win_fill",
         "jaxfog_win_free", "jaxfog_win_query", "jaxfog_win_mutex", "jaxfog_traffic",
         "jaxfog_nccl_id_bytes", "jaxfog_nccl_load", "jaxfog_nccl_unique_id",
         "jaxfog_register_nccl_comm", "jaxfog_drop_nccl_comm", "jaxfog_cuda_device_uuid",
         "jaxfog_watch_peers", "jaxfog_say_goodbye", "jaxfog_unwatch_peers", "jaxfog_bound_exit",
         "jaxfog_set_staging_keep_bytes", "jaxfog_handle_done", "jaxfog_handles_discard",
         "jaxfog_catch_interrupts", "jaxfog_define_plan",
         "jaxfog_set_send_receipts"}


def handler_symbols() -> set[str]:
    """Per op, its handler and its two host-staged forms (CUDA buffers, and
    CPU buffers for the tests); per nonblocking op, its two starts (CPU,
    CUDA); the waits; the NCCL transport's handlers if built."""
    table = ffi.op_table().values()
    symbols = {spec.target + suffix for spec in table
               for suffix in ("", "_staged", "_host_staged")}
    symbols |= {spec.target + suffix for spec in table if spec.nonblocking
                for suffix in ("_start", "_start_staged")}
    symbols |= {"jaxfog_wait", "jaxfog_wait_staged"}
    return symbols | (set(ffi.nccl_targets()) if ffi.nccl_built() else set())

MESSAGE_OPS = {"neighbor_allreduce": 1, "neighbor_allgather": 2, "neighbor_reduce_scatter": 3,
               "allreduce": 4, "broadcast": 5, "allgather": 6}


def test_names_codes_and_targets_are_unique_and_resolve():
    table = ffi.op_table()
    specs = list(table.values())
    assert [spec.name for spec in specs] == list(table)
    assert len({spec.name for spec in specs}) == len(specs)
    assert len({spec.code for spec in specs}) == len(specs)
    assert len({spec.target for spec in specs}) == len(specs)
    for spec in specs:
        assert spec.target == f"jaxfog_{spec.name}"
        assert hasattr(ffi.library(), spec.target), spec.target


def test_table_lists_exactly_the_exported_handlers():
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is needed to list the library's symbols")
    out = subprocess.run([nm, "-D", "--defined-only", str(ffi.LIBRARY_PATH)],
                         capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines()
                if line.split() and line.split()[-1].startswith("jaxfog_")}
    assert C_API <= exported
    assert exported - C_API == handler_symbols()


def test_message_op_codes_are_unchanged():
    # They travel in message headers: ranks running different builds must agree.
    table = ffi.op_table()
    assert {name: table[name].code for name in MESSAGE_OPS} == MESSAGE_OPS


def test_register_handlers_registers_every_target(monkeypatch):
    import jax

    registered = []
    monkeypatch.setattr(jax.ffi, "register_ffi_target",
                        lambda name, *args, platform, **kwargs: registered.append((name, platform)))
    ffi.register_handlers.__wrapped__()  # uncached: the cached one may have run already
    table = ffi.op_table().values()
    targets = ([spec.target for spec in table] + [spec.target + "_start" for spec in table
                                                  if spec.nonblocking] + ["jaxfog_wait"])
    expected = [(t, "cpu") for t in targets]
    if ffi.cuda_built():  # the same names, bound to the host-staged CUDA handlers
        expected += [(t, "CUDA") for t in targets]
    if ffi.nccl_built():
        expected += [(t, "CUDA") for t in ffi.nccl_targets()]
    assert sorted(registered) == sorted(expected)


def test_python_primitives_name_exactly_the_table_targets():
    """Every primitive (and FFI query) of jaxfog.ops lowers to a target of the
    library's table, and every table entry has its primitive."""
    import importlib

    import jaxfog.ops
    from jaxfog.ops import _primitive_machinery

    for family in set(jaxfog.ops.OPS.values()):  # jaxfog.ops is lazy: define every primitive
        importlib.import_module(f"jaxfog.ops.{family}")

    assert _primitive_machinery.TARGETS == {name: spec.target
                                            for name, spec in ffi.op_table().items()}


def test_the_nonblocking_ops_are_exactly_those_python_starts():
    """Start handlers exist for the ops a ``*_nonblocking`` function starts
    and for neighbor_reduce_scatter, the adjoint neighbor_allgather's start
    transposes to (``ADJOINTS``); none for rank, size, barrier, fence,
    win_update and win_state."""
    import jaxfog.ops

    table = ffi.op_table()
    public = {name.removesuffix("_nonblocking") for name in jaxfog.ops.OPS
              if name.endswith("_nonblocking")}
    assert {name for name, spec in table.items() if spec.nonblocking} == (
        (public & set(table)) | {"neighbor_reduce_scatter"})
    assert not {"rank", "size", "barrier", "fence", "win_update", "win_state"} & {
        name for name, spec in table.items() if spec.nonblocking}


def test_nccl_rules_cover_exactly_the_ops_with_an_nccl_handler():
    """An op lowers to NCCL on GPU arrays through its rule (registered in
    jaxfog.ops._nccl beside its primitive, in the op's module) and the NCCL
    handler the op table names for it: the two lists agree."""
    import importlib

    import jaxfog.ops
    from jaxfog.ops import _nccl

    for family in set(jaxfog.ops.OPS.values()):  # every primitive with its rule
        importlib.import_module(f"jaxfog.ops.{family}")

    table = ffi.op_table()
    assert set(_nccl.RULES) == {name for name, spec in table.items() if spec.nccl_target}
