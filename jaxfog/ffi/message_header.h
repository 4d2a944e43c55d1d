// What every message carries, and what ranks compare before any data
// moves: the 128-byte header (op code, op number, layout signature, size,
// layout text); the check of the headers one exchange receives; Agree, the
// collectives' check; and the errors that name the ranks that differ.
#ifndef JAXFOG_FFI_MESSAGE_HEADER_H_
#define JAXFOG_FFI_MESSAGE_HEADER_H_

#include <mpi.h>

#include <cstdint>
#include <string>
#include <vector>

#include "mpi_requests.h"
#include "transport.h"

namespace jaxfog {

constexpr uint64_t kHeaderMagic = 0x6a6178666f67ull;  // "jaxfog"

struct Header {
  uint64_t magic;
  uint64_t op;
  uint64_t sequence;
  uint64_t signature;
  uint64_t bytes;
  LayoutText layout;  // read only when the signatures or sizes differ
};
// Every message pays for it (comm_stats counts it as header_bytes).
static_assert(sizeof(Header) == 128, "keep message headers small");

// This rank's header for a message of `bytes` bytes in op `info`, its op
// number `sequence`.
Header MakeHeader(const OpInfo& info, uint64_t sequence, uint64_t bytes);

// Checks the headers of one exchange, `received[i]` from `recvs[i].peer`,
// against this rank's op `info` (number `sequence`): a peer in another op,
// or at another op number, is named; when layouts differ (signature or
// size), the error names the ranks that differ from the majority of the
// headers, this rank's (`self`) included. Errors start with `what`.
ffi::Error CheckReceived(const OpInfo& info, uint64_t sequence, int self,
                         const std::vector<RecvSpec>& recvs, const std::vector<Header>& received,
                         const std::string& what);

// The collectives' check: every rank of `comm` (this one `rank` of `size`)
// is in op `info`, number `sequence`, with the same signature and `bytes`.
// One allreduce decides, the same on every rank; only on other layouts an
// allgather of the headers names who differs. Waits within `scope`.
ffi::Error Agree(MPI_Comm comm, int rank, int size, const WaitScope& scope, const OpInfo& info,
                 uint64_t sequence, uint64_t bytes, const std::string& what);

}  // namespace jaxfog

#endif  // JAXFOG_FFI_MESSAGE_HEADER_H_
