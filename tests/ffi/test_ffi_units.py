"""C++ unit tests of pieces of the FFI library whose invariants no Python
test can pin down deterministically: the scratch pool's choice of buffers
and its byte cap, and the communication thread's order between inline and
queued work. Each is compiled here with the system C++ compiler against the
library's own sources (no entry point of the library exists for tests)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
from paths import REPO

FFI = REPO / "jaxfog" / "ffi"
CXX = shutil.which("g++") or shutil.which("c++")

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")


def _jaxlib_include() -> str:
    spec = importlib.util.find_spec("jaxlib")
    return str(Path(list(spec.submodule_search_locations)[0]) / "include")


def _build_and_run(tmp_path: Path, source: str, *extra: str) -> str:
    main = tmp_path / "main.cc"
    main.write_text(source)
    binary = tmp_path / "main"
    built = subprocess.run([CXX, "-std=c++17", "-O1", "-Wall", "-Werror", "-pthread", "-I",
                            str(FFI), *extra, str(main), "-o", str(binary)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


CHECK = r"""
#include <cstdio>
#include <cstdlib>
#define CHECK(cond)                                                   \
  do {                                                                \
    if (!(cond)) {                                                    \
      std::printf("%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                   \
    }                                                                 \
  } while (false)
"""

SCRATCH_TEST = CHECK + r"""
#include <cstdint>
#include <optional>
#include <vector>

#include "scratch.h"

using jaxfog::ScratchPool;

bool Aligned(const char* p) { return reinterpret_cast<uintptr_t>(p) % 64 == 0; }

int main() {
  {  // Best fit, never a buffer more than 4x the request.
    ScratchPool pool(1 << 20);
    std::optional<ScratchPool::Lease> a(pool.Acquire(1000)), b(pool.Acquire(200)),
        c(pool.Acquire(500));
    CHECK(Aligned(a->data()) && Aligned(b->data()) && Aligned(c->data()));
    CHECK(a->capacity() >= 1000 && b->capacity() >= 200 && c->capacity() >= 500);
    char *pa = a->data(), *pb = b->data(), *pc = c->data();
    a.reset(), b.reset(), c.reset();
    CHECK(pool.free_bytes() == 1152 + 256 + 576);
    CHECK(pool.Acquire(150).data() == pb);  // 256 fits best, not 576 or 1152
    CHECK(pool.Acquire(300).data() == pc);  // 576, not 1152
    CHECK(pool.Acquire(900).data() == pa);
    CHECK(pool.Acquire(10).data() == pb);   // 256 <= 4 * 64
  }
  {  // A large free buffer does not serve a small request.
    ScratchPool pool(1 << 20);
    std::optional<ScratchPool::Lease> large(pool.Acquire(1000));
    char* freed = large->data();
    large.reset();
    std::optional<ScratchPool::Lease> small(pool.Acquire(100));  // 1152 > 4 * 100
    CHECK(small->data() != freed && Aligned(small->data()));
    CHECK(pool.free_bytes() == 1152);
  }
  {  // The byte cap: larger buffers are freed, the least recently returned go first.
    ScratchPool pool(2000);
    std::optional<ScratchPool::Lease> x(pool.Acquire(1500));
    x.reset();
    CHECK(pool.free_bytes() == 1728);
    std::optional<ScratchPool::Lease> y(pool.Acquire(3000));  // over the cap
    y.reset();
    CHECK(pool.free_bytes() == 1728);
    std::optional<ScratchPool::Lease> z(pool.Acquire(400)), w(pool.Acquire(100));
    z.reset();  // 1728 + 512 > 2000: x goes
    CHECK(pool.free_bytes() == 512);
    w.reset();
    CHECK(pool.free_bytes() == 512 + 128);
    pool.set_keep_bytes(0);
    pool.Acquire(100);
    CHECK(pool.free_bytes() == 512);  // taken 128 and not given back
  }
  {  // At most kMaxFree buffers, however small.
    ScratchPool pool(1 << 30);
    std::vector<ScratchPool::Lease> leases;
    for (int i = 0; i < 40; ++i) leases.push_back(pool.Acquire(64));
    leases.clear();
    CHECK(pool.free_bytes() == ScratchPool::kMaxFree * 128);
  }
  std::printf("ok\n");
  return 0;
}
"""

COMM_THREAD_TEST = CHECK + r"""
#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm_thread.h"

using jaxfog::CommThread;
namespace ffi = ::xla::ffi;

std::optional<std::string> Wait(ffi::Future future) {  // the error message, if any
  std::promise<std::optional<std::string>> done;
  future.OnReady([&done](const std::optional<ffi::Error>& error) {
    done.set_value(error && !error->success() ? std::optional<std::string>(error->message())
                                               : std::nullopt);
  });
  return done.get_future().get();
}

std::mutex mutex;
std::vector<std::string> events;
void Record(const std::string& what) {
  std::lock_guard<std::mutex> lock(mutex);
  events.push_back(what);
}

// Work that records `name` after `ms`, with `started` set when it begins.
CommThread::Work Slow(const std::string& name, int ms, std::atomic<bool>* started) {
  return [=] {
    started->store(true);
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    Record(name);
    return ffi::Error::Success();
  };
}

ffi::Error ThrowsOutOfMemory(int) { throw std::bad_alloc(); }
ffi::Future ThrowsWhileDecoding(int) { throw std::runtime_error("decode"); }
ffi::Error Fine(int) { return ffi::Error::Success(); }

CommThread::Work Quick(const std::string& name) {
  return [=] {
    Record(name);
    return ffi::Error::Success();
  };
}

int main() {
  CommThread& thread = CommThread::Global();
  thread.set_inline_below(1000);
  {  // A small op handed over while a large one runs on the thread waits for it.
    std::atomic<bool> started{false};
    ffi::Future large = thread.Run("large", 1 << 20, Slow("large", 200, &started));
    while (!started) std::this_thread::yield();
    ffi::Future small = thread.Run("small", 8, Quick("small"));
    CHECK(!Wait(std::move(large)) && !Wait(std::move(small)));
    CHECK((events == std::vector<std::string>{"large", "small"}));
  }
  events.clear();
  {  // ... and while one runs inline on another thread.
    std::atomic<bool> started{false};
    std::optional<ffi::Future> first;
    std::thread caller([&] { first = thread.Run("first", 8, Slow("first", 200, &started)); });
    while (!started) std::this_thread::yield();
    ffi::Future second = thread.Run("second", 8, Quick("second"));
    caller.join();
    CHECK(!Wait(std::move(*first)) && !Wait(std::move(second)));
    CHECK((events == std::vector<std::string>{"first", "second"}));
  }
  events.clear();
  {  // With nothing queued or running, a small op runs inline, a large one does not.
    const std::thread::id me = std::this_thread::get_id();
    std::thread::id small_on, large_on;
    CHECK(!Wait(thread.Run("small", 8, [&] {
      small_on = std::this_thread::get_id();
      return ffi::Error::Success();
    })));
    CHECK(!Wait(thread.Run("large", 1 << 20, [&] {
      large_on = std::this_thread::get_id();
      return ffi::Error::Success();
    })));
    CHECK(small_on == me && large_on != me);
  }
  for (size_t bytes : {size_t{8}, size_t{1} << 20}) {  // inline and on the thread
    // An exception fails the op with an error naming it; the thread goes on.
    std::optional<std::string> oom = Wait(thread.Run(
        "neighbor_allreduce", bytes, []() -> ffi::Error { throw std::bad_alloc(); }));
    CHECK(oom && oom->find("jaxfog neighbor_allreduce: out of memory") != std::string::npos);
    std::optional<std::string> other = Wait(thread.Run("allreduce", bytes, []() -> ffi::Error {
      throw std::runtime_error("boom");
    }));
    CHECK(other && other->find("jaxfog allreduce: failed with an exception: boom") !=
                       std::string::npos);
    CHECK(!Wait(thread.Run("broadcast", bytes, Quick("after"))));
  }
  CHECK((events == std::vector<std::string>{"after", "after"}));
  {  // An exception while a handler decodes its call: the op's error, no terminate.
    using jaxfog::Guard, jaxfog::OpCode;
    ffi::Error error = Guard<OpCode::kAllreduce, &ThrowsOutOfMemory>::Run(1);
    CHECK(!error.success() &&
          error.message().find("jaxfog allreduce: out of memory") != std::string::npos);
    std::optional<std::string> later =
        Wait(Guard<OpCode::kBroadcast, &ThrowsWhileDecoding>::Run(1));
    CHECK(later && later->find("jaxfog broadcast: failed with an exception: decode") !=
                       std::string::npos);
    ffi::Error fine = Guard<OpCode::kBarrier, &Fine>::Run(1);
    CHECK(fine.success());
  }
  thread.Drain();
  std::printf("ok\n");
  return 0;
}
"""


def test_scratch_pool_best_fit_and_byte_cap(tmp_path):
    assert _build_and_run(tmp_path, SCRATCH_TEST).strip() == "ok"


def test_comm_thread_order_and_exceptions(tmp_path):
    sources = [str(FFI / "comm_thread.cc"), str(FFI / "timeline.cc")]
    out = _build_and_run(tmp_path, COMM_THREAD_TEST, "-isystem", _jaxlib_include(), *sources)
    assert out.strip() == "ok"


PLAN_TABLE_TEST = r"""
#include <cassert>
#include <cstdio>
#include <string>
#include "plan_table.h"
using jaxfog::PlanTables;

std::string Refused(PlanTables plan) {
  auto id = jaxfog::DefinePlan(plan);
  return id.has_error() ? id.error().message() : "";
}

int main() {
  // Two entries: step 0 sends to 1 and hears 2; step 1 sends to 2 and 3, hears 1.
  const PlanTables a{{0.5, 0.25}, {0, 1, 3}, {1, 2, 3}, {1.0, 1.0, 1.0},
                     {0, 1, 2}, {2, 1}, {0.5, 0.75}};
  PlanTables b = a;
  b.recv_weights[1] = 0.5;
  assert(*jaxfog::DefinePlan(a) == 0);
  assert(*jaxfog::DefinePlan(b) == 1);
  assert(*jaxfog::DefinePlan(a) == 0);  // an equal plan keeps its id
  assert((*jaxfog::FindPlan(1))->recv_weights == b.recv_weights);
  PlanTables bad = a;
  bad.self_weights.clear();
  assert(Refused(bad).find("no entry") != std::string::npos);
  bad = a;
  bad.send_weights.pop_back();
  assert(Refused(bad).find("ranks and weights of different lengths") != std::string::npos);
  bad = a;
  bad.send_offsets = {0, 3, 1};  // not increasing
  assert(Refused(bad).find("offsets that do not cut") != std::string::npos);
  bad = a;
  bad.recv_offsets = {0, 1, 3};  // past the ranks
  assert(Refused(bad).find("offsets that do not cut") != std::string::npos);
  bad = a;
  bad.recv_offsets = {0, 2};  // one entry short
  assert(Refused(bad).find("offsets that do not cut") != std::string::npos);
  jaxfog::ForgetPlans();
  auto gone = jaxfog::FindPlan(0);
  assert(gone.has_error());
  assert(gone.error().message().find("plan 0 is not defined") != std::string::npos);
  assert(jaxfog::FindPlan(-1).has_error());
  assert(*jaxfog::DefinePlan(b) == 0);  // ids count from 0 again
  std::puts("ok");
  return 0;
}
"""


def test_plan_table_ids_dedup_refusals_and_forgetting(tmp_path):
    """The process's table of neighbour-averaging plans: an equal plan keeps
    its id, a malformed one is refused saying why, and after ForgetPlans an id
    is not found and ids count from 0 again."""
    out = _build_and_run(tmp_path, PLAN_TABLE_TEST, "-UNDEBUG", "-isystem", _jaxlib_include(),
                         str(FFI / "plan_table.cc"))
    assert out.strip() == "ok"


# --- the NCCL transport's logic, on the host ---------------------------------------------
# NCCL and CUDA events are host stand-ins (a table each, as the transport
# takes them); the MPI transport doing the header checks is real, on 2 ranks.

NCCL_TEST = CHECK + r"""
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "nccl_transport.h"

using namespace jaxfog;
namespace ffi = ::xla::ffi;

std::mutex mutex;
std::vector<std::string> calls;  // the NCCL calls made, in order
struct Posted { const void* from; void* to; size_t bytes; };
std::vector<const void*> sent;
std::vector<std::pair<void*, size_t>> received;
std::atomic<bool> gpu_stuck{false};  // events never complete
std::atomic<ncclResult_t> async_error{ncclSuccess};

void Log(const std::string& call) {
  std::lock_guard<std::mutex> lock(mutex);
  calls.push_back(call);
}
int Count(const std::string& call) {
  std::lock_guard<std::mutex> lock(mutex);
  int n = 0;
  for (const std::string& c : calls) n += c == call;
  return n;
}

ncclResult_t GroupStart() { Log("GroupStart"); return ncclSuccess; }
ncclResult_t GroupEnd() {  // a self exchange: each receive gets the matching send
  Log("GroupEnd");
  for (size_t i = 0; i < received.size() && i < sent.size(); ++i) {
    std::memcpy(received[i].first, sent[i], received[i].second);
  }
  sent.clear(), received.clear();
  return ncclSuccess;
}
ncclResult_t Send(const void* data, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t) {
  Log("Send");
  sent.push_back(data);
  return ncclSuccess;
}
ncclResult_t Recv(void* data, size_t bytes, ncclDataType_t, int, ncclComm_t, cudaStream_t) {
  Log("Recv");
  received.emplace_back(data, bytes);
  return ncclSuccess;
}
ncclResult_t AllReduce(const void* in, void* out, size_t count, ncclDataType_t type, ncclRedOp_t,
                       ncclComm_t, cudaStream_t) {
  Log("AllReduce");
  CHECK(type == ncclFloat32);
  std::memcpy(out, in, count * 4);
  return ncclSuccess;
}
ncclResult_t GetAsyncError(ncclComm_t, ncclResult_t* error) {
  *error = async_error.load();
  return ncclSuccess;
}
ncclResult_t Abort(ncclComm_t) { Log("CommAbort"); return ncclSuccess; }
ncclResult_t Destroy(ncclComm_t) { Log("CommDestroy"); return ncclSuccess; }
const char* ErrorString(ncclResult_t) { return "unhandled cuda error (fake)"; }
const char* LastError(ncclComm_t) { return ""; }

cudaError_t EventCreate(cudaEvent_t* event, unsigned int) {
  *event = reinterpret_cast<cudaEvent_t>(new int(0));
  return cudaSuccess;
}
cudaError_t EventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
cudaError_t EventQuery(cudaEvent_t) { return gpu_stuck ? cudaErrorNotReady : cudaSuccess; }
cudaError_t EventDestroy(cudaEvent_t event) {
  delete reinterpret_cast<int*>(event);
  return cudaSuccess;
}

NcclApi api;
const EventApi events{&EventCreate, &EventRecord, &EventQuery, &EventDestroy};
int rank = 0, size = 1;

std::unique_ptr<NcclTransport> Make(double timeout) {
  MPI_Comm comm;
  CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &comm) == MPI_SUCCESS);  // freed at exit
  auto checks = MpiTransport::Create(comm, 20.0, 1 << 20);
  CHECK(checks.has_value());
  calls.clear();
  return std::make_unique<NcclTransport>(&api, &events, reinterpret_cast<ncclComm_t>(&api),
                                         std::move(*checks), timeout);
}

OpInfo Op(OpCode op) { return OpInfo{op, 42, LayoutText::From("f32[4]")}; }

bool Has(const ffi::Error& error, const std::string& text) {
  if (error.success()) return false;
  if (error.message().find(text) != std::string::npos) return true;
  std::printf("rank %d: %s\n", rank, error.message().c_str());
  return false;
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  api.GetErrorString = &ErrorString, api.GetLastError = &LastError;
  api.CommDestroy = &Destroy, api.CommAbort = &Abort, api.CommGetAsyncError = &GetAsyncError;
  api.GroupStart = &GroupStart, api.GroupEnd = &GroupEnd, api.Send = &Send, api.Recv = &Recv;
  api.AllReduce = &AllReduce;
  const int other = 1 - rank;
  float a[4] = {1, 2, 3, 4}, b[4] = {};
  {  // A self exchange: headers over MPI, then one group; fenced, so destroyed.
    auto nccl = Make(20.0);
    CHECK(nccl->Exchange(Op(OpCode::kNeighborAllreduce), {{rank, {{a, 16}}}},
                         {{rank, {{b, 16}}}}, nullptr).success());
    CHECK(b[3] == 4.0f && nccl->sequence() == 1);
    CHECK((calls == std::vector<std::string>{"GroupStart", "Send", "Recv", "GroupEnd"}));
    CHECK(nccl->Fence().success());
    nccl.reset();
    CHECK(Count("CommDestroy") == 1 && Count("CommAbort") == 0);
  }
  {  // Validation before the header check and before any NCCL call.
    auto nccl = Make(20.0);
    NcclBuffer complex{a, b, 2, ffi::DataType::C64, 16};
    CHECK(Has(nccl->Allreduce(Op(OpCode::kAllreduce), {{a, b, 4, ffi::DataType::F32, 16},
                                                      complex}, nullptr),
              "NCCL cannot sum dtype complex64"));
    CHECK(Has(nccl->Exchange(Op(OpCode::kNeighborAllgather), {{size, {{a, 16}}}}, {}, nullptr),
              "rank " + std::to_string(size) + " is out of range"));
    CHECK(Has(nccl->Broadcast(Op(OpCode::kBroadcast), {{a, b, 4, ffi::DataType::F32, 16}}, -1,
                              nullptr), "the root is out of range"));
    CHECK(calls.empty() && nccl->sequence() == 0);
    // Not fenced (e.g. set-up failed on another rank): aborted, not destroyed.
    nccl.reset();
    CHECK((calls == std::vector<std::string>{"CommAbort"}));
  }
  {  // Header checks across ranks: other sizes, another op; NCCL never called.
    auto nccl = Make(20.0);
    CHECK(Has(nccl->Allreduce(Op(OpCode::kAllreduce),
                              {{a, b, rank ? 2u : 4u, ffi::DataType::F32, rank ? 8u : 16u}},
                              nullptr),
              "differ"));
    const OpCode op = rank ? OpCode::kNeighborAllgather : OpCode::kNeighborAllreduce;
    CHECK(Has(nccl->Exchange(Op(op), {{other, {{a, 16}}}}, {{other, {{b, 16}}}}, nullptr),
              "ranks called different operations"));
    CHECK(calls.empty());
    CHECK(nccl->Allreduce(Op(OpCode::kAllreduce), {{a, b, 4, ffi::DataType::F32, 16}}, nullptr)
              .success());
    CHECK((calls == std::vector<std::string>{"GroupStart", "AllReduce", "GroupEnd"}));
    CHECK(nccl->Fence().success());
  }
  {  // The watchdog: work that never finishes aborts the communicator, once,
     // and names the op; every later op fails with that reason.
    auto nccl = Make(0.3);
    gpu_stuck = true;
    CHECK(nccl->Exchange(Op(OpCode::kNeighborAllreduce), {{rank, {{a, 16}}}},
                         {{rank, {{b, 16}}}}, nullptr).success());
    for (int i = 0; i < 200 && !Count("CommAbort"); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    CHECK(Count("CommAbort") == 1);
    const ffi::Error later = nccl->Allreduce(Op(OpCode::kAllreduce),
                                             {{a, b, 4, ffi::DataType::F32, 16}}, nullptr);
    CHECK(Has(later, "jaxfog neighbor_allreduce (NCCL, op #1 on rank " + std::to_string(rank) +
                     ", sends to ranks [" + std::to_string(rank) + "], receives from ranks [" +
                     std::to_string(rank) + "]) timed out after 0.3 s (JAXFOG_TIMEOUT)"));
    CHECK(Has(nccl->Fence(), "the NCCL communicator was aborted"));
    nccl.reset();
    CHECK(Count("CommAbort") == 1 && Count("CommDestroy") == 0);
    gpu_stuck = false;
  }
  {  // An asynchronous NCCL error aborts too.
    auto nccl = Make(20.0);
    async_error = ncclUnhandledCudaError;
    for (int i = 0; i < 200 && !Count("CommAbort"); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    CHECK(Has(nccl->Exchange(Op(OpCode::kNeighborAllreduce), {}, {}, nullptr),
              "NCCL reported an error: unhandled cuda error (fake)"));
    async_error = ncclSuccess;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  std::printf("ok\n");
  MPI_Finalize();
  return 0;
}
"""


def test_nccl_transport_checks_validates_and_watches(tmp_path):
    """Self exchange through one group; arguments validated before the header
    check and NCCL; header mismatches stop both ranks before NCCL; a stuck GPU
    or an NCCL error aborts the communicator once, and later ops say why; the
    communicator is destroyed only after a fence."""
    import nvidia.nccl  # noqa: F401  (the headers)

    from jaxfog import ffi

    info = ffi.build_info()
    if not (info.get("nccl_built") and info.get("cudart")):
        pytest.skip("the library was built without NCCL")
    mpicxx, mpiexec = ffi.mpi_tools()
    assert mpicxx and mpiexec, f"no MPI wrappers for the library's MPI ({info['mpicxx']})"
    nccl_include = Path(list(nvidia.nccl.__path__)[0]) / "include"
    cuda = Path(info["cuda_home"])
    main = tmp_path / "main.cc"
    main.write_text(NCCL_TEST)
    binary = tmp_path / "main"
    sources = [str(FFI / name) for name in ("nccl_transport.cc", "nccl_api.cc",
                                            "mpi_transport.cc", "message_header.cc",
                                            "mpi_requests.cc", "peer_watch.cc",
                                            "timeline.cc")]
    built = subprocess.run(
        [mpicxx, "-std=c++17", "-O1", "-Wall", "-Werror", "-pthread",
         "-DJAXFOG_WITH_CUDA=1", "-DJAXFOG_WITH_NCCL=1", "-I", str(FFI), "-isystem",
         _jaxlib_include(), "-isystem", str(cuda / "include"), "-isystem", str(nccl_include),
         str(main), *sources, "-o", str(binary), info["cudart"], "-ldl", "-lrt"],
        capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    done = subprocess.run([mpiexec, "-n", "2", str(binary)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    # Each rank prints "ok" (mpiexec may interleave the two lines' characters).
    assert done.stdout.count("ok") == 2, done.stdout + done.stderr
    assert "jaxfog watchdog: jaxfog neighbor_allreduce (NCCL" in done.stderr, done.stderr


def _build_with_peer_watch(tmp_path, source: str):
    """``source`` (a C++ main) compiled with peer_watch.cc by the library's MPI
    compiler wrapper; returns the binary's path."""
    from jaxfog import ffi

    mpicxx, _ = ffi.mpi_tools()
    assert mpicxx, "no MPI compiler wrapper for the library's MPI"
    binary = tmp_path / "main"
    (tmp_path / "main.cc").write_text(source)
    built = subprocess.run(
        [mpicxx, "-std=c++17", "-O1", "-Wall", "-Werror", "-pthread", "-I", str(FFI),
         "-isystem", _jaxlib_include(), str(tmp_path / "main.cc"), str(FFI / "peer_watch.cc"),
         "-o", str(binary)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    return binary


INSIDE_MPI_TEST = r"""
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "peer_watch.h"

int main(int argc, char** argv) {
  const bool stuck = argc > 1 && std::strcmp(argv[1], "stuck") == 0;
  // JAXFOG_TIMEOUT 0.5 s: the watchdog ends a call not returned after 2.5 s.
  jaxfog::InsideMpi inside("jaxfog neighbor_allreduce (op #7 on rank 0)", 0.5);
  jaxfog::InsideMpi never("jaxfog allreduce (op #1 on rank 0)", 0);  // no timeout: no watch
  never.Enter("MPI_Testsome", -1);
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - start < std::chrono::seconds(4)) {
    inside.Enter("MPI_Isend of data", 3);
    if (stuck) std::this_thread::sleep_for(std::chrono::seconds(4));  // a call that blocks
    inside.Leave();
  }
  std::printf("returned\n");
  return 0;
}
"""


@pytest.mark.parametrize("stuck", [False, True])
def test_an_mpi_call_that_never_returns_ends_the_process_saying_where(tmp_path, stuck):
    """A dead peer can block MPI_Isend for ever (MPICH's ch4:ofi over tcp): the
    watchdog then names the op, the call and the peer and ends the process
    (status 1) JAXFOG_TIMEOUT + 2 s after the call began. Calls that return,
    however many, and ops without a timeout, are left alone."""
    import time

    binary = _build_with_peer_watch(tmp_path, INSIDE_MPI_TEST)
    start = time.monotonic()
    done = subprocess.run([str(binary), "stuck" if stuck else "fine"], capture_output=True,
                          text=True, timeout=60)
    seconds = time.monotonic() - start
    if not stuck:
        assert done.returncode == 0 and done.stdout == "returned\n", done.stdout + done.stderr
        assert done.stderr == ""
        return
    assert done.returncode == 1 and "returned" not in done.stdout, done.stdout + done.stderr
    assert done.stderr == (
        "jaxfog neighbor_allreduce (op #7 on rank 0): MPI_Isend of data (rank 3) has not "
        "returned after 2.5 s (JAXFOG_TIMEOUT + 2 s): MPI is stuck, a peer died or cannot be "
        "reached; ending this process with status 1\n"), done.stderr
    assert seconds > 2.4, seconds  # not before the limit


INTERRUPT_TEST = CHECK + r"""
#include <signal.h>

#include <atomic>
#include <cstring>
#include <string>

#include "peer_watch.h"

std::atomic<int> python_ran{0};  // stands for Python's C handler (trips KeyboardInterrupt)
void Python(int) { python_ran.fetch_add(1); }

int main() {
  // SIG_DFL: no handler to chain to, SIGINT left as it is.
  CHECK(!jaxfog::CatchInterrupts());
  struct sigaction python;
  std::memset(&python, 0, sizeof(python));
  python.sa_handler = &Python;
  python.sa_flags = SA_ONSTACK;  // Python's flags: no SA_RESTART
  sigemptyset(&python.sa_mask);
  CHECK(sigaction(SIGINT, &python, nullptr) == 0);
  CHECK(jaxfog::CatchInterrupts());
  CHECK(jaxfog::CatchInterrupts());  // once only: not chained to itself
  struct sigaction now;
  CHECK(sigaction(SIGINT, nullptr, &now) == 0);
  CHECK((now.sa_flags & SA_SIGINFO) && !(now.sa_flags & SA_RESTART));
  {
    const jaxfog::EndableWait wait;
    CHECK(!wait.Interrupted());
    raise(SIGINT);
    CHECK(python_ran.load() == 1);  // Python's handler still runs, once
    CHECK(wait.Interrupted());      // and the wait in flight sees it
  }
  raise(SIGINT);  // between waits: Python's handler alone matters
  CHECK(python_ran.load() == 2);
  const jaxfog::EndableWait later;
  CHECK(!later.Interrupted());  // a signal before a wait does not end it
  const xla::ffi::Error error = jaxfog::InterruptedError(
      "jaxfog allreduce (op #3 on rank 1)", "the other ranks");
  CHECK(error.message() == "jaxfog allreduce (op #3 on rank 1): interrupted (SIGINT) while "
                           "waiting for the other ranks; its messages are abandoned half-way, "
                           "so jaxfog's communication in this process may be unusable now: "
                           "end the program");
  CHECK(jaxfog::CommFailed());  // the exit is bounded after it
  std::printf("ok\n");
  return 0;
}
"""


def test_sigint_handler_chains_to_pythons_and_ends_only_waits_in_flight(tmp_path):
    """The SIGINT handler goes in only in front of a handler (Python's), which
    still runs on every signal; a wait in flight sees the signal, a wait begun
    after it does not; the error names the op and says it was interrupted."""
    binary = _build_with_peer_watch(tmp_path, INTERRUPT_TEST)
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stdout + done.stderr
