// Issues one rank's part of a FAST execution plan through a transport.
//
// The CUDA custom call (cuda/fast_staged_all_to_all.cc: NCCL send/recv and
// cudaMemcpyAsync on XLA's stream) and the CPU simulation (simulate.cc,
// an in-memory NCCL stand-in that checks pairing, sizes and hazards) both
// go through these functions, so the simulation tests the exact sequence
// of calls the GPU makes.
//
// Transport: a class with these members, each returning "" or an error:
//   std::string Zero(int64_t out_row, int64_t rows);   // out rows := 0
//   std::string Copy(const RankOp& op);                // local copy
//   std::string GroupStart();
//   std::string Send(const RankOp& op);
//   std::string Recv(const RankOp& op);
//   std::string GroupEnd();
//
// Per phase: the local copies first, then every send and receive of the
// phase in one group, in plan order (so the k-th send from a to b pairs
// with the k-th receive at b from a on both sides).  A group that was
// opened is always closed, also after a failed call inside it.
#ifndef MOE_JAX_XLA_FFI_FAST_ISSUE_H_
#define MOE_JAX_XLA_FFI_FAST_ISSUE_H_

#include <cstdint>
#include <string>

#include "xla_ffi/fast/plan.h"

namespace moe_jax::fast {

// Zeroes the out rows past what this rank receives: [recv_total, rows_out).
template <typename Transport>
std::string IssueZeroFill(const RankProgram& prog, int64_t rows_out,
                          Transport& t) {
  if (prog.recv_total >= rows_out) return {};
  return t.Zero(prog.recv_total, rows_out - prog.recv_total);
}

template <typename Transport>
std::string IssuePhase(const RankProgram& prog, int phase, Transport& t) {
  if (phase < 0 || phase >= prog.num_phases()) {
    return "phase " + std::to_string(phase) + " out of range [0, " +
           std::to_string(prog.num_phases()) + ")";
  }
  const int64_t begin = prog.phase_begin[phase];
  const int64_t end = prog.phase_begin[phase + 1];
  bool p2p = false;
  for (int64_t i = begin; i < end; ++i) {
    const RankOp& op = prog.ops[i];
    if (op.kind == RankOpKind::kCopy) {
      if (std::string err = t.Copy(op); !err.empty()) return err;
    } else {
      p2p = true;
    }
  }
  if (!p2p) return {};
  if (std::string err = t.GroupStart(); !err.empty()) return err;
  std::string failed;
  for (int64_t i = begin; i < end && failed.empty(); ++i) {
    const RankOp& op = prog.ops[i];
    if (op.kind == RankOpKind::kSend) {
      failed = t.Send(op);
    } else if (op.kind == RankOpKind::kRecv) {
      failed = t.Recv(op);
    }
  }
  std::string closed = t.GroupEnd();
  return failed.empty() ? closed : failed;
}

// Zero fill and every phase in order (the GPU's whole sequence).
template <typename Transport>
std::string IssueAll(const RankProgram& prog, int64_t rows_out, Transport& t) {
  if (std::string err = IssueZeroFill(prog, rows_out, t); !err.empty()) {
    return err;
  }
  for (int p = 0; p < prog.num_phases(); ++p) {
    if (std::string err = IssuePhase(prog, p, t); !err.empty()) return err;
  }
  return {};
}

}  // namespace moe_jax::fast

#endif  // MOE_JAX_XLA_FFI_FAST_ISSUE_H_
