// What every pytree handler decodes from its XLA FFI call frame: its leaves
// (through `staging` when the call is host-staged; null otherwise), and the
// bindings the handlers share. Used by the MPI handlers (handler.h) and the NCCL ones.
#ifndef JAXFOG_FFI_CALL_H_
#define JAXFOG_FFI_CALL_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dtype.h"
#include "staging.h"
#include "status.h"
#include "transport.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfog {

using I64s = ffi::Span<const int64_t>;
using F64s = ffi::Span<const double>;

struct Leaf {
  ffi::DataType type;
  size_t count;
  size_t bytes;
  const void* in;  // null for outputs
  void* out;       // null for inputs
};

inline ffi::ErrorOr<std::vector<Leaf>> Inputs(Staging* staging, ffi::RemainingArgs args,
                                              const char* op) {
  std::vector<Leaf> leaves;
  std::vector<ConstPiece> pieces;
  for (size_t i = 0; i < args.size(); ++i) {
    JAXFOG_ASSIGN_OR_RETURN(buffer, args.get<ffi::AnyBuffer>(i));
    if (!IsSupported(buffer.element_type())) {
      return ffi::Unexpected<ffi::Error>(ffi::Error::InvalidArgument(
          std::string("jaxfog ") + op + ": unsupported dtype " + DTypeName(buffer.element_type())));
    }
    leaves.push_back(
        {buffer.element_type(), buffer.element_count(), buffer.size_bytes(), nullptr, nullptr});
    pieces.push_back({buffer.untyped_data(), buffer.size_bytes()});
  }
  JAXFOG_RETURN_IF_ERROR_OR(StageInputs(staging, &pieces));
  for (size_t i = 0; i < leaves.size(); ++i) leaves[i].in = pieces[i].data;
  return leaves;
}

// The results' leaves. A nonblocking start's call (its staging with a handle id) has
// one result more, last: its handle id, set aside in the staging as it is.
inline ffi::ErrorOr<std::vector<Leaf>> Outputs(Staging* staging, ffi::RemainingRets rets) {
  std::vector<Leaf> leaves;
  std::vector<Piece> pieces;
  size_t count = rets.size();
  if (staging != nullptr && staging->with_handle_id()) {
    if (count == 0) {
      return ffi::Unexpected<ffi::Error>(
          ffi::Error::Internal("jaxfog: a nonblocking start without its handle id result"));
    }
    JAXFOG_ASSIGN_OR_RETURN(handle_id, rets.get<ffi::AnyBuffer>(--count));
    staging->set_handle_id(handle_id->untyped_data());
  }
  for (size_t i = 0; i < count; ++i) {
    JAXFOG_ASSIGN_OR_RETURN(result, rets.get<ffi::AnyBuffer>(i));
    ffi::AnyBuffer& b = *result;
    leaves.push_back({b.element_type(), b.element_count(), b.size_bytes(), nullptr, nullptr});
    pieces.push_back({b.untyped_data(), b.size_bytes()});
  }
  StageOutputs(staging, &pieces);
  for (size_t i = 0; i < leaves.size(); ++i) leaves[i].out = pieces[i].data;
  return leaves;
}

// Reads the scalar input at `data`.
template <typename T>
ffi::ErrorOr<T> InputScalar(Staging* staging, const void* data) {
  std::vector<ConstPiece> pieces{{data, sizeof(T)}};
  JAXFOG_RETURN_IF_ERROR_OR(StageInputs(staging, &pieces));
  T value;
  std::memcpy(&value, pieces[0].data, sizeof(T));
  return value;
}

// Where to write the result at `data`.
inline void* OutputAt(Staging* staging, void* data, size_t bytes) {
  std::vector<Piece> pieces{{data, bytes}};
  StageOutputs(staging, &pieces);
  return pieces[0].data;
}

// Bindings (rvalue builders). Every pytree op starts with its communicator
// and its message's signature and layout, and takes the effect token, then
// its leaves; it returns the token, then its leaves.
inline auto Keyed() {
  return ffi::Ffi::Bind()
      .Attr<int64_t>("comm_id")
      .Attr<int64_t>("signature")
      .Attr<std::string_view>("layout");
}

// Op `op` with Keyed()'s message attributes (copied: the call frame is gone
// by the time the op runs).
inline OpInfo Info(OpCode op, int64_t signature, std::string_view layout) {
  return {op, static_cast<uint64_t>(signature), LayoutText::From(layout)};
}

template <typename Binding>
auto Peers(Binding binding) {
  return std::move(binding).template Attr<I64s>("send_ranks").template Attr<I64s>("recv_ranks");
}

// (Bindings cannot be moved: take them by reference.)
template <typename Binding>
auto PytreeOp(Binding&& binding) {
  return std::move(binding)
      .template Arg<ffi::Token>()
      .RemainingArgs()
      .template Ret<ffi::Token>()
      .RemainingRets();
}

}  // namespace jaxfog

#endif  // JAXFOG_FFI_CALL_H_
