// Passing XLA FFI errors up, whatever the backend.
#ifndef JAXFOG_FFI_STATUS_H_
#define JAXFOG_FFI_STATUS_H_

#include "xla/ffi/api/ffi.h"

// In functions returning ffi::Error: returns the error of `expr`, if any.
#define JAXFOG_RETURN_IF_ERROR(expr)                                                              \
  do {                                                                                            \
    if (::xla::ffi::Error jaxfog_error_ = (expr); !jaxfog_error_.success()) return jaxfog_error_; \
  } while (false)

// In functions returning ffi::ErrorOr<...>: returns the error of `expr`, if any.
#define JAXFOG_RETURN_IF_ERROR_OR(expr)                                     \
  do {                                                                      \
    if (::xla::ffi::Error jaxfog_error_ = (expr); !jaxfog_error_.success()) \
      return ::xla::ffi::Unexpected<::xla::ffi::Error>(jaxfog_error_);      \
  } while (false)

// In functions returning ffi::ErrorOr<...>: declares `lhs`, a reference to
// the value of `expr`, or returns its error.
#define JAXFOG_ASSIGN_OR_RETURN(lhs, expr)                                                      \
  auto lhs##_or = (expr);                                                                       \
  if (lhs##_or.has_error()) return ::xla::ffi::Unexpected<::xla::ffi::Error>(lhs##_or.error()); \
  auto& lhs = *lhs##_or

// In functions returning ffi::Error: declares `lhs`, a reference to the value
// of `expr` (an ffi::ErrorOr<...>), or returns its error.
#define JAXFOG_ASSIGN_OR_FAIL(lhs, expr)             \
  auto lhs##_or = (expr);                            \
  if (lhs##_or.has_error()) return lhs##_or.error(); \
  auto& lhs = *lhs##_or

#endif  // JAXFOG_FFI_STATUS_H_
