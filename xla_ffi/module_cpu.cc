// Python extension moe_jax._ffi_cpu: hands the CPU handlers to JAX.
//   for name, capsule in registrations().items():
//       jax.ffi.register_ffi_target(name, capsule, platform="cpu")
#include <nanobind/nanobind.h>

#include "xla_ffi/handlers_cpu.h"
#include "xla_ffi/row_matmul_cpu.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_ffi_cpu, m) {
  m.doc() = "XLA FFI handlers of the moe_jax custom calls for the CPU.";
  m.def(
      "registrations",
      []() {
        nb::dict d;
        d["moe_jax_pack"] = Capsule(MoeJaxPackCpu);
        d["moe_jax_combine"] = Capsule(MoeJaxCombineCpu);
        d["moe_jax_all_to_all"] = Capsule(MoeJaxAllToAllCpu);
        d["moe_jax_row_matmul"] = Capsule(MoeJaxRowMatmulCpu);
        return d;
      },
      "Maps each custom-call target name to a capsule holding its handler.");
}
