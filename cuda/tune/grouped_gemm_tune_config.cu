// One tile configuration of the grouped GEMM for the tuning benchmark:
// compiled once per MOE_JAX_TUNE_CONFIG (see CMakeLists.txt), so the
// configurations build in parallel.
#include <string>

#include "grouped_gemm_sm90.cuh"
#include "grouped_gemm_tune.h"

namespace moe_jax::cuda::grouped_gemm {
namespace {

#if MOE_JAX_TUNE_CONFIG == 0
using Config = TileConfigT<128, 128, 64, 1, 1, true>;
#elif MOE_JAX_TUNE_CONFIG == 1
using Config = TileConfigT<128, 128, 64, 2, 1, true>;
#elif MOE_JAX_TUNE_CONFIG == 2
using Config = TileConfigT<256, 128, 64, 1, 1, false>;
#elif MOE_JAX_TUNE_CONFIG == 3
using Config = TileConfigT<256, 128, 64, 2, 1, false>;
#elif MOE_JAX_TUNE_CONFIG == 4
using Config = TileConfigT<128, 256, 64, 1, 1, false>;
#elif MOE_JAX_TUNE_CONFIG == 5
using Config = TileConfigT<128, 256, 64, 1, 2, false>;
#elif MOE_JAX_TUNE_CONFIG == 6
using Config = TileConfigT<64, 256, 64, 1, 1, true>;
#elif MOE_JAX_TUNE_CONFIG == 7
using Config = TileConfigT<128, 128, 64, 1, 1, false>;
#elif MOE_JAX_TUNE_CONFIG == 8  // the default tile with IEEE division and expf in the SwiGLU
using Config = TileConfigT<128, 256, 64, 1, 1, false>;
#else
#error "MOE_JAX_TUNE_CONFIG must be 0..8"
#endif
constexpr bool kPreciseSilu = MOE_JAX_TUNE_CONFIG == 8;

#define MOE_JAX_STR2(x) #x
#define MOE_JAX_STR(x) MOE_JAX_STR2(x)

std::string Run(const GroupedGemmArgs& args, cudaStream_t stream, int device, int sm_count) {
  using T = cutlass::bfloat16_t;
  using Row = cutlass::layout::RowMajor;
  if (args.op == GroupedGemmOp::kForwardSwiGLU) {
    return RunGroupedGemm<SwiGLUSpec<T, Config, kPreciseSilu>, T, T>(args, stream, device, sm_count);
  }
  return RunGroupedGemm<PlainSpec<T, T, Row, Row, Config>, T, T>(args, stream, device, sm_count);
}

}  // namespace

template <>
TuneEntry TuneConfigAt<MOE_JAX_TUNE_CONFIG>() {
  using Tile = typename Config::TileShape;
  using Cluster = typename Config::ClusterShape;
  const bool pingpong = std::is_same_v<typename Config::KernelSchedule,
                                       cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong>;
  std::string name = std::to_string(cute::size<0>(Tile{})) + "x" +
                     std::to_string(cute::size<1>(Tile{})) + "x" +
                     std::to_string(cute::size<2>(Tile{})) + " cluster " +
                     std::to_string(cute::size<0>(Cluster{})) + "x" +
                     std::to_string(cute::size<1>(Cluster{})) +
                     (pingpong ? " ping-pong" : " cooperative") +
                     (kPreciseSilu ? " precise-silu" : "");
  return {name, &Run};
}

}  // namespace moe_jax::cuda::grouped_gemm
