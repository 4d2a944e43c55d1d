// A window over MPI-3 RMA: MPI_Win_allocate'd memory, passive-target epochs.
#ifndef JAXFOG_FFI_MPI_WINDOW_H_
#define JAXFOG_FFI_MPI_WINDOW_H_

#include <mpi.h>

#include <memory>
#include <utility>
#include <vector>

#include "window.h"

namespace jaxfog {

class MpiWindow final : public Window {
 public:
  // Collective over `comm`: every rank allocates (1 + slots) regions.
  static ffi::ErrorOr<std::unique_ptr<MpiWindow>> Create(MPI_Comm comm, size_t region_bytes,
                                                         int64_t slots);
  // Collective: frees the MPI window (MPI_Win_free waits for every rank).
  ~MpiWindow() override;

  int rank() const override { return rank_; }
  size_t region_bytes() const override { return region_bytes_; }
  int64_t slots() const override { return peer_slots_[rank_]; }

  ffi::Error Put(int peer, int64_t region, const std::vector<TypedRun>& runs,
                 bool accumulate) override;
  ffi::Error Get(int peer, int64_t region, void* out) override;
  ffi::Error Local(const std::function<ffi::Error(char* base)>& access) override;

 private:
  MpiWindow(MPI_Win win, char* base, int rank, size_t region_bytes,
            std::vector<int64_t> peer_slots)
      : win_(win), base_(base), rank_(rank), region_bytes_(region_bytes),
        peer_slots_(std::move(peer_slots)) {}
  ffi::Error CheckRegion(int peer, int64_t region) const;

  MPI_Win win_;
  char* base_;
  int rank_;
  size_t region_bytes_;
  std::vector<int64_t> peer_slots_;  // every rank's slot count
};

}  // namespace jaxfog

#endif  // JAXFOG_FFI_MPI_WINDOW_H_
