// The communication plans of neighbor_allreduce, held by the process and named
// in a program by an id (the custom call's `plan_id`), not written into it.
//
// A program then reads whom to exchange with when it runs, and is the same
// program whichever ranks its plan names: after a recovery in place
// (jaxfog.shrink) the table is emptied and filled again as the step is traced
// for the new size, in the same order, so the step's program is identical and
// XLA's persistent cache holds it already.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxfog {

// One rank's (self weight, sends, receives) for each step of a period; entry
// t's sends are send_ranks[send_offsets[t]:send_offsets[t + 1]] with their
// send_weights, and likewise its receives.
struct PlanTables {
  std::vector<double> self_weights;
  std::vector<int64_t> send_offsets, send_ranks;
  std::vector<double> send_weights;
  std::vector<int64_t> recv_offsets, recv_ranks;
  std::vector<double> recv_weights;

  bool operator==(const PlanTables& other) const;
  // Why the tables are malformed (sizes, offsets), or "" if they are not.
  std::string Malformed() const;
};

// Defines `plan` (an equal plan defined before keeps its id) and returns its id.
xla::ffi::ErrorOr<int64_t> DefinePlan(PlanTables plan);
// The plan of `id`, or an error naming it if there is none (defined before
// the table was last emptied).
xla::ffi::ErrorOr<std::shared_ptr<const PlanTables>> FindPlan(int64_t id);
// Empties the table; ids count from 0 again. Only while no program runs.
void ForgetPlans();

}  // namespace jaxfog
