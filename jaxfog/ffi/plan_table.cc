#include "plan_table.h"

#include <mutex>
#include <utility>

namespace jaxfog {
namespace {

namespace ffi = xla::ffi;

// Defined at lowering (a Python thread), read as ops run (the communication
// thread or XLA's): behind one mutex.
struct Table {
  std::mutex mutex;
  std::vector<std::shared_ptr<const PlanTables>> plans;
};

Table& Global() {
  static Table* table = new Table();  // never destroyed: ops may run at exit
  return *table;
}

bool Increasing(const std::vector<int64_t>& offsets, size_t entries, size_t edges) {
  if (offsets.size() != entries + 1 || offsets.front() != 0 ||
      offsets.back() != static_cast<int64_t>(edges)) {
    return false;
  }
  for (size_t t = 0; t < entries; ++t) {
    if (offsets[t] > offsets[t + 1]) return false;
  }
  return true;
}

}  // namespace

bool PlanTables::operator==(const PlanTables& other) const {
  return self_weights == other.self_weights && send_offsets == other.send_offsets &&
         send_ranks == other.send_ranks && send_weights == other.send_weights &&
         recv_offsets == other.recv_offsets && recv_ranks == other.recv_ranks &&
         recv_weights == other.recv_weights;
}

std::string PlanTables::Malformed() const {
  const size_t period = self_weights.size();
  if (period == 0) return "no entry";
  if (send_ranks.size() != send_weights.size() || recv_ranks.size() != recv_weights.size()) {
    return "ranks and weights of different lengths";
  }
  if (!Increasing(send_offsets, period, send_ranks.size()) ||
      !Increasing(recv_offsets, period, recv_ranks.size())) {
    return "offsets that do not cut the ranks into one run per entry";
  }
  return "";
}

ffi::ErrorOr<int64_t> DefinePlan(PlanTables plan) {
  if (const std::string why = plan.Malformed(); !why.empty()) {
    return ffi::Unexpected<ffi::Error>(
        ffi::Error::InvalidArgument("jaxfog: malformed communication plan: " + why));
  }
  Table& table = Global();
  std::lock_guard<std::mutex> lock(table.mutex);
  for (size_t id = 0; id < table.plans.size(); ++id) {
    if (*table.plans[id] == plan) return static_cast<int64_t>(id);
  }
  table.plans.push_back(std::make_shared<const PlanTables>(std::move(plan)));
  return static_cast<int64_t>(table.plans.size() - 1);
}

ffi::ErrorOr<std::shared_ptr<const PlanTables>> FindPlan(int64_t id) {
  Table& table = Global();
  std::lock_guard<std::mutex> lock(table.mutex);
  if (id < 0 || static_cast<size_t>(id) >= table.plans.size()) {
    return ffi::Unexpected<ffi::Error>(ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        "jaxfog: communication plan " + std::to_string(id) +
            " is not defined in this process: the program was compiled before jaxfog was set "
            "up again (shutdown and init, or a recovery in place); call the jitted function "
            "again, not a program compiled before"));
  }
  return table.plans[static_cast<size_t>(id)];
}

void ForgetPlans() {
  Table& table = Global();
  std::lock_guard<std::mutex> lock(table.mutex);
  table.plans.clear();
}

}  // namespace jaxfog
