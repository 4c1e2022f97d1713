// CPU simulation of the staged all-to-all as the CUDA custom call issues it.
//
// Every rank builds its program as on the GPUs (StagedPlanner::BuildRank,
// plan.h) and issues it through issue.h with an in-memory
// transport that behaves like NCCL point-to-point inside groups: the k-th
// send from a to b in a phase pairs with the k-th receive at b from a, and
// their sizes must agree.  It also fails on what NCCL or the GPU would not
// report: a group left open or nested, an access outside a buffer, a
// workspace row read or written twice within one phase, a workspace row
// written twice at all, or an out row below the received total not written
// exactly once.  out and ws start poisoned (0xA5 bytes).
#ifndef MOE_JAX_XLA_FFI_FAST_SIMULATE_H_
#define MOE_JAX_XLA_FFI_FAST_SIMULATE_H_

#include <cstdint>
#include <string>

namespace moe_jax::fast {

// traffic: int64[G * G] (G = num_servers * gpus_per_server); x: G ranks'
// [rows_in, row_bytes] buffers back to back; out: G ranks' [rows_out,
// row_bytes] buffers, written.  Returns "" on success, else the failure.
std::string SimulateExecution(const int64_t* traffic, int num_servers,
                              int gpus_per_server, const uint8_t* x,
                              int64_t rows_in, int64_t row_bytes,
                              int64_t rows_out, int64_t ws_rows, uint8_t* out);

}  // namespace moe_jax::fast

#endif  // MOE_JAX_XLA_FFI_FAST_SIMULATE_H_
