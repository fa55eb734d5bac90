// The sum of a tensor over the ranks of a tensor-parallel group on one host, through a
// shared memory segment all ranks map (backends/parallel/group.py): a step's
// all-reduces are small (rows x hidden floats) and gloo's TCP path took 1.1-1.7 ms each
// on this machine, more than the layer they follow; through memory it is microseconds.
// vLLM's CPU backend does the same (csrc/cpu/shm.cpp).
//
// Layout: tp flags (one 64-byte line each), then two banks of tp buffers of `capacity`
// bytes. Operation `seq` (1, 2, ... on every rank alike) uses bank seq % 2: each rank
// copies its part in, publishes `seq` in its flag (release), waits until every flag
// reaches `seq` (acquire), then sums the buffers in rank order, so every rank gets the
// same bits. A rank can only be one operation ahead of the slowest (it waits for all
// flags), so the other bank is never still being read when it is overwritten.
//
// The wait spins briefly, then yields the core; every ~10 ms it checks that the peers'
// processes still run (a dead peer fails the call at once, not after the timeout) and
// gives up after `timeout_s`.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <sched.h>
#include <string>
#include <thread>

namespace {

constexpr int64_t kLine = 64;

std::atomic<int64_t>* flag(uint8_t* base, int64_t rank) {
  return reinterpret_cast<std::atomic<int64_t>*>(base + rank * kLine);
}

// whether process `pid` runs: /proc/<pid>/stat exists and its state is not Z (zombie) or X
bool alive(int64_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return false;
  std::string line;
  std::getline(stat, line);
  const auto close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return true;
  const char state = line[close + 2];
  return state != 'Z' && state != 'X';
}

void wait_all(uint8_t* base, int64_t tp, int64_t rank, int64_t seq, const int64_t* pids, double timeout_s) {
  const auto start = std::chrono::steady_clock::now();
  auto checked = start;
  int64_t spins = 0;
  for (int64_t r = 0; r < tp; ++r) {
    while (flag(base, r)->load(std::memory_order_acquire) < seq) {
      if (++spins < 2000) continue;
      sched_yield();
      const auto now = std::chrono::steady_clock::now();
      if (now - checked > std::chrono::milliseconds(10)) {
        checked = now;
        TORCH_CHECK(alive(pids[r]), "shm all-reduce: rank ", r, " (pid ", pids[r], ") is gone; rank ", rank,
                    " waited at operation ", seq);
        TORCH_CHECK(std::chrono::duration<double>(now - start).count() < timeout_s, "shm all-reduce: rank ", r,
                    " did not arrive at operation ", seq, " within ", timeout_s, " s (rank ", rank, " waited)");
      }
    }
  }
}

// x (fp32, contiguous, at most capacity bytes) replaced by its sum over the ranks
void shm_all_reduce_(at::Tensor x, const at::Tensor& shm, int64_t rank, int64_t tp, int64_t seq,
                     int64_t capacity, const at::Tensor& pids, double timeout_s) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "shm_all_reduce: a contiguous fp32 tensor");
  const int64_t nbytes = x.numel() * 4;
  TORCH_CHECK(nbytes <= capacity, "shm_all_reduce: ", nbytes, " bytes over the buffers' ", capacity);
  TORCH_CHECK(shm.scalar_type() == at::kByte && shm.numel() >= tp * kLine + 2 * tp * capacity,
              "shm_all_reduce: the segment is smaller than its layout");
  TORCH_CHECK(pids.scalar_type() == at::kLong && pids.numel() == tp, "shm_all_reduce: int64 pids [tp]");
  TORCH_CHECK(seq >= 1 && 0 <= rank && rank < tp, "shm_all_reduce: seq >= 1 and rank in [0, tp)");
  uint8_t* base = shm.data_ptr<uint8_t>();
  uint8_t* bank = base + tp * kLine + (seq % 2) * tp * capacity;
  std::memcpy(bank + rank * capacity, x.data_ptr<float>(), nbytes);
  flag(base, rank)->store(seq, std::memory_order_release);
  wait_all(base, tp, rank, seq, pids.data_ptr<int64_t>(), timeout_s);
  float* out = x.data_ptr<float>();
  const int64_t n = x.numel();
  const float* first = reinterpret_cast<const float*>(bank);
  for (int64_t i = 0; i < n; ++i) out[i] = first[i];
  for (int64_t r = 1; r < tp; ++r) {
    const float* part = reinterpret_cast<const float*>(bank + r * capacity);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] += part[i];
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tandem_cpu, m) {
  m.def("shm_all_reduce_(Tensor(a!) x, Tensor shm, int rank, int tp, int seq, int capacity, Tensor pids, "
        "float timeout_s) -> ()");
}

TORCH_LIBRARY_IMPL(tandem_cpu, CPU, m) {
  m.impl("shm_all_reduce_", &shm_all_reduce_);
}
