// Python extension moe_jax._fast: the C++ FAST scheduler.
//   out = schedule(traffic_int64[G, G], num_servers, gpus_per_server)
//   out["transfers"], out["redistribution"]: int64[K, 6] rows (stage, src,
//   dst, amount, flow_src, flow_dst); see xla_ffi/fast/scheduler.h.  moe_jax/fast/cpp.py wraps it
//   into the reference's Schedule object.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <cstdlib>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "xla_ffi/fast/plan.h"
#include "xla_ffi/fast/scheduler.h"
#include "xla_ffi/fast/simulate.h"

namespace nb = nanobind;
using moe_jax::fast::FastSchedule;
using moe_jax::fast::FastScheduler;

namespace {

using Matrix = nb::ndarray<const int64_t, nb::ndim<2>, nb::c_contig,
                           nb::device::cpu>;
using Rows = nb::ndarray<const uint8_t, nb::ndim<3>, nb::c_contig,
                         nb::device::cpu>;
using Matrices = nb::ndarray<const int64_t, nb::ndim<3>, nb::c_contig,
                             nb::device::cpu>;

nb::object ToNumpy(moe_jax::fast::RowBuffer&& v, std::vector<size_t> shape) {
  int64_t* data = v.Release();
  if (data == nullptr) data = static_cast<int64_t*>(std::malloc(8));
  nb::capsule owner(data, [](void* p) noexcept { std::free(p); });
  return nb::cast(
      nb::ndarray<nb::numpy, int64_t>(data, shape.size(), shape.data(), owner));
}

template <typename T>
nb::object ToNumpy(std::vector<T>&& v, std::vector<size_t> shape) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept {
    delete static_cast<std::vector<T>*>(p);
  });
  return nb::cast(nb::ndarray<nb::numpy, T>(heap->data(), shape.size(),
                                            shape.data(), owner));
}

void CheckShape(const Matrix& t, int n, int m) {
  const size_t g = static_cast<size_t>(n) * static_cast<size_t>(m);
  if (n < 1) throw nb::value_error("num_servers must be >= 1");
  if (m < 1) throw nb::value_error("gpus_per_server must be >= 1");
  if (t.shape(0) != g || t.shape(1) != g) {
    throw nb::value_error(
        "traffic must have shape (num_servers * gpus_per_server) squared");
  }
}

moe_jax::fast::StagedPlanner& Planner() {
  static thread_local moe_jax::fast::StagedPlanner p;
  return p;
}

FastScheduler& Scheduler() {
  static thread_local FastScheduler s;
  return s;
}

// One rank's program with these buffer rows: built from its per-GPU
// schedule as the custom call does (per_rank), or extracted from the whole
// plan.
std::string ProgramWith(const Matrix& traffic, int num_servers,
                        int gpus_per_server, int rank, bool per_rank,
                        int64_t rows_in, int64_t rows_out, int64_t ws_rows,
                        moe_jax::fast::RankProgram* out) {
  moe_jax::fast::StagedPlanner& p = Planner();
  if (per_rank) {
    return p.BuildRank(traffic.data(), num_servers, gpus_per_server, rows_in,
                       rows_out, ws_rows, rank, out)
        .message;
  }
  if (std::string err = p.Build(traffic.data(), num_servers, gpus_per_server,
                                rows_in, rows_out);
      !err.empty()) {
    return err;
  }
  return p.ForRank(rank, ws_rows, out);
}

// The same without buffer limits.
std::string RankProgramOf(const Matrix& traffic, int num_servers,
                          int gpus_per_server, int rank, bool per_rank,
                          moe_jax::fast::RankProgram* out) {
  return ProgramWith(traffic, num_servers, gpus_per_server, rank, per_rank,
                     INT64_MAX, INT64_MAX, INT64_MAX, out);
}

// Rows of the smallest buffers that hold the traffic: {rows_in, rows_out}.
std::pair<int64_t, int64_t> FittingRows(const Matrix& traffic) {
  const int64_t g = static_cast<int64_t>(traffic.shape(0));
  const int64_t* t = traffic.data();
  std::vector<int64_t> cols(g, 0);
  int64_t rows_in = 0;
  for (int64_t s = 0; s < g; ++s) {
    int64_t row = 0;
    for (int64_t d = 0; d < g; ++d) {
      row += t[s * g + d];
      cols[d] += t[s * g + d];
    }
    rows_in = std::max(rows_in, row);
  }
  return {rows_in, *std::max_element(cols.begin(), cols.end())};
}

// What the custom call runs per call on `rank` with these buffers and the
// default workspace: from the rank's per-GPU schedule (per_rank), or the
// whole plan and the rank's part of it.
std::string TimedRankProgram(const Matrix& traffic, int num_servers,
                             int gpus_per_server, int rank, bool per_rank,
                             int64_t rows_in, int64_t rows_out,
                             bool below_bound,
                             moe_jax::fast::RankProgram* out) {
  const int64_t ws_rows =
      moe_jax::fast::WorkspaceBound(rows_in, rows_out, num_servers,
                                    gpus_per_server) -
      (below_bound ? 1 : 0);
  return ProgramWith(traffic, num_servers, gpus_per_server, rank, per_rank,
                     rows_in, rows_out, ws_rows, out);
}

}  // namespace

NB_MODULE(_fast, m) {
  m.doc() = "FAST all-to-all(v) scheduler (C++).";
  m.def(
      "schedule",
      [](Matrix traffic, int num_servers, int gpus_per_server,
         bool with_transfers, int64_t gpu, bool ranges) {
        CheckShape(traffic, num_servers, gpus_per_server);
        if (ranges && (!with_transfers || gpu != -1)) {
          throw nb::value_error("ranges needs with_transfers and gpu = -1");
        }
        FastSchedule out;
        std::string err;
        {
          nb::gil_scoped_release release;
          err = ranges ? Scheduler().ScheduleRanges(traffic.data(), num_servers,
                                                    gpus_per_server, &out)
                       : Scheduler().Schedule(traffic.data(), num_servers,
                                              gpus_per_server, with_transfers,
                                              &out, gpu);
        }
        if (!err.empty()) throw nb::value_error(err.c_str());
        const size_t n = num_servers, s = out.num_stages;
        const size_t k = out.transfers.size() / moe_jax::fast::kTransferCols;
        nb::dict d;
        d["bound"] = out.bound;
        d["server_matrix"] = ToNumpy(std::move(out.server), {n, n});
        d["padded_matrix"] = ToNumpy(std::move(out.padded), {n, n});
        d["matchings"] = ToNumpy(std::move(out.matchings), {s, n});
        d["weights"] = ToNumpy(std::move(out.weights), {s});
        d["real"] = ToNumpy(std::move(out.real), {s, n});
        const size_t r =
            out.redistribution.size() / moe_jax::fast::kTransferCols;
        d["transfers"] = ToNumpy(std::move(out.transfers),
                                 {k, size_t{moe_jax::fast::kTransferCols}});
        d["redistribution"] =
            ToNumpy(std::move(out.redistribution),
                    {r, size_t{moe_jax::fast::kTransferCols}});
        if (ranges) {
          const size_t g = static_cast<size_t>(num_servers) * gpus_per_server;
          d["lane_units"] = ToNumpy(std::move(out.lane_units), {g, n});
          d["pair_sent"] = ToNumpy(std::move(out.pair_sent), {s, n});
          d["balance_begin"] =
              ToNumpy(std::move(out.balance_begin), {n * n + 1});
        }
        return d;
      },
      nb::arg("traffic"), nb::arg("num_servers"), nb::arg("gpus_per_server"),
      nb::arg("with_transfers") = true, nb::arg("gpu") = -1,
      nb::arg("ranges") = false,
      "Schedules int64[G, G] traffic; returns a dict of numpy arrays. "
      "gpu >= 0 keeps only the transfers that GPU sends or receives; "
      "ranges: the full schedule in the ranges form (scheduler.h: transfers "
      "holds the balancing rows alone, redistribution is empty; plus "
      "lane_units, pair_sent and balance_begin).");
  m.def(
      "time_schedule",
      [](Matrix traffic, int num_servers, int gpus_per_server, int repeats,
         bool with_transfers, int64_t gpu, bool ranges) {
        CheckShape(traffic, num_servers, gpus_per_server);
        if (repeats < 1) throw nb::value_error("repeats must be >= 1");
        if (ranges && (!with_transfers || gpu != -1)) {
          throw nb::value_error("ranges needs with_transfers and gpu = -1");
        }
        std::vector<double> ns(repeats);
        FastSchedule out;
        std::string err;
        {
          nb::gil_scoped_release release;
          for (int r = 0; r < repeats && err.empty(); ++r) {
            const auto t0 = std::chrono::steady_clock::now();
            err = ranges ? Scheduler().ScheduleRanges(
                               traffic.data(), num_servers, gpus_per_server,
                               &out)
                         : Scheduler().Schedule(traffic.data(), num_servers,
                                                gpus_per_server,
                                                with_transfers, &out, gpu);
            const auto t1 = std::chrono::steady_clock::now();
            ns[r] = std::chrono::duration<double, std::nano>(t1 - t0).count();
          }
        }
        if (!err.empty()) throw nb::value_error(err.c_str());
        return ToNumpy(std::move(ns), {static_cast<size_t>(repeats)});
      },
      nb::arg("traffic"), nb::arg("num_servers"), nb::arg("gpus_per_server"),
      nb::arg("repeats"), nb::arg("with_transfers") = true,
      nb::arg("gpu") = -1, nb::arg("ranges") = false,
      "Runs the scheduler `repeats` times (buffers reused, as in a serving "
      "loop); returns the wall time of each run in nanoseconds.  ranges: "
      "the full schedule in the ranges form.");
  m.def(
      "time_schedule_each",
      [](Matrices traffics, int num_servers, int gpus_per_server,
         bool with_transfers, int64_t gpu, int buffers, bool ranges) {
        if (ranges && (!with_transfers || gpu != -1)) {
          throw nb::value_error("ranges needs with_transfers and gpu = -1");
        }
        const size_t g = static_cast<size_t>(num_servers) * gpus_per_server;
        if (num_servers < 1 || gpus_per_server < 1 ||
            traffics.shape(1) != g || traffics.shape(2) != g) {
          throw nb::value_error("traffics must be [K, G, G], G = n * M");
        }
        if (buffers < 0 || buffers > 2) {
          throw nb::value_error("buffers must be 0 (warm), 1 (cold caches) "
                                "or 2 (new buffers)");
        }
        const size_t k = traffics.shape(0);
        std::vector<double> ns(k);
        std::string err;
        {
          nb::gil_scoped_release release;
          // Written between calls (buffers >= 1): evicts the previous
          // call's data from the caches.
          std::vector<int64_t> evict(buffers ? (size_t{64} << 20) / 8 : 0);
          auto sched = std::make_unique<FastScheduler>();
          auto out = std::make_unique<FastSchedule>();
          for (size_t i = 0; i < k && err.empty(); ++i) {
            const int64_t* t = traffics.data() + i * g * g;
            if (buffers == 2) {
              sched = std::make_unique<FastScheduler>();
              out = std::make_unique<FastSchedule>();
            }
            for (size_t j = 0; j < evict.size(); j += 8) evict[j] += 1;
            const auto t0 = std::chrono::steady_clock::now();
            err = ranges ? sched->ScheduleRanges(t, num_servers,
                                                 gpus_per_server, out.get())
                         : sched->Schedule(t, num_servers, gpus_per_server,
                                           with_transfers, out.get(), gpu);
            const auto t1 = std::chrono::steady_clock::now();
            ns[i] = std::chrono::duration<double, std::nano>(t1 - t0).count();
          }
        }
        if (!err.empty()) throw nb::value_error(err.c_str());
        return ToNumpy(std::move(ns), {k});
      },
      nb::arg("traffics"), nb::arg("num_servers"), nb::arg("gpus_per_server"),
      nb::arg("with_transfers") = true, nb::arg("gpu") = -1,
      nb::arg("buffers") = 0, nb::arg("ranges") = false,
      "Schedules each of K matrices once; returns each call's wall time in "
      "nanoseconds.  buffers: 0 one scheduler reused (warm), 1 the same "
      "after 64 MiB of other writes before each call (cold caches), 2 a "
      "new scheduler and output per call after those writes (its buffers "
      "allocated and first touched inside the timed call).  ranges: the "
      "full schedule in the ranges form.");
  m.def(
      "spreadout_time",
      [](Matrix x) {
        if (x.shape(0) != x.shape(1)) {
          throw nb::value_error("matrix must be square");
        }
        return moe_jax::fast::SpreadOutTime(x.data(),
                                            static_cast<int>(x.shape(0)));
      },
      nb::arg("matrix"), "SpreadOut time of a square int64 matrix.");
  m.def(
      "plan",
      [](Matrix traffic, int num_servers, int gpus_per_server) {
        CheckShape(traffic, num_servers, gpus_per_server);
        std::string err;
        moe_jax::fast::StagedPlanner& p = Planner();
        {
          nb::gil_scoped_release release;
          // Row/column sums bound nothing here: no buffers yet.
          err = p.Build(traffic.data(), num_servers, gpus_per_server,
                        INT64_MAX, INT64_MAX);
        }
        if (!err.empty()) throw nb::value_error(err.c_str());
        const moe_jax::fast::ExecutionPlan& plan = p.plan();
        std::vector<int64_t> ops(plan.ops), used(plan.workspace_used);
        nb::dict d;
        d["ops"] = ToNumpy(std::move(ops),
                           {static_cast<size_t>(plan.num_ops()),
                            size_t{moe_jax::fast::kOpCols}});
        d["num_phases"] = plan.num_phases;
        const size_t g = used.size();
        d["workspace_used"] = ToNumpy(std::move(used), {g});
        return d;
      },
      nb::arg("traffic"), nb::arg("num_servers"), nb::arg("gpus_per_server"),
      "Execution plan of the FAST schedule (see xla_ffi/fast/plan.h): dict "
      "with ops int64[K, 11], num_phases and workspace_used int64[G].");
  m.def(
      "workspace_use",
      [](Matrix traffic, int num_servers, int gpus_per_server) {
        CheckShape(traffic, num_servers, gpus_per_server);
        std::vector<int64_t> use;
        std::string err;
        {
          nb::gil_scoped_release release;
          FastSchedule out;
          err = Scheduler().ScheduleRanges(traffic.data(), num_servers,
                                           gpus_per_server, &out);
          if (err.empty()) {
            moe_jax::fast::WorkspaceUseOfRanges(traffic.data(), out, &use);
          }
        }
        if (!err.empty()) throw nb::value_error(err.c_str());
        const size_t g = use.size();
        return ToNumpy(std::move(use), {g});
      },
      nb::arg("traffic"), nb::arg("num_servers"), nb::arg("gpus_per_server"),
      "int64[G]: workspace rows each GPU's plan uses, from the full "
      "schedule's ranges form (what a rank checks below the workspace "
      "bound).");
  m.def(
      "rank_program",
      [](Matrix traffic, int num_servers, int gpus_per_server, int rank,
         bool per_rank) {
        CheckShape(traffic, num_servers, gpus_per_server);
        moe_jax::fast::RankProgram prog;
        std::string err;
        {
          nb::gil_scoped_release release;
          err = RankProgramOf(traffic, num_servers, gpus_per_server, rank,
                              per_rank, &prog);
        }
        if (!err.empty()) throw nb::value_error(err.c_str());
        std::vector<int64_t> ops;
        ops.reserve(prog.ops.size() * 7);
        for (const moe_jax::fast::RankOp& op : prog.ops) {
          ops.insert(ops.end(), {static_cast<int64_t>(op.kind), op.peer,
                                 op.rows, op.src_buf, op.src_row, op.dst_buf,
                                 op.dst_row});
        }
        nb::dict d;
        d["ops"] = ToNumpy(std::move(ops), {prog.ops.size(), size_t{7}});
        const size_t phases = prog.phase_begin.size();
        d["phase_begin"] = ToNumpy(std::move(prog.phase_begin), {phases});
        d["recv_total"] = prog.recv_total;
        d["workspace_used"] = prog.workspace_used;
        return d;
      },
      nb::arg("traffic"), nb::arg("num_servers"), nb::arg("gpus_per_server"),
      nb::arg("rank"), nb::arg("per_rank") = true,
      "One rank's program (plan.h's RankProgram): built from the rank's "
      "per-GPU schedule (per_rank, what the custom call runs) or extracted "
      "from the whole plan.  Dict with ops int64[K, 7] (kind 0 copy / 1 "
      "send / 2 recv, peer, rows, src_buf, src_row, dst_buf, dst_row; -1 on "
      "the peer's side), phase_begin int64[P + 1], recv_total and "
      "workspace_used.");
  m.def(
      "time_rank_program",
      [](Matrix traffic, int num_servers, int gpus_per_server, int rank,
         int repeats, bool per_rank, bool below_bound) {
        CheckShape(traffic, num_servers, gpus_per_server);
        if (repeats < 1) throw nb::value_error("repeats must be >= 1");
        std::vector<double> ns(repeats);
        moe_jax::fast::RankProgram prog;
        std::string err;
        {
          nb::gil_scoped_release release;
          const auto [rows_in, rows_out] = FittingRows(traffic);
          for (int r = 0; r < repeats && err.empty(); ++r) {
            const auto t0 = std::chrono::steady_clock::now();
            err = TimedRankProgram(traffic, num_servers, gpus_per_server, rank,
                                   per_rank, rows_in, rows_out, below_bound,
                                   &prog);
            const auto t1 = std::chrono::steady_clock::now();
            ns[r] = std::chrono::duration<double, std::nano>(t1 - t0).count();
          }
        }
        if (!err.empty()) throw nb::value_error(err.c_str());
        return ToNumpy(std::move(ns), {static_cast<size_t>(repeats)});
      },
      nb::arg("traffic"), nb::arg("num_servers"), nb::arg("gpus_per_server"),
      nb::arg("rank"), nb::arg("repeats"), nb::arg("per_rank") = true,
      nb::arg("below_bound") = false,
      "Wall time (ns) of each of `repeats` runs of what the custom call "
      "computes per call on `rank` (traffic check, schedule, plan, the "
      "rank's program; buffers fit the traffic, default workspace): from "
      "the rank's per-GPU schedule (per_rank) or the whole plan.");
  m.def(
      "simulate_execution",
      [](Matrix traffic, int num_servers, int gpus_per_server, Rows x,
         int64_t rows_out, int64_t ws_rows) {
        CheckShape(traffic, num_servers, gpus_per_server);
        const size_t g = traffic.shape(0);
        if (x.shape(0) != g) {
          throw nb::value_error("x must have shape [G, rows_in, row_bytes]");
        }
        if (x.shape(2) < 1) throw nb::value_error("row_bytes must be >= 1");
        if (rows_out < 0 || ws_rows < 0) {
          throw nb::value_error("rows_out and ws_rows must be >= 0");
        }
        const int64_t rows_in = static_cast<int64_t>(x.shape(1));
        const int64_t row_bytes = static_cast<int64_t>(x.shape(2));
        std::vector<uint8_t> out(g * static_cast<size_t>(rows_out) * row_bytes);
        std::string err;
        {
          nb::gil_scoped_release release;
          err = moe_jax::fast::SimulateExecution(
              traffic.data(), num_servers, gpus_per_server, x.data(), rows_in,
              row_bytes, rows_out, ws_rows, out.data());
        }
        if (!err.empty()) throw nb::value_error(err.c_str());
        return ToNumpy(std::move(out), {g, static_cast<size_t>(rows_out),
                                        static_cast<size_t>(row_bytes)});
      },
      nb::arg("traffic"), nb::arg("num_servers"), nb::arg("gpus_per_server"),
      nb::arg("x"), nb::arg("rows_out"), nb::arg("ws_rows"),
      "Runs every rank's staged all-to-all program (issue.h, as the CUDA "
      "custom call issues it) over an in-memory NCCL stand-in; x: uint8[G, "
      "rows_in, row_bytes].  Returns out uint8[G, rows_out, row_bytes]; "
      "raises ValueError on unmatched sends/receives, hazards or rows not "
      "written exactly once.");
}
