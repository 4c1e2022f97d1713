// moe_jax_all_to_all on the CPU: a ragged all-to-all among the devices of one
// in-process execution, through a Rendezvous (see docs/design/custom_calls.md).
// Pull model: every rank publishes its send buffer and plan, waits for all
// ranks, copies the rows addressed to it from every source into its own recv
// buffer, then waits until every rank finished copying before returning.
// Plain C++, no XLA types; rows are opaque bytes (any dtype).
#ifndef MOE_JAX_XLA_FFI_ALL_TO_ALL_CPU_H_
#define MOE_JAX_XLA_FFI_ALL_TO_ALL_CPU_H_

#include <cstdint>
#include <string>

#include "xla_ffi/rendezvous.h"

namespace moe_jax::cpu {

struct AllToAllArgs {
  RendezvousKey key;
  int64_t device = -1;    // calling device's id, -1 if unknown
  int32_t rank = 0;       // this rank's index in the group
  int32_t num_ranks = 1;  // P
  const void* send = nullptr;  // [send_rows, ...]
  int64_t send_rows = 0;
  int64_t row_bytes = 0;  // bytes of one row (same for send and recv)
  // Identify the row type; ranks must agree on all three.
  int32_t dtype = 0;                 // opaque dtype code
  const char* dtype_name = "";       // for messages
  const int64_t* row_dims = nullptr;  // trailing dims of send (and recv)
  int64_t row_rank = 0;
  const int32_t* send_offsets = nullptr;  // [P]
  const int32_t* send_sizes = nullptr;    // [P]
  const int32_t* recv_offsets = nullptr;  // [P]
  void* recv = nullptr;                   // [recv_rows, ...]
  int64_t recv_rows = 0;
  int32_t* recv_sizes = nullptr;  // [P]
};

// Returns "" on success. On failure (see Rendezvous::Join, plus offsets or
// sizes out of range on any rank and ranks disagreeing on the row type)
// returns the reason; every rank of the group fails, none hangs.
// `timeout_s` bounds each of the two waits.
std::string AllToAll(const AllToAllArgs& args, double timeout_s,
                     Rendezvous& rendezvous);

// MOE_JAX_CPU_A2A_TIMEOUT_S if it holds a positive number, else 300.
double AllToAllTimeoutFromEnv();

}  // namespace moe_jax::cpu

#endif  // MOE_JAX_XLA_FFI_ALL_TO_ALL_CPU_H_
