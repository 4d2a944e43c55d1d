// Turning MPI return codes into XLA FFI errors that say what failed, and
// passing errors up.
#ifndef JAXFOG_FFI_STATUS_H_
#define JAXFOG_FFI_STATUS_H_

#include <mpi.h>

#include <string>
#include <string_view>

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
  return ffi::Error::Internal("jaxfog: " + std::string(context) + " failed: " +
                              MpiErrorString(code));
}

}  // namespace jaxfog

// In functions returning ffi::Error: returns the error of `expr`, if any.
#define JAXFOG_RETURN_IF_ERROR(expr)                                        \
  do {                                                                      \
    if (::xla::ffi::Error jaxfog_error_ = (expr); !jaxfog_error_.success()) \
      return jaxfog_error_;                                                 \
  } while (false)

// In functions returning ffi::ErrorOr<...>: declares `lhs`, a reference to
// the value of `expr`, or returns its error.
#define JAXFOG_ASSIGN_OR_RETURN(lhs, expr)                              \
  auto lhs##_or = (expr);                                               \
  if (lhs##_or.has_error())                                             \
    return ::xla::ffi::Unexpected<::xla::ffi::Error>(lhs##_or.error()); \
  auto& lhs = *lhs##_or

#endif  // JAXFOG_FFI_STATUS_H_
