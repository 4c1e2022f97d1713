// moe_jax._ffi_cuda: hands the CUDA FFI handlers to Python for
// jax.ffi.register_ffi_target(name, capsule, platform="CUDA").
#include <nanobind/nanobind.h>

#include "handlers_cuda.h"

namespace nb = nanobind;

NB_MODULE(_ffi_cuda, m) {
  m.def(
      "registrations",
      []() {
        nb::dict d;
        d["moe_jax_pack"] = nb::capsule(reinterpret_cast<void*>(MoeJaxPackCuda));
        d["moe_jax_combine"] =
            nb::capsule(reinterpret_cast<void*>(MoeJaxCombineCuda));
        return d;
      },
      "FFI target name -> handler capsule, for platform \"CUDA\".");
}
