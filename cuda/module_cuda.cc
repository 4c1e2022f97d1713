// moe_jax._ffi_cuda: hands the CUDA FFI handlers to Python for
// jax.ffi.register_ffi_target(name, value, platform="CUDA"), where value is a
// handler capsule or, for multi-stage handlers, {stage name: capsule}.
#include <cstdint>
#include <utility>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "grouped_gemm.h"
#include "handlers_cuda.h"
#include "nvlink_handlers.h"
#ifdef MOE_JAX_WITH_NCCL
#include "fast_staged_all_to_all.h"
#include "nccl_all_to_all.h"
#include "nccl_loader.h"
#endif

namespace nb = nanobind;

NB_MODULE(_ffi_cuda, m) {
  m.def(
      "registrations",
      []() {
        nb::dict d;
        d["moe_jax_pack"] = nb::capsule(reinterpret_cast<void*>(MoeJaxPackCuda));
        d["moe_jax_combine"] =
            nb::capsule(reinterpret_cast<void*>(MoeJaxCombineCuda));
        d["moe_jax_row_matmul"] =
            nb::capsule(reinterpret_cast<void*>(MoeJaxRowMatmulCuda));
        d["moe_jax_grouped_matmul"] =
            nb::capsule(reinterpret_cast<void*>(MoeJaxGroupedMatmulCuda));
        const std::pair<const char*, void*> nvlink[] = {
            {"moe_jax_nvlink_dispatch", reinterpret_cast<void*>(MoeJaxNvlinkDispatch)},
            {"moe_jax_nvlink_combine", reinterpret_cast<void*>(MoeJaxNvlinkCombine)},
            {"moe_jax_nvlink_dispatch_send", reinterpret_cast<void*>(MoeJaxNvlinkDispatchSend)},
            {"moe_jax_nvlink_dispatch_recv", reinterpret_cast<void*>(MoeJaxNvlinkDispatchRecv)},
            {"moe_jax_nvlink_combine_send", reinterpret_cast<void*>(MoeJaxNvlinkCombineSend)},
            {"moe_jax_nvlink_combine_recv", reinterpret_cast<void*>(MoeJaxNvlinkCombineRecv)},
            {"moe_jax_nvlink_dispatch_fp8", reinterpret_cast<void*>(MoeJaxNvlinkDispatchFp8)},
            {"moe_jax_nvlink_dispatch_recv_fp8",
             reinterpret_cast<void*>(MoeJaxNvlinkDispatchRecvFp8)}};
        for (const auto& [name, execute] : nvlink) {
          nb::dict stages;
          stages["prepare"] = nb::capsule(reinterpret_cast<void*>(MoeJaxNvlinkPrepare));
          stages["initialize"] = nb::capsule(reinterpret_cast<void*>(MoeJaxNvlinkInitialize));
          stages["execute"] = nb::capsule(execute);
          d[name] = stages;
        }
#ifdef MOE_JAX_WITH_NCCL
        nb::dict stages;
        stages["prepare"] =
            nb::capsule(reinterpret_cast<void*>(MoeJaxNcclAllToAllPrepare));
        stages["execute"] =
            nb::capsule(reinterpret_cast<void*>(MoeJaxNcclAllToAllExecute));
        d["moe_jax_nccl_all_to_all"] = stages;
        nb::dict fast_stages;
        fast_stages["prepare"] = nb::capsule(
            reinterpret_cast<void*>(MoeJaxFastStagedAllToAllPrepare));
        fast_stages["execute"] = nb::capsule(
            reinterpret_cast<void*>(MoeJaxFastStagedAllToAllExecute));
        d["moe_jax_fast_staged_all_to_all"] = fast_stages;
#endif
        return d;
      },
      "FFI target name -> handler capsule (or {stage: capsule}), for platform "
      "\"CUDA\".");

#ifdef MOE_JAX_WITH_NCCL
  m.attr("with_nccl") = true;
  m.def(
      "nccl_info",
      []() -> nb::object {
        const moe_jax::cuda::NcclApi* nccl = moe_jax::cuda::LoadedNccl();
        if (nccl == nullptr) return nb::none();
        nb::dict d;
        d["library"] = nccl->library;
        d["version"] = nccl->version;
        d["already_loaded"] = nccl->already_loaded;
        return d;
      },
      "The NCCL that moe_jax_nccl_all_to_all resolved ({library, version, "
      "already_loaded}), or None before its first execution. Loads nothing.");
#else
  m.attr("with_nccl") = false;
#endif
  m.def(
      "grouped_matmul_workspace_bytes",
      [](int64_t groups) { return moe_jax::cuda::GroupedGemmWorkspaceBytes(groups); },
      "Bytes of the u8 workspace result moe_jax_grouped_matmul takes for G groups.");
  m.def(
      "grouped_matmul_device_error",
      []() { return moe_jax::cuda::GroupedGemmDeviceError(); },
      "\"\" when the current CUDA device runs the grouped GEMM (Hopper), else why not.");
}
