// One-sided windows: memory that other ranks write into and read from with no
// matching call on this rank (BlueFog's win_* ops, functional form).
//
// A window of one rank holds regions of `region_bytes` each: region 0 is the
// rank's published value (what others get), region 1 + s is slot s, written
// by the s-th of the ranks this window receives from. A region is the
// window's leaves back to back at fixed offsets, then, for a window with a
// push-sum weight, that weight (a float64 at `weight_offset`).
//
// Beside the regions every rank has control words: word 0 is the window's
// mutex (0 when free, else 1 + the holder's rank), word r (r >= 1) counts
// the puts and gets into region r since it was last read by an update. The
// control words are only ever accessed atomically.
#ifndef JAXFOG_FFI_WINDOW_H_
#define JAXFOG_FFI_WINDOW_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxfog {

namespace ffi = ::xla::ffi;

// A run of one dtype's elements inside a region.
struct TypedRun {
  ffi::DataType type;
  size_t offset;  // within the region
  const void* data;
  size_t bytes;
};

// Where a window's leaves (and weight) sit inside each region.
struct WindowLayout {
  struct Leaf {
    ffi::DataType type;
    size_t offset;
    size_t bytes;
  };
  std::vector<Leaf> leaves;
  size_t message_bytes = 0;    // the leaves' extent (64-byte aligned)
  int64_t weight_offset = -1;  // the push-sum weight's offset; -1: no weight
  size_t region_bytes() const { return message_bytes + (weight_offset >= 0 ? 64 : 0); }
};

class Window {
 public:
  explicit Window(WindowLayout layout) : layout_(std::move(layout)) {}
  Window(const Window&) = delete;
  Window& operator=(const Window&) = delete;
  virtual ~Window() = default;

  const WindowLayout& layout() const { return layout_; }
  size_t region_bytes() const { return layout_.region_bytes(); }
  bool has_weight() const { return layout_.weight_offset >= 0; }
  virtual int rank() const = 0;
  virtual int64_t slots() const = 0;

  // Writes the runs into `peer`'s region `region` (replacing, or adding with
  // `accumulate`), and with `count` adds 1 to that region's version there;
  // complete at the target when this returns.
  virtual ffi::Error Put(int peer, int64_t region, const std::vector<TypedRun>& runs,
                         bool accumulate, bool count) = 0;
  // Copies `peer`'s region `region` into `out` (region_bytes()).
  virtual ffi::Error Get(int peer, int64_t region, void* out) = 0;
  // Runs `access(base)` on this rank's own regions (region r at
  // base + r * region_bytes()), with remote writes completed before it made
  // visible, and its writes visible to remote reads after it. It does not
  // keep remote writes out meanwhile: that is the mutex's job.
  virtual ffi::Error Local(const std::function<ffi::Error(char* base)>& access) = 0;
  // This rank's version counters, atomically: add 1 to region r's
  // (CountVersion with this rank as `peer`), read them all, zero some.
  virtual ffi::Error CountVersion(int peer, int64_t region) = 0;
  virtual ffi::Error ReadVersions(int64_t* versions) = 0;  // slots() of them
  virtual ffi::Error ResetVersions(const std::vector<int64_t>& regions) = 0;
  // Takes the mutex of every rank in `ranks` (in rank order, so that ranks
  // contending for overlapping sets cannot deadlock), waiting at most the
  // timeout. A mutex this rank holds already is counted, not taken again.
  virtual ffi::Error Acquire(std::vector<int> ranks) = 0;
  virtual ffi::Error Release(std::vector<int> ranks) = 0;

 private:
  WindowLayout layout_;
};

// Holds the mutexes of `ranks` on a window for a scope (none when `ranks` is
// empty). Check status() after construction.
class ScopedMutex {
 public:
  ScopedMutex(Window* window, std::vector<int> ranks) : window_(window), ranks_(std::move(ranks)) {
    if (!ranks_.empty()) status_ = window_->Acquire(ranks_);
    held_ = !ranks_.empty() && status_.success();
  }
  ScopedMutex(const ScopedMutex&) = delete;
  ScopedMutex& operator=(const ScopedMutex&) = delete;
  ~ScopedMutex() {
    if (held_) window_->Release(ranks_);  // an error was returned already, or none
  }
  const ffi::Error& status() const { return status_; }
  // Releases now, returning what the release returned.
  ffi::Error Release() {
    if (!held_) return ffi::Error::Success();
    held_ = false;
    return window_->Release(ranks_);
  }

 private:
  Window* window_;
  std::vector<int> ranks_;
  ffi::Error status_ = ffi::Error::Success();
  bool held_ = false;
};

}  // namespace jaxfog

#endif  // JAXFOG_FFI_WINDOW_H_
