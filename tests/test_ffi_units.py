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

FFI = Path(__file__).resolve().parent.parent / "jaxfog" / "ffi"
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
    std::optional<std::string> oom = Wait(thread.Run("neighbor_allreduce", bytes,
                                                     []() -> ffi::Error { throw std::bad_alloc(); }));
    CHECK(oom && oom->find("jaxfog neighbor_allreduce: out of memory") != std::string::npos);
    std::optional<std::string> other = Wait(thread.Run("allreduce", bytes, []() -> ffi::Error {
      throw std::runtime_error("boom");
    }));
    CHECK(other && other->find("jaxfog allreduce: failed with an exception: boom") !=
                       std::string::npos);
    CHECK(!Wait(thread.Run("broadcast", bytes, Quick("after"))));
  }
  CHECK((events == std::vector<std::string>{"after", "after"}));
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
