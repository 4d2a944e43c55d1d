// One-sided windows: memory that other ranks write into and read from with no
// matching call on this rank (BlueFog's win_* ops, functional form).
//
// A window of one rank holds regions of `region_bytes` each: region 0 is the
// rank's published value (what others get), region 1 + s is slot s, written
// by the s-th of the ranks this window receives from. A message is the
// window's leaves back to back at fixed offsets inside a region.
#ifndef JAXFOG_FFI_WINDOW_H_
#define JAXFOG_FFI_WINDOW_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
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

class Window {
 public:
  Window() = default;
  Window(const Window&) = delete;
  Window& operator=(const Window&) = delete;
  virtual ~Window() = default;

  virtual int rank() const = 0;
  virtual size_t region_bytes() const = 0;
  virtual int64_t slots() const = 0;

  // Writes the runs into `peer`'s region `region` (replacing, or adding with
  // `accumulate`), complete at the target when this returns.
  virtual ffi::Error Put(int peer, int64_t region, const std::vector<TypedRun>& runs,
                         bool accumulate) = 0;
  // Copies `peer`'s region `region` into `out` (region_bytes()).
  virtual ffi::Error Get(int peer, int64_t region, void* out) = 0;
  // Runs `access(base)` on this rank's own window memory (region r at
  // base + r * region_bytes()), with no remote access in between.
  virtual ffi::Error Local(const std::function<ffi::Error(char* base)>& access) = 0;
};

}  // namespace jaxfog

#endif  // JAXFOG_FFI_WINDOW_H_
