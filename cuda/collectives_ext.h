// C++ traits for XLA's FFI collectives extension (xla/ffi/api/collectives_api.h)
// as seen from an external, header-only FFI module: jaxlib 0.11.2 ships the
// generic templates but no instantiation for users, so this header supplies
// the error policy and the extension trait.
//
//   .Ctx<ffi::Extension<moe_jax::cuda::Collectives>>()
//
// decodes to a `CollectivesContext`: RequestCommunicator (prepare stage) and
// GetCommunicator (execute stage) of `CommunicatorContextBase`, plus
// overloads taking pre-built `XLA_FFI_ReplicaGroup` views, which do no heap
// work per call (the base versions convert nested std::vectors every time).
//
//   .Ctx<moe_jax::cuda::OptionalCollectives>()
//
// decodes to a `std::optional<CollectivesContext>` that is empty where XLA
// attaches no collectives extension (instead of failing the call), for
// handlers that need a communicator only in some configurations.
#ifndef MOE_JAX_CUDA_COLLECTIVES_EXT_H_
#define MOE_JAX_CUDA_COLLECTIVES_EXT_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/collectives_api.h"
#include "xla/ffi/api/collectives_c_api.h"
#include "xla/ffi/api/ffi.h"

namespace moe_jax::cuda {

// ErrorPolicy of internal::CommunicatorContextBase: statuses are ffi::Error /
// ffi::ErrorOr; a C error from XLA becomes an ffi::Error with its code and
// message, and the C error is destroyed.
struct FfiErrorPolicy {
  using Status = xla::ffi::Error;
  template <typename T>
  using StatusOr = xla::ffi::ErrorOr<T>;

  static Status Ok() { return Status::Success(); }

  static Status FromErrorCode(XLA_FFI_Error_Code errc, std::string_view message) {
    return Status(errc, std::string(message));
  }

  // Takes ownership of a non-null `error`.
  static Status TakeError(const XLA_FFI_Api* api, XLA_FFI_Error* error) {
    const xla::ffi::internal::ErrorDetails details =
        xla::ffi::internal::GetErrorDetails(api, error);
    std::string message = details.message != nullptr
                              ? std::string(details.message)
                              : std::string("(no message)");
    xla::ffi::internal::DestroyError(api, error);
    // An error must never read as success, whatever code XLA reported.
    const XLA_FFI_Error_Code errc = details.errc == XLA_FFI_Error_Code_OK
                                        ? XLA_FFI_Error_Code_INTERNAL
                                        : details.errc;
    return Status(errc, "XLA collectives extension: " + message);
  }
};

class CollectivesContext
    : public xla::ffi::internal::CommunicatorContextBase<FfiErrorPolicy> {
  using Base = xla::ffi::internal::CommunicatorContextBase<FfiErrorPolicy>;

 public:
  CollectivesContext(const XLA_FFI_Api* api,
                     const XLA_FFI_Collectives_Extension* ext)
      : Base(api, ext), api_(api), ext_(ext) {}

  using Base::GetCommunicator;
  using Base::RequestCommunicator;

  // As the base versions, for groups already in the C layout (`groups[g].ids`
  // must stay valid for the call only).
  xla::ffi::Error RequestCommunicator(xla::ffi::GroupMode group_mode,
                                      const XLA_FFI_ReplicaGroup* groups,
                                      size_t num_groups,
                                      int64_t communication_id) const {
    XLA_FFI_Communicator_Request_Args args;
    args.struct_size = XLA_FFI_Communicator_Request_Args_STRUCT_SIZE;
    args.extension_start = nullptr;
    args.group_mode = static_cast<XLA_FFI_CollectiveGroupMode>(group_mode);
    args.groups = groups;
    args.num_groups = num_groups;
    args.communication_id = communication_id;
    if (XLA_FFI_Error* err = ext_->request_communicator(ext_, &args)) {
      return FfiErrorPolicy::TakeError(api_, err);
    }
    return FfiErrorPolicy::Ok();
  }

  xla::ffi::ErrorOr<XLA_FFI_Communicator*> GetCommunicator(
      xla::ffi::GroupMode group_mode, const XLA_FFI_ReplicaGroup* groups,
      size_t num_groups, int64_t communication_id) const {
    XLA_FFI_Communicator_Get_Args args;
    args.struct_size = XLA_FFI_Communicator_Get_Args_STRUCT_SIZE;
    args.extension_start = nullptr;
    args.group_mode = static_cast<XLA_FFI_CollectiveGroupMode>(group_mode);
    args.groups = groups;
    args.num_groups = num_groups;
    args.communication_id = communication_id;
    args.communicator = nullptr;
    if (XLA_FFI_Error* err = ext_->get_communicator(ext_, &args)) {
      return FfiErrorPolicy::TakeError(api_, err);
    }
    if (args.communicator == nullptr) {
      return xla::ffi::Error::Internal(
          "XLA collectives extension returned no communicator");
    }
    return args.communicator;
  }

  // The flattened-id communicator of `groups`: requested in the prepare stage,
  // fetched in later ones. Failures name `who` (the target) and the step.
  xla::ffi::Error RequestFlattened(const std::vector<XLA_FFI_ReplicaGroup>& groups,
                                   int64_t communication_id, std::string_view who) const {
    xla::ffi::Error err = RequestCommunicator(xla::ffi::GroupMode::kFlattenedId, groups.data(),
                                              groups.size(), communication_id);
    if (err.failure()) {
      return xla::ffi::Error(*err.errc(), std::string(who) + ": requesting the communicator: " +
                                              err.message());
    }
    return xla::ffi::Error::Success();
  }

  xla::ffi::ErrorOr<XLA_FFI_Communicator*> GetFlattened(
      const std::vector<XLA_FFI_ReplicaGroup>& groups, int64_t communication_id,
      std::string_view who) const {
    xla::ffi::ErrorOr<XLA_FFI_Communicator*> comm = GetCommunicator(
        xla::ffi::GroupMode::kFlattenedId, groups.data(), groups.size(), communication_id);
    if (!comm.has_value()) {
      return xla::ffi::Error(*comm.error().errc(), std::string(who) +
                                                       ": getting the communicator: " +
                                                       comm.error().message());
    }
    return comm;
  }

 private:
  const XLA_FFI_Api* api_;
  const XLA_FFI_Collectives_Extension* ext_;
};

// The trait for `.Ctx<ffi::Extension<Collectives>>()`: kName, kExtensionType,
// versions, CExtension, Type and Create come from CollectivesExtensionBase.
// The default version check (exact major.minor match with the headers this
// module was built against) applies.
struct Collectives
    : xla::ffi::internal::CollectivesExtensionBase<CollectivesContext> {};

// Tag for `.Ctx<OptionalCollectives>()` (see the file comment).
struct OptionalCollectives {};

}  // namespace moe_jax::cuda

namespace xla::ffi {

// The extension if XLA attached it (with the version these headers define),
// else an empty optional; decoding itself never fails.
template <>
struct CtxDecoding<moe_jax::cuda::OptionalCollectives> {
  using Type = std::optional<moe_jax::cuda::CollectivesContext>;

  static std::optional<Type> Decode(const XLA_FFI_Api* api,
                                    XLA_FFI_ExecutionContext* ctx,
                                    DiagnosticEngine&) {
    using Ext = moe_jax::cuda::Collectives;
    XLA_FFI_InvokeContext_FindExtension_Args args;
    args.struct_size = XLA_FFI_InvokeContext_FindExtension_Args_STRUCT_SIZE;
    args.extension_start = nullptr;
    args.ctx = ctx;
    args.extension_type = Ext::kExtensionType;
    args.extension = nullptr;
    if (XLA_FFI_Error* error = api->XLA_FFI_InvokeContext_FindExtension(&args)) {
      internal::DestroyError(api, error);
      return Type{};
    }
    if (args.extension == nullptr ||
        args.extension->id.major_version != Ext::kMajorVersion ||
        args.extension->id.minor_version != Ext::kMinorVersion) {
      return Type{};
    }
    return Type{Ext::Create(
        api, reinterpret_cast<const Ext::CExtension*>(args.extension))};
  }
};

}  // namespace xla::ffi

#endif  // MOE_JAX_CUDA_COLLECTIVES_EXT_H_
