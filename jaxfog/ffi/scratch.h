// Reusable host buffers for received messages and packed copies, so that the
// hot path neither allocates nor faults in fresh pages after the first call of
// a given size.
//
// Buffers are 64-byte aligned: the layouts in handler.h and staging.cc put
// every leaf at a multiple of 64 from the start of its buffer, so that the
// weighted-sum kernels read cache-line aligned rows.
//
// A request takes the smallest free buffer that fits (best fit), and never one
// more than kMaxSlack times its size, so that a large buffer is not tied up by
// small requests. Returned buffers are kept while the free ones total at most
// keep_bytes() (JAXFOG_SCRATCH_KEEP_BYTES, default kDefaultKeepBytes) and
// number at most kMaxFree; beyond that the least recently returned are freed,
// and a buffer larger than the cap is freed at once.
//
// Where the memory comes from is the pool's allocator: aligned operator new by
// default; the CUDA staging pool's is pinned memory (cuda_copier.cc).
#ifndef JAXFOG_FFI_SCRATCH_H_
#define JAXFOG_FFI_SCRATCH_H_

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

namespace jaxfog {

// Asks for transparent huge pages on the whole 2 MiB pages inside
// [data, data + bytes), as numpy does for its arrays. Fresh buffers of a few
// MB (XLA's outputs, received messages) are mmapped in 4 KiB pages, and the
// first write into them faults every page: a 32 MB allgather output on 2 ranks
// took 40 ms instead of 12 (8,192 faults against 16). Only advice: where the
// kernel has THP off, or the memory is already faulted in, nothing changes.
inline void AdviseHugePages(void* data, size_t bytes) {
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < 2 * kHuge) return;  // no whole huge page worth a system call
  const uintptr_t start = reinterpret_cast<uintptr_t>(data);
  const uintptr_t begin = (start + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (start + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

class ScratchPool {
 public:
  static constexpr size_t kAlign = 64;
  static constexpr size_t kDefaultKeepBytes = size_t{256} << 20;
  static constexpr size_t kMaxFree = 16;
  static constexpr size_t kMaxSlack = 4;

  // Frees a buffer the way it was allocated.
  struct Free {
    void (*release)(char*);
    void operator()(char* data) const { release(data); }
  };
  using Buffer = std::unique_ptr<char, Free>;
  // Allocates at least `bytes`, aligned to kAlign; throws std::bad_alloc.
  using Allocator = Buffer (*)(size_t bytes);

  static Buffer AlignedNew(size_t bytes) {
    char* data = static_cast<char*>(::operator new(bytes, std::align_val_t{kAlign}));
    AdviseHugePages(data, bytes);
    return Buffer(data,
                  Free{[](char* data) { ::operator delete(data, std::align_val_t{kAlign}); }});
  }

  // A buffer of at least `bytes`, returned to the pool when destroyed.
  class Lease {
   public:
    Lease(ScratchPool* pool, Buffer data, size_t capacity)
        : pool_(pool), data_(std::move(data)), capacity_(capacity) {}
    Lease(Lease&&) = default;
    Lease& operator=(Lease&&) = delete;
    ~Lease() {
      if (data_) pool_->Return(std::move(data_), capacity_);
    }
    char* data() const { return data_.get(); }
    size_t capacity() const { return capacity_; }

   private:
    ScratchPool* pool_;
    Buffer data_;
    size_t capacity_;
  };

  explicit ScratchPool(size_t keep_bytes = kDefaultKeepBytes, Allocator allocate = &AlignedNew)
      : keep_bytes_(keep_bytes), allocate_(allocate) {}

  // Throws std::bad_alloc when memory runs out (the communication thread
  // turns that into the op's error).
  Lease Acquire(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto best = free_.end();
      for (auto it = free_.begin(); it != free_.end(); ++it) {
        if (it->capacity >= bytes && it->capacity / kMaxSlack <= std::max(bytes, kAlign) &&
            (best == free_.end() || it->capacity < best->capacity)) {
          best = it;
        }
      }
      if (best != free_.end()) {
        Entry entry = std::move(*best);
        free_.erase(best);
        free_bytes_ -= entry.capacity;
        return Lease(this, std::move(entry.data), entry.capacity);
      }
    }
    // Round up so that slightly growing messages reuse the buffer.
    const size_t capacity = (std::max(kAlign, bytes + bytes / 8) + kAlign - 1) / kAlign * kAlign;
    return Lease(this, allocate_(capacity), capacity);
  }

  // The most bytes of free buffers kept; takes effect as buffers come back.
  void set_keep_bytes(size_t bytes) { keep_bytes_.store(bytes, std::memory_order_relaxed); }
  size_t keep_bytes() const { return keep_bytes_.load(std::memory_order_relaxed); }
  // Bytes in free buffers now.
  size_t free_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return free_bytes_;
  }

  static ScratchPool& Global() {
    static ScratchPool* pool = new ScratchPool();  // lives until exit
    return *pool;
  }

 private:
  struct Entry {
    Buffer data;
    size_t capacity;
  };

  void Return(Buffer data, size_t capacity) {
    const size_t keep = keep_bytes();
    if (capacity > keep) return;  // `data` is freed here
    std::vector<Entry> evicted;   // freed once the lock is released (munmap is slow)
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back({std::move(data), capacity});  // most recently returned last
    free_bytes_ += capacity;
    size_t drop = 0;
    while (free_bytes_ > keep || free_.size() - drop > kMaxFree) {
      free_bytes_ -= free_[drop].capacity;
      ++drop;
    }
    std::move(free_.begin(), free_.begin() + static_cast<std::ptrdiff_t>(drop),
              std::back_inserter(evicted));
    free_.erase(free_.begin(), free_.begin() + static_cast<std::ptrdiff_t>(drop));
  }

  std::mutex mutex_;
  std::atomic<size_t> keep_bytes_;
  const Allocator allocate_;
  std::vector<Entry> free_;  // oldest returned first
  size_t free_bytes_ = 0;
};

}  // namespace jaxfog

#endif  // JAXFOG_FFI_SCRATCH_H_
