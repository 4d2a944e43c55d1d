// The weighted sum at the heart of neighbor averaging, in one pass:
//   out = self_weight * self + sum_k weights[k] * others[k]
// Floating types accumulate in their own precision (float16/bfloat16 in
// float32); integers accumulate in float64 and round to nearest, ties to even.
#ifndef JAXFOG_FFI_KERNELS_H_
#define JAXFOG_FFI_KERNELS_H_

#include <cstddef>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxfog {

namespace ffi = ::xla::ffi;

// `self` may be null (no self term). `out` may alias `self`.
ffi::Error WeightedSum(ffi::DataType type, size_t count, void* out, const void* self,
                       double self_weight, const std::vector<const void*>& others,
                       const std::vector<double>& weights);

}  // namespace jaxfog

#endif  // JAXFOG_FFI_KERNELS_H_
