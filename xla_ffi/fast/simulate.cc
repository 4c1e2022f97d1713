#include "xla_ffi/fast/simulate.h"

#include <cstring>
#include <vector>

#include "xla_ffi/fast/issue.h"
#include "xla_ffi/fast/plan.h"

namespace moe_jax::fast {
namespace {

struct Message {
  int64_t buf, row, rows;
};

struct World {
  int g = 0;
  int64_t row_bytes = 0, rows_in = 0, rows_out = 0, ws_rows = 0;
  int phase = -1;
  std::vector<std::vector<uint8_t>> x, out, ws;
  // [src * g + dst]: sends from src to dst / receives at dst from src.
  std::vector<std::vector<Message>> sends, recvs;
  std::vector<std::vector<int>> out_writes;        // [rank][row] count
  std::vector<std::vector<int>> ws_writes;         // [rank][row] count
  std::vector<std::vector<int>> ws_written_phase;  // [rank][row]
  std::vector<std::vector<int>> ws_read_phase;     // [rank][row]
};

class SimTransport {
 public:
  SimTransport(World* w, int me) : w_(w), me_(me) {}

  std::string Zero(int64_t row, int64_t rows) {
    if (std::string err = Bounds("zero fill", row, rows, w_->rows_out);
        !err.empty()) {
      return err;
    }
    std::memset(w_->out[me_].data() + row * w_->row_bytes, 0,
                rows * w_->row_bytes);
    return {};
  }

  std::string Copy(const RankOp& op) {
    if (op.peer != me_) return Where() + "copy with peer " + std::to_string(op.peer);
    if (std::string err = Read(op); !err.empty()) return err;
    if (std::string err = Write(op); !err.empty()) return err;
    const uint8_t* src = Src(op.src_buf) + op.src_row * w_->row_bytes;
    uint8_t* dst = Dst(op.dst_buf) + op.dst_row * w_->row_bytes;
    std::memmove(dst, src, op.rows * w_->row_bytes);
    return {};
  }

  std::string GroupStart() {
    if (open_) return Where() + "nested ncclGroupStart";
    open_ = true;
    return {};
  }

  std::string Send(const RankOp& op) {
    if (!open_) return Where() + "send outside a group";
    if (op.peer < 0 || op.peer >= w_->g || op.peer == me_) {
      return Where() + "send to peer " + std::to_string(op.peer);
    }
    if (std::string err = Read(op); !err.empty()) return err;
    w_->sends[me_ * w_->g + op.peer].push_back({op.src_buf, op.src_row, op.rows});
    return {};
  }

  std::string Recv(const RankOp& op) {
    if (!open_) return Where() + "receive outside a group";
    if (op.peer < 0 || op.peer >= w_->g || op.peer == me_) {
      return Where() + "receive from peer " + std::to_string(op.peer);
    }
    if (std::string err = Write(op); !err.empty()) return err;
    w_->recvs[op.peer * w_->g + me_].push_back({op.dst_buf, op.dst_row, op.rows});
    return {};
  }

  std::string GroupEnd() {
    if (!open_) return Where() + "ncclGroupEnd without ncclGroupStart";
    open_ = false;
    return {};
  }

  bool open() const { return open_; }

 private:
  std::string Where() const {
    return "rank " + std::to_string(me_) + " phase " + std::to_string(w_->phase) +
           ": ";
  }
  std::string Bounds(const char* what, int64_t row, int64_t rows,
                     int64_t size) const {
    if (rows <= 0 || row < 0 || row + rows > size) {
      return Where() + what + " of rows [" + std::to_string(row) + ", " +
             std::to_string(row + rows) + ") outside a buffer of " +
             std::to_string(size) + " rows";
    }
    return {};
  }
  const uint8_t* Src(int64_t buf) const {
    return buf == kBufWs ? w_->ws[me_].data() : w_->x[me_].data();
  }
  uint8_t* Dst(int64_t buf) const {
    return buf == kBufWs ? w_->ws[me_].data() : w_->out[me_].data();
  }
  std::string Read(const RankOp& op) {
    const bool ws = op.src_buf == kBufWs;
    if (std::string err = Bounds("read", op.src_row, op.rows,
                                 ws ? w_->ws_rows : w_->rows_in);
        !err.empty()) {
      return err;
    }
    if (!ws) return {};
    for (int64_t r = op.src_row; r < op.src_row + op.rows; ++r) {
      if (w_->ws_written_phase[me_][r] == w_->phase) {
        return Where() + "reads workspace row " + std::to_string(r) +
               " written in the same phase";
      }
      if (w_->ws_writes[me_][r] == 0) {
        return Where() + "reads workspace row " + std::to_string(r) +
               " nobody wrote";
      }
      w_->ws_read_phase[me_][r] = w_->phase;
    }
    return {};
  }
  std::string Write(const RankOp& op) {
    const bool ws = op.dst_buf == kBufWs;
    if (std::string err = Bounds("write", op.dst_row, op.rows,
                                 ws ? w_->ws_rows : w_->rows_out);
        !err.empty()) {
      return err;
    }
    for (int64_t r = op.dst_row; r < op.dst_row + op.rows; ++r) {
      if (!ws) {
        if (++w_->out_writes[me_][r] > 1) {
          return Where() + "writes out row " + std::to_string(r) + " twice";
        }
        continue;
      }
      if (w_->ws_read_phase[me_][r] == w_->phase) {
        return Where() + "writes workspace row " + std::to_string(r) +
               " read in the same phase";
      }
      if (++w_->ws_writes[me_][r] > 1) {
        return Where() + "writes workspace row " + std::to_string(r) + " twice";
      }
      w_->ws_written_phase[me_][r] = w_->phase;
    }
    return {};
  }

  World* w_;
  int me_;
  bool open_ = false;
};

// Pairs and moves the phase's messages (all reads before any write).
std::string Deliver(World& w) {
  const int g = w.g;
  std::vector<uint8_t> staged;
  struct Move {
    int dst;
    int64_t buf, row, rows;
    size_t offset;
  };
  std::vector<Move> moves;
  for (int s = 0; s < g; ++s) {
    for (int d = 0; d < g; ++d) {
      std::vector<Message>& snd = w.sends[s * g + d];
      std::vector<Message>& rcv = w.recvs[s * g + d];
      if (snd.size() != rcv.size()) {
        return "phase " + std::to_string(w.phase) + ": rank " +
               std::to_string(s) + " sends " + std::to_string(snd.size()) +
               " messages to rank " + std::to_string(d) + ", which posts " +
               std::to_string(rcv.size()) + " receives";
      }
      for (size_t i = 0; i < snd.size(); ++i) {
        if (snd[i].rows != rcv[i].rows) {
          return "phase " + std::to_string(w.phase) + ": message " +
                 std::to_string(i) + " from rank " + std::to_string(s) +
                 " to rank " + std::to_string(d) + " has " +
                 std::to_string(snd[i].rows) + " rows, the receive " +
                 std::to_string(rcv[i].rows);
        }
        const uint8_t* src =
            (snd[i].buf == kBufWs ? w.ws[s] : w.x[s]).data() +
            snd[i].row * w.row_bytes;
        const size_t bytes = static_cast<size_t>(snd[i].rows * w.row_bytes);
        moves.push_back({d, rcv[i].buf, rcv[i].row, rcv[i].rows, staged.size()});
        staged.insert(staged.end(), src, src + bytes);
      }
      snd.clear();
      rcv.clear();
    }
  }
  for (const Move& mv : moves) {
    uint8_t* dst = (mv.buf == kBufWs ? w.ws[mv.dst] : w.out[mv.dst]).data() +
                   mv.row * w.row_bytes;
    std::memcpy(dst, staged.data() + mv.offset,
                static_cast<size_t>(mv.rows * w.row_bytes));
  }
  return {};
}

}  // namespace

std::string SimulateExecution(const int64_t* traffic, int num_servers,
                              int gpus_per_server, const uint8_t* x,
                              int64_t rows_in, int64_t row_bytes,
                              int64_t rows_out, int64_t ws_rows,
                              uint8_t* out) {
  if (row_bytes < 1) return "row_bytes must be >= 1";
  if (rows_in < 0 || rows_out < 0 || ws_rows < 0) {
    return "rows_in, rows_out and ws_rows must be >= 0";
  }
  World w;
  w.g = num_servers * gpus_per_server;
  w.row_bytes = row_bytes;
  w.rows_in = rows_in;
  w.rows_out = rows_out;
  w.ws_rows = ws_rows;
  const int g = w.g;
  // Each rank builds its own program, as on the GPUs.
  StagedPlanner planner;
  std::vector<RankProgram> progs(g);
  for (int r = 0; r < g; ++r) {
    if (PlanStatus s = planner.BuildRank(traffic, num_servers, gpus_per_server,
                                         rows_in, rows_out, ws_rows, r,
                                         &progs[r]);
        !s.ok()) {
      return s.message;
    }
    const size_t in_bytes = static_cast<size_t>(rows_in * row_bytes);
    w.x.emplace_back(x + r * in_bytes, x + (r + 1) * in_bytes);
    w.out.emplace_back(static_cast<size_t>(rows_out * row_bytes), 0xA5);
    w.ws.emplace_back(static_cast<size_t>(ws_rows * row_bytes), 0xA5);
    w.out_writes.emplace_back(rows_out, 0);
    w.ws_writes.emplace_back(ws_rows, 0);
    w.ws_written_phase.emplace_back(ws_rows, -1);
    w.ws_read_phase.emplace_back(ws_rows, -1);
  }
  w.sends.assign(static_cast<size_t>(g) * g, {});
  w.recvs.assign(static_cast<size_t>(g) * g, {});
  const int phases = g > 0 ? progs[0].num_phases() : 0;
  for (int r = 0; r < g; ++r) {
    SimTransport t(&w, r);
    if (progs[r].num_phases() != phases) {
      return "rank " + std::to_string(r) + " has " +
             std::to_string(progs[r].num_phases()) + " phases, rank 0 " +
             std::to_string(phases);
    }
    if (std::string err = IssueZeroFill(progs[r], rows_out, t); !err.empty()) {
      return err;
    }
  }
  for (int p = 0; p < phases; ++p) {
    w.phase = p;
    for (int r = 0; r < g; ++r) {
      SimTransport t(&w, r);
      if (std::string err = IssuePhase(progs[r], p, t); !err.empty()) return err;
      if (t.open()) return "rank " + std::to_string(r) + " left a group open";
    }
    if (std::string err = Deliver(w); !err.empty()) return err;
  }
  for (int r = 0; r < g; ++r) {
    for (int64_t row = 0; row < rows_out; ++row) {
      const int want = row < progs[r].recv_total ? 1 : 0;
      if (w.out_writes[r][row] != want) {
        return "rank " + std::to_string(r) + ": out row " + std::to_string(row) +
               " written " + std::to_string(w.out_writes[r][row]) +
               " times, expected " + std::to_string(want);
      }
    }
    std::memcpy(out + static_cast<size_t>(r) * rows_out * row_bytes,
                w.out[r].data(), static_cast<size_t>(rows_out * row_bytes));
  }
  return {};
}

}  // namespace moe_jax::fast
