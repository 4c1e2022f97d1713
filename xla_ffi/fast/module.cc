// Python extension moe_jax._fast: the C++ FAST scheduler.
//   out = schedule(traffic_int64[G, G], num_servers, gpus_per_server)
//   out["transfers"], out["redistribution"]: int64[K, 6] rows (stage, src,
//   dst, amount, flow_src, flow_dst); see xla_ffi/fast/scheduler.h.  moe_jax/fast/cpp.py wraps it
//   into the reference's Schedule object.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <utility>
#include <vector>

#include "xla_ffi/fast/scheduler.h"

namespace nb = nanobind;
using moe_jax::fast::FastSchedule;
using moe_jax::fast::FastScheduler;

namespace {

using Matrix = nb::ndarray<const int64_t, nb::ndim<2>, nb::c_contig,
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

FastScheduler& Scheduler() {
  static thread_local FastScheduler s;
  return s;
}

}  // namespace

NB_MODULE(_fast, m) {
  m.doc() = "FAST all-to-all(v) scheduler (C++).";
  m.def(
      "schedule",
      [](Matrix traffic, int num_servers, int gpus_per_server,
         bool with_transfers, int64_t gpu) {
        CheckShape(traffic, num_servers, gpus_per_server);
        FastSchedule out;
        std::string err;
        {
          nb::gil_scoped_release release;
          err = Scheduler().Schedule(traffic.data(), num_servers,
                                     gpus_per_server, with_transfers, &out,
                                     gpu);
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
        return d;
      },
      nb::arg("traffic"), nb::arg("num_servers"), nb::arg("gpus_per_server"),
      nb::arg("with_transfers") = true, nb::arg("gpu") = -1,
      "Schedules int64[G, G] traffic; returns a dict of numpy arrays. "
      "gpu >= 0 keeps only the transfers that GPU sends or receives.");
  m.def(
      "time_schedule",
      [](Matrix traffic, int num_servers, int gpus_per_server, int repeats,
         bool with_transfers, int64_t gpu) {
        CheckShape(traffic, num_servers, gpus_per_server);
        if (repeats < 1) throw nb::value_error("repeats must be >= 1");
        std::vector<double> ns(repeats);
        FastSchedule out;
        std::string err;
        {
          nb::gil_scoped_release release;
          for (int r = 0; r < repeats && err.empty(); ++r) {
            const auto t0 = std::chrono::steady_clock::now();
            err = Scheduler().Schedule(traffic.data(), num_servers,
                                       gpus_per_server, with_transfers, &out,
                                       gpu);
            const auto t1 = std::chrono::steady_clock::now();
            ns[r] = std::chrono::duration<double, std::nano>(t1 - t0).count();
          }
        }
        if (!err.empty()) throw nb::value_error(err.c_str());
        return ToNumpy(std::move(ns), {static_cast<size_t>(repeats)});
      },
      nb::arg("traffic"), nb::arg("num_servers"), nb::arg("gpus_per_server"),
      nb::arg("repeats"), nb::arg("with_transfers") = true,
      nb::arg("gpu") = -1,
      "Runs the scheduler `repeats` times (buffers reused, as in a serving "
      "loop); returns the wall time of each run in nanoseconds.");
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
}
