// Process-wide tables of transports and windows, keyed by the small integer
// ids that the Python runtime hands out and that custom calls carry as
// attributes (never a pointer in HLO).
#ifndef JAXFOG_FFI_REGISTRY_H_
#define JAXFOG_FFI_REGISTRY_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "transport.h"
#include "window.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfog {

template <typename T>
class Registry {
 public:
  // The table of T (never destroyed: handlers may run at exit).
  static Registry& Global() {
    static Registry* registry = new Registry();
    return *registry;
  }

  // Adds (or replaces) the entry under `id`. A replaced entry is destroyed
  // after the lock is released, as in Take: a window's destructor is
  // collective, and handlers on other threads look entries up meanwhile.
  void Add(int64_t id, std::unique_ptr<T> item) {
    std::unique_ptr<T> replaced;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      std::unique_ptr<T>& slot = items_[id];
      replaced = std::move(slot);
      slot = std::move(item);
    }
  }

  // Removes the entry under `id` and returns it (null if none), so that it is
  // destroyed outside the table's lock (a window's destructor is collective).
  std::unique_ptr<T> Take(int64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = items_.find(id);
    if (it == items_.end()) return nullptr;
    std::unique_ptr<T> item = std::move(it->second);
    items_.erase(it);
    return item;
  }

  // The entry under `id`, or a FailedPrecondition error with `missing`.
  ffi::ErrorOr<T*> Find(int64_t id, const std::string& missing) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = items_.find(id);
    if (it == items_.end()) {
      return ffi::Unexpected<ffi::Error>(ffi::Error(ffi::ErrorCode::kFailedPrecondition, missing));
    }
    return it->second.get();
  }

 private:
  std::mutex mutex_;
  std::map<int64_t, std::unique_ptr<T>> items_;
};

// The transport under `id`, or an error telling the user to call init().
inline ffi::ErrorOr<Transport*> LookupTransport(int64_t id) {
  return Registry<Transport>::Global().Find(
      id, "jaxfog: communicator " + std::to_string(id) +
              " is not registered; call jaxfog.init() first (or the op was compiled before "
              "jaxfog.shutdown())");
}

// The window under `id`, or an error saying it is gone.
inline ffi::ErrorOr<Window*> LookupWindow(int64_t id) {
  return Registry<Window>::Global().Find(
      id, "jaxfog: window " + std::to_string(id) +
              " does not exist (freed with win_free, or the op was compiled before)");
}

}  // namespace jaxfog

#endif  // JAXFOG_FFI_REGISTRY_H_
