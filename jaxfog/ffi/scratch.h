// Reusable host buffers for received messages, so that the hot path does not
// allocate after the first call of a given size.
#ifndef JAXFOG_FFI_SCRATCH_H_
#define JAXFOG_FFI_SCRATCH_H_

#include <cstddef>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace jaxfog {

class ScratchPool {
 public:
  // A buffer of at least `bytes`, returned to the pool when destroyed.
  class Lease {
   public:
    Lease(ScratchPool* pool, std::unique_ptr<char[]> data, size_t capacity)
        : pool_(pool), data_(std::move(data)), capacity_(capacity) {}
    Lease(Lease&&) = default;
    Lease& operator=(Lease&&) = delete;
    ~Lease() {
      if (data_) pool_->Return(std::move(data_), capacity_);
    }
    char* data() const { return data_.get(); }

   private:
    ScratchPool* pool_;
    std::unique_ptr<char[]> data_;
    size_t capacity_;
  };

  Lease Acquire(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < free_.size(); ++i) {
      if (free_[i].second >= bytes) {
        auto entry = std::move(free_[i]);
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
        return Lease(this, std::move(entry.first), entry.second);
      }
    }
    // Round up so that slightly growing messages reuse the buffer.
    const size_t capacity = std::max<size_t>(64, bytes + bytes / 8);
    return Lease(this, std::unique_ptr<char[]>(new char[capacity]), capacity);
  }

  static ScratchPool& Global() {
    static ScratchPool* pool = new ScratchPool();  // lives until exit
    return *pool;
  }

 private:
  void Return(std::unique_ptr<char[]> data, size_t capacity) {
    std::lock_guard<std::mutex> lock(mutex_);
    constexpr size_t kKeep = 8;
    if (free_.size() < kKeep) free_.emplace_back(std::move(data), capacity);
  }

  std::mutex mutex_;
  std::vector<std::pair<std::unique_ptr<char[]>, size_t>> free_;
};

}  // namespace jaxfog

#endif  // JAXFOG_FFI_SCRATCH_H_
