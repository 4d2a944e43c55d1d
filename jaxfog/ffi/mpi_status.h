// Turning MPI return codes into XLA FFI errors that say what failed.
#ifndef JAXFOG_FFI_MPI_STATUS_H_
#define JAXFOG_FFI_MPI_STATUS_H_

#include <mpi.h>

#include <string>
#include <string_view>

#include "status.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfog {

namespace ffi = ::xla::ffi;

// The MPI library's own text for an error code.
inline std::string MpiErrorString(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) {
    return "unknown MPI error " + std::to_string(code);
  }
  return std::string(text, length);
}

// Success, or an internal error naming the call and the MPI message.
inline ffi::Error CheckMpi(int code, std::string_view context) {
  if (code == MPI_SUCCESS) return ffi::Error::Success();
  return ffi::Error::Internal("jaxfog: " + std::string(context) +
                              " failed: " + MpiErrorString(code));
}

// The MPI type of a dtype's elements; the 16-bit floats, which MPI has no
// type for, travel as MPI_UINT16_T (reduced with jaxfog's own ops).
inline MPI_Datatype MpiType(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32:
      return MPI_FLOAT;
    case ffi::DataType::F64:
      return MPI_DOUBLE;
    case ffi::DataType::C64:
      return MPI_C_FLOAT_COMPLEX;
    case ffi::DataType::C128:
      return MPI_C_DOUBLE_COMPLEX;
    case ffi::DataType::S32:
      return MPI_INT32_T;
    case ffi::DataType::S64:
      return MPI_INT64_T;
    case ffi::DataType::F16:
    case ffi::DataType::BF16:
      return MPI_UINT16_T;
    default:
      return MPI_DATATYPE_NULL;
  }
}

}  // namespace jaxfog

// In functions returning ffi::Error: returns CheckMpi's error if the MPI
// call fails. `context` is only built then, off the hot path.
#define JAXFOG_RETURN_IF_MPI_ERROR(call, context)               \
  do {                                                          \
    if (int jaxfog_code_ = (call); jaxfog_code_ != MPI_SUCCESS) \
      return ::jaxfog::CheckMpi(jaxfog_code_, context);         \
  } while (false)

#endif  // JAXFOG_FFI_MPI_STATUS_H_
