#include "message_header.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "mpi_status.h"
#include "timeline.h"

namespace jaxfog {

namespace {

bool SameLayout(const Header& a, const Header& b) {
  return a.signature == b.signature && a.bytes == b.bytes;
}

// "rank 2", "ranks 0 and 2", "ranks 0, 2 and 3"; without `noun`, the numbers.
std::string RankList(const std::vector<int>& ranks, bool noun = true) {
  std::string text = !noun ? "" : ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) text += i + 1 == ranks.size() ? " and " : ", ";
    text += std::to_string(ranks[i]);
  }
  return text;
}

// `ranks` in words, this rank (`self`) first: "this rank (1) and ranks 0 and 2".
std::string Who(const std::vector<int>& ranks, int self, bool with_number) {
  std::vector<int> others;
  for (int r : ranks) {
    if (r != self) others.push_back(r);
  }
  if (others.size() == ranks.size()) return RankList(others);
  std::string text = "this rank";
  if (with_number) text += " (" + std::to_string(self) + ")";
  return others.empty() ? text : text + " and " + RankList(others);
}

// Why the layouts in `seen` (rank, header; this rank, `self`, among them)
// differ: the ranks outside the strict majority layout when there is one,
// then each layout with its ranks, the odd ones first. `neighbours`: `seen`
// is this rank's neighbours, not every rank.
std::string LayoutMismatch(int self, std::vector<std::pair<int, Header>> seen, bool neighbours) {
  std::sort(seen.begin(), seen.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  struct Group {
    const Header* header;
    std::vector<int> ranks;
    bool has_self;
  };
  std::vector<Group> groups;  // in order of their lowest rank: deterministic
  for (const auto& [rank, header] : seen) {
    auto group = std::find_if(groups.begin(), groups.end(),
                              [&](const Group& g) { return SameLayout(*g.header, header); });
    if (group == groups.end()) {
      groups.push_back({&header, {}, false});
      group = groups.end() - 1;
    }
    group->ranks.push_back(rank);
    group->has_self |= rank == self;
  }
  const Group* majority = nullptr;  // none on a tie: nobody to blame
  for (const Group& g : groups) {
    if (!majority || g.ranks.size() > majority->ranks.size()) {
      majority = &g;
    } else if (g.ranks.size() == majority->ranks.size()) {
      majority = nullptr;
      break;
    }
  }
  std::string text = "shapes or dtypes differ between ranks: ";
  std::vector<const Group*> order;
  for (bool first : {true, false}) {  // this rank's layout first, unless it is the majority's
    for (const Group& g : groups) {
      if (&g != majority && g.has_self == first) order.push_back(&g);
    }
  }
  if (majority) {
    std::vector<int> odd;
    for (const Group* g : order) odd.insert(odd.end(), g->ranks.begin(), g->ranks.end());
    std::sort(odd.begin(), odd.end());
    if (odd == std::vector<int>{self}) {
      text += "this rank differs from " +
              (neighbours ? "its neighbours " + RankList(majority->ranks, false)
                          : RankList(majority->ranks));
    } else {
      text += Who(odd, self, false) + (odd.size() == 1 ? " differs" : " differ") + " from " +
              Who(majority->ranks, self, false);
    }
    text += ": ";
    order.push_back(majority);
  }
  bool alike = false;  // a long layout cut where two differ only further on
  for (size_t i = 0; i < order.size(); ++i) {
    const std::string layout = order[i]->header->layout.str();
    for (size_t j = 0; j < i; ++j) alike |= order[j]->header->layout.str() == layout;
    text += (i ? "; " : "") + Who(order[i]->ranks, self, true) +
            (order[i]->ranks.size() == 1 ? " has " : " have ") + layout;
  }
  if (alike) text += " (they differ in leaves past those shown)";
  return text;
}

}  // namespace

Header MakeHeader(const OpInfo& info, uint64_t sequence, uint64_t bytes) {
  return {kHeaderMagic, static_cast<uint64_t>(info.op), sequence, info.signature, bytes,
          info.layout};
}

ffi::Error CheckReceived(const OpInfo& info, uint64_t sequence, int self,
                         const std::vector<RecvSpec>& recvs, const std::vector<Header>& received,
                         const std::string& what) {
  bool layouts_differ = false;
  for (size_t i = 0; i < recvs.size(); ++i) {
    const Header& got = received[i];
    std::string problem;
    if (got.magic != kHeaderMagic) {
      problem = "sent a message that is not from a jaxfog op";
    } else if (got.op != static_cast<uint64_t>(info.op) || got.sequence != sequence) {
      problem = std::string("is in ") + OpName(static_cast<OpCode>(got.op)) + " (its op #" +
                std::to_string(got.sequence) +
                "): ranks called different operations, or in "
                "a different order";
    }
    if (!problem.empty()) {
      return ffi::Error::InvalidArgument(what + ": rank " + std::to_string(recvs[i].peer) + " " +
                                         problem);
    }
    layouts_differ |= got.bytes != TotalBytes(recvs[i].pieces) || got.signature != info.signature;
  }
  if (!layouts_differ) return ffi::Error::Success();
  // Every header this rank receives is in: judge by all of them, so that
  // the rank that differs from the others is the one named.
  std::vector<std::pair<int, Header>> seen;
  seen.emplace_back(self, MakeHeader(info, sequence, TotalBytes(recvs[0].pieces)));
  for (size_t i = 0; i < recvs.size(); ++i) seen.emplace_back(recvs[i].peer, received[i]);
  return ffi::Error::InvalidArgument(what + ": " +
                                     LayoutMismatch(self, std::move(seen),
                                                    /*neighbours=*/true));
}

ffi::Error Agree(MPI_Comm comm, int rank, int size, const WaitScope& scope, const OpInfo& info,
                 uint64_t sequence, uint64_t bytes, const std::string& what) {
  timeline::Span span("agree");
  // One MAX-allreduce of (x, -x) gives every rank both max and min of x.
  constexpr int64_t kMask = INT64_MAX;
  const int64_t mine[4] = {static_cast<int64_t>(info.op), static_cast<int64_t>(sequence),
                           static_cast<int64_t>(info.signature & kMask),
                           static_cast<int64_t>(bytes)};
  int64_t send[8], recv[8];
  for (int i = 0; i < 4; ++i) {
    send[i] = mine[i];
    send[i + 4] = -mine[i];
  }
  RequestSet requests("the other ranks");
  JAXFOG_RETURN_IF_MPI_ERROR(
      MPI_Iallreduce(send, recv, 8, MPI_INT64_T, MPI_MAX, comm, requests.Add()),
      what + ": MPI_Iallreduce");
  JAXFOG_RETURN_IF_ERROR(requests.WaitAll(scope, what));
  auto differs = [&](int i) { return recv[i] != -recv[i + 4]; };
  if (differs(0) || differs(1)) {
    return ffi::Error::InvalidArgument(
        what + ": ranks called different operations, or in a different order");
  }
  if (!differs(2) && !differs(3)) return ffi::Error::Success();
  // Every rank saw the same extremes, so all take this path together (no
  // hang): one allgather of the headers, only here, names who differs.
  const Header header = MakeHeader(info, sequence, bytes);
  std::vector<Header> headers(size);
  RequestSet gather("the other ranks");
  JAXFOG_RETURN_IF_MPI_ERROR(MPI_Iallgather(&header, sizeof(Header), MPI_BYTE, headers.data(),
                                            sizeof(Header), MPI_BYTE, comm, gather.Add()),
                             what + ": MPI_Iallgather of the layouts");
  JAXFOG_RETURN_IF_ERROR(gather.WaitAll(scope, what));
  std::vector<std::pair<int, Header>> seen;
  for (int r = 0; r < size; ++r) seen.emplace_back(r, headers[r]);
  return ffi::Error::InvalidArgument(what + ": " +
                                     LayoutMismatch(rank, std::move(seen),
                                                    /*neighbours=*/false));
}

}  // namespace jaxfog
