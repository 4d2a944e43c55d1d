#include "kernels.h"

#include <cmath>
#include <complex>
#include <cstdint>
#include <string>

#include "dtype.h"

namespace jaxfog {
namespace {

// Storage type T, accumulator type A, and conversions between them.
template <typename T, typename A>
struct Plain {
  using Acc = A;
  static A Load(T v) { return static_cast<A>(v); }
  static T Store(A v) { return static_cast<T>(v); }
};

struct Half {
  using Acc = float;
  static float Load(_Float16 v) { return static_cast<float>(v); }
  static _Float16 Store(float v) { return static_cast<_Float16>(v); }
};

struct BFloat16 {
  using Acc = float;
  static float Load(uint16_t v) { return BFloat16ToFloat(v); }
  static uint16_t Store(float v) { return FloatToBFloat16(v); }
};

template <typename T>
struct Rounded {  // integers: average in float64, round half to even
  using Acc = double;
  static double Load(T v) { return static_cast<double>(v); }
  static T Store(double v) { return static_cast<T>(std::nearbyint(v)); }
};

// Blocked so the accumulator stays in L1 whatever the number of neighbours:
// one read of every input and one write of the output.
template <typename T, typename Traits>
void Sum(size_t count, void* out_ptr, const void* self_ptr, double self_weight,
         const std::vector<const void*>& others, const std::vector<double>& weights) {
  using A = typename Traits::Acc;
  constexpr size_t kBlock = 2048;
  T* out = static_cast<T*>(out_ptr);
  const T* self = static_cast<const T*>(self_ptr);
  const size_t k = others.size();
  std::vector<const T*> src(k);
  std::vector<A> w(k);
  for (size_t j = 0; j < k; ++j) {
    src[j] = static_cast<const T*>(others[j]);
    w[j] = static_cast<A>(weights[j]);
  }
  const A sw = static_cast<A>(self_weight);
  // Few neighbours (rings, one-peer graphs): one fused loop, no accumulator.
  if (self != nullptr && k <= 2) {
    const T* r0 = k > 0 ? src[0] : nullptr;
    const T* r1 = k > 1 ? src[1] : nullptr;
    const A w0 = k > 0 ? w[0] : A(0), w1 = k > 1 ? w[1] : A(0);
    if (k == 0) {
      for (size_t i = 0; i < count; ++i) out[i] = Traits::Store(sw * Traits::Load(self[i]));
    } else if (k == 1) {
      for (size_t i = 0; i < count; ++i) {
        out[i] = Traits::Store(sw * Traits::Load(self[i]) + w0 * Traits::Load(r0[i]));
      }
    } else {
      for (size_t i = 0; i < count; ++i) {
        out[i] = Traits::Store(sw * Traits::Load(self[i]) + w0 * Traits::Load(r0[i]) +
                               w1 * Traits::Load(r1[i]));
      }
    }
    return;
  }
  A acc[kBlock];
  for (size_t start = 0; start < count; start += kBlock) {
    const size_t n = std::min(kBlock, count - start);
    if (self != nullptr) {
      const T* s = self + start;
      for (size_t i = 0; i < n; ++i) acc[i] = sw * Traits::Load(s[i]);
    } else {
      for (size_t i = 0; i < n; ++i) acc[i] = A(0);
    }
    for (size_t j = 0; j < k; ++j) {
      const T* r = src[j] + start;
      const A wj = w[j];
      for (size_t i = 0; i < n; ++i) acc[i] += wj * Traits::Load(r[i]);
    }
    T* o = out + start;
    for (size_t i = 0; i < n; ++i) o[i] = Traits::Store(acc[i]);
  }
}

}  // namespace

ffi::Error WeightedSum(ffi::DataType type, size_t count, void* out, const void* self,
                       double self_weight, const std::vector<const void*>& others,
                       const std::vector<double>& weights) {
  switch (type) {
    case ffi::DataType::F32:
      Sum<float, Plain<float, float>>(count, out, self, self_weight, others, weights);
      break;
    case ffi::DataType::F64:
      Sum<double, Plain<double, double>>(count, out, self, self_weight, others, weights);
      break;
    case ffi::DataType::C64:
      Sum<std::complex<float>, Plain<std::complex<float>, std::complex<float>>>(
          count, out, self, self_weight, others, weights);
      break;
    case ffi::DataType::C128:
      Sum<std::complex<double>, Plain<std::complex<double>, std::complex<double>>>(
          count, out, self, self_weight, others, weights);
      break;
    case ffi::DataType::F16:
      Sum<_Float16, Half>(count, out, self, self_weight, others, weights);
      break;
    case ffi::DataType::BF16:
      Sum<uint16_t, BFloat16>(count, out, self, self_weight, others, weights);
      break;
    case ffi::DataType::S32:
      Sum<int32_t, Rounded<int32_t>>(count, out, self, self_weight, others, weights);
      break;
    case ffi::DataType::S64:
      Sum<int64_t, Rounded<int64_t>>(count, out, self, self_weight, others, weights);
      break;
    default:
      return ffi::Error::InvalidArgument(std::string("jaxfog: cannot average dtype ") +
                                         DTypeName(type));
  }
  return ffi::Error::Success();
}

}  // namespace jaxfog
