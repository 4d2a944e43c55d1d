// Element types jaxfog communicates and averages, and their conversions.
#ifndef JAXFOG_FFI_DTYPE_H_
#define JAXFOG_FFI_DTYPE_H_

#include <cstdint>
#include <cstring>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxfog {

namespace ffi = ::xla::ffi;

inline const char* DTypeName(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F16:
      return "float16";
    case ffi::DataType::BF16:
      return "bfloat16";
    case ffi::DataType::F32:
      return "float32";
    case ffi::DataType::F64:
      return "float64";
    case ffi::DataType::C64:
      return "complex64";
    case ffi::DataType::C128:
      return "complex128";
    case ffi::DataType::S32:
      return "int32";
    case ffi::DataType::S64:
      return "int64";
    // Moved, never averaged (compressed payloads: packed bits, indices, keys).
    case ffi::DataType::PRED:
      return "bool";
    case ffi::DataType::S8:
      return "int8";
    case ffi::DataType::U8:
      return "uint8";
    case ffi::DataType::S16:
      return "int16";
    case ffi::DataType::U16:
      return "uint16";
    case ffi::DataType::U32:
      return "uint32";
    case ffi::DataType::U64:
      return "uint64";
    default:
      return "unsupported";
  }
}

inline bool IsSupported(ffi::DataType type) {
  return std::string(DTypeName(type)) != "unsupported";
}

// bfloat16 is the upper half of a float32; round to nearest even.
inline float BFloat16ToFloat(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

inline uint16_t FloatToBFloat16(float value) {
  uint32_t word;
  std::memcpy(&word, &value, sizeof(word));
  if ((word & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((word >> 16) | 0x40);
  word += 0x7fffu + ((word >> 16) & 1u);
  return static_cast<uint16_t>(word >> 16);
}

}  // namespace jaxfog

#endif  // JAXFOG_FFI_DTYPE_H_
