#include "registry.h"

#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace jaxfog {
namespace {

struct Table {
  std::mutex mutex;
  std::map<int64_t, std::unique_ptr<Transport>> transports;
};

Table& GetTable() {
  static Table* table = new Table();  // Never destroyed: handlers may run at exit.
  return *table;
}

}  // namespace

void RegisterTransport(int64_t id, std::unique_ptr<Transport> transport) {
  Table& table = GetTable();
  std::lock_guard<std::mutex> lock(table.mutex);
  table.transports[id] = std::move(transport);
}

bool ReleaseTransport(int64_t id) {
  Table& table = GetTable();
  std::lock_guard<std::mutex> lock(table.mutex);
  return table.transports.erase(id) > 0;
}

ffi::ErrorOr<Transport*> LookupTransport(int64_t id) {
  Table& table = GetTable();
  std::lock_guard<std::mutex> lock(table.mutex);
  auto it = table.transports.find(id);
  if (it == table.transports.end()) {
    return ffi::Unexpected<ffi::Error>(ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
                      "jaxfog: communicator " + std::to_string(id) +
                          " is not registered; call jaxfog.init() first (or the "
                          "op was compiled before jaxfog.shutdown())"));
  }
  return it->second.get();
}

}  // namespace jaxfog
