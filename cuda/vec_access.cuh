// Device helpers shared by the pack and combine kernels: fixed-size register
// fragments loaded/stored with the widest access their alignment allows
// (up to 16 bytes, i.e. LDG/STG.128), and exact element conversions.
#ifndef MOE_JAX_CUDA_VEC_ACCESS_CUH_
#define MOE_JAX_CUDA_VEC_ACCESS_CUH_

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace moe_jax::cuda {

template <int kBytes>
struct VecOf;
template <>
struct VecOf<16> { using type = uint4; };
template <>
struct VecOf<8> { using type = uint2; };
template <>
struct VecOf<4> { using type = unsigned int; };
template <>
struct VecOf<2> { using type = unsigned short; };
template <>
struct VecOf<1> { using type = unsigned char; };

// Alignment (in bytes, at most 16) that an access of kBytes bytes needs.
template <int kBytes>
inline constexpr int kAccessBytes = kBytes < 16 ? kBytes : 16;

// kBytes of registers, moved as kBytes / kAccessBytes accesses of
// kAccessBytes each; `elem` views them as E's.
template <typename E, int kBytes>
union Fragment {
  static constexpr int kUnit = kAccessBytes<kBytes>;
  static constexpr int kAccesses = kBytes / kUnit;
  static constexpr int kElems = kBytes / static_cast<int>(sizeof(E));
  using Vec = typename VecOf<kUnit>::type;
  static_assert(kBytes % kUnit == 0 && kBytes % sizeof(E) == 0, "bad size");

  Vec vec[kAccesses];
  E elem[kElems];

  // Read-only (non-coherent) loads: the inputs of a custom call are not
  // written while it runs.
  __device__ __forceinline__ void Load(const void* src) {
    const Vec* s = static_cast<const Vec*>(src);
#pragma unroll
    for (int i = 0; i < kAccesses; ++i) vec[i] = __ldg(s + i);
  }
  __device__ __forceinline__ void Store(void* dst) const {
    Vec* d = static_cast<Vec*>(dst);
#pragma unroll
    for (int i = 0; i < kAccesses; ++i) d[i] = vec[i];
  }
  __device__ __forceinline__ void Zero() {
#pragma unroll
    for (int i = 0; i < kAccesses; ++i) vec[i] = Vec{};
  }
};

// Element types: storage type plus exact conversions to and from float.
// Narrowing uses cvt.rn (round to nearest even).
struct F32 {
  using Storage = float;
  __device__ __forceinline__ static float ToFloat(float v) { return v; }
  __device__ __forceinline__ static float FromFloat(float v) { return v; }
};
struct BF16 {
  using Storage = unsigned short;
  __device__ __forceinline__ static float ToFloat(unsigned short v) {
    return __uint_as_float(static_cast<unsigned int>(v) << 16);
  }
  __device__ __forceinline__ static unsigned short FromFloat(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
};
struct F16 {
  using Storage = unsigned short;
  __device__ __forceinline__ static float ToFloat(unsigned short v) {
    return __half2float(__ushort_as_half(v));
  }
  __device__ __forceinline__ static unsigned short FromFloat(float v) {
    return __half_as_ushort(__float2half_rn(v));
  }
};

__device__ __forceinline__ bool AlignedTo(const void* p, int bytes) {
  return (reinterpret_cast<uintptr_t>(p) & static_cast<uintptr_t>(bytes - 1)) == 0;
}

}  // namespace moe_jax::cuda

#endif  // MOE_JAX_CUDA_VEC_ACCESS_CUH_
