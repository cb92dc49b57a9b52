// x[M, K] . W[K, N] for a few rows (M = 1..8) on the CPU, with W packed in column panels:
// P[N / 64][K][64] (the last panel zero-padded), so each panel is one contiguous run of memory.
// Every output is one fp32 chain of multiply-adds over k = 0..K-1 in order, whatever M is and
// whichever panel or thread computes it: a row's result is bitwise the same alone or among 8
// (a decode step and a tree verification then compute the same products). XLA:CPU's GEMM
// handles 2-8 rows at 1.2-1.9x the cost of one though the weights are read once either way; this
// streams each panel once for all M rows. Built and measured by benchmarks/cpu_rows_kernel.py
// (not used by the engine yet).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPanel = 64;  // columns per packed panel
typedef float v16 __attribute__((vector_size(64)));  // 16 floats (lowered to the CPU's vectors)

// The V * 16 columns at `col` of panel `p` for the M rows of x, written to y[M, N] (columns past N
// in the last panel are not written).
template <int M, int V>
void Block(const float* x, const float* p, float* y, int64_t K, int64_t N, int64_t col) {
  v16 acc[M][V];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) acc[m][v] = v16{};
  const float* wp = p + (col % kPanel);
  for (int64_t k = 0; k < K; ++k, wp += kPanel) {
    v16 w[V];
    for (int v = 0; v < V; ++v) std::memcpy(&w[v], wp + 16 * v, sizeof(v16));
    for (int m = 0; m < M; ++m) {
      const float xm = x[m * K + k];
      for (int v = 0; v < V; ++v) acc[m][v] += xm * w[v];
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int v = 0; v < V; ++v) {
      const int64_t c = col + 16 * v;
      if (c + 16 <= N) {
        std::memcpy(y + m * N + c, &acc[m][v], sizeof(v16));
      } else {
        for (int64_t i = 0; c + i < N; ++i) y[m * N + c + i] = acc[m][v][i];
      }
    }
  }
}

// Panels [p0, p1): each in blocks of V * 16 columns.
template <int M, int V>
void Panels(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = w + p * K * kPanel;
    for (int64_t c = 0; c < kPanel && p * kPanel + c < N; c += 16 * V)
      Block<M, V>(x, panel, y, K, N, p * kPanel + c);
  }
}

// The panels split in chunks that the calling thread and the pool's threads take in turn. The
// caller never waits for a chunk nobody has started, so a pool busy elsewhere cannot stall it.
template <int M, int V>
void Run(const float* x, const float* w, float* y, int64_t K, int64_t N, ffi::ThreadPool& pool) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t chunks = std::min<int64_t>(panels, 4 * threads);
  if (chunks <= 1 || threads <= 1) {
    Panels<M, V>(x, w, y, K, N, 0, panels);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto st = std::make_shared<State>();
  auto work = [=]() {
    for (int64_t c; (c = st->next.fetch_add(1)) < chunks;) {
      Panels<M, V>(x, w, y, K, N, panels * c / chunks, panels * (c + 1) / chunks);
      st->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 0; i < std::min<int64_t>(threads - 1, chunks - 1); ++i) {
    auto task = work;
    pool.Schedule(std::move(task));
  }
  work();
  while (st->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

ffi::Error RowsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    int64_t n, ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions();
  if (wd.size() != 3 || wd[2] != kPanel) return ffi::Error::InvalidArgument("cpu_rows: W must be [N/64, K, 64]");
  const int64_t K = wd[1];
  if (K == 0 || x.element_count() % K != 0) return ffi::Error::InvalidArgument("cpu_rows: x is not [M, K]");
  const int64_t M = x.element_count() / K;
  if (n > wd[0] * kPanel || n <= (wd[0] - 1) * kPanel) return ffi::Error::InvalidArgument("cpu_rows: N does not match W's panels");
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  switch (M) {
    case 1: Run<1, 4>(xp, wp, yp, K, n, pool); break;
    case 2: Run<2, 4>(xp, wp, yp, K, n, pool); break;
    case 3: Run<3, 2>(xp, wp, yp, K, n, pool); break;
    case 4: Run<4, 2>(xp, wp, yp, K, n, pool); break;
    case 5: Run<5, 2>(xp, wp, yp, K, n, pool); break;
    case 6: Run<6, 2>(xp, wp, yp, K, n, pool); break;
    case 7: Run<7, 2>(xp, wp, yp, K, n, pool); break;
    case 8: Run<8, 2>(xp, wp, yp, K, n, pool); break;
    default: return ffi::Error::InvalidArgument("cpu_rows: 1-8 rows only");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Eagle3CpuRows, RowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("n")
                                  .Ret<ffi::Buffer<ffi::F32>>());
