// Skinny matmul for CPU decode steps: y[m, n] = sum_k x[m, k] * w[n, k], float32, with w
// packed in panels of 8 rows (see Panel below).
//
// A decode step multiplies a few rows (M = batch) by large weights held [N, K] (the LM head's
// 151936 x D table, the decoder's projections transposed). XLA's CPU dot reads such weights at
// roughly half the machine's memory bandwidth; this kernel streams each weight row once,
// keeps x in cache and splits the rows of w between the caller and XLA's intra-op threads.
//
// Summation order (fixed, independent of the thread count): each output is one sequential
// sum over k of fused multiply-adds. Built by jaxvrl/sampling/cpu_kernels.py (g++ -O3
// -march=native) on first use; nothing here is needed for correctness elsewhere.

#include <algorithm>
#include <cstring>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Weights come packed in panels of kPanel output columns: wp[p, k, j] = w[p * kPanel + j, k]
// (zero rows pad N to a multiple of kPanel), so a panel streams from memory contiguously.
constexpr int kPanel = 8;
constexpr int kRowBlock = 8;  // rows of x per pass over a panel (accumulators in registers)
// Bytes ahead of the current weight read that are prefetched into L2: the loop is not purely
// bandwidth-bound, and the hardware prefetcher alone leaves the load queue short on 2 cores.
constexpr int kPrefetchFloats = 512;

typedef float Vec __attribute__((vector_size(kPanel * sizeof(float))));

inline Vec Load(const float* p) {
  Vec v;
  __builtin_memcpy(&v, p, sizeof(Vec));
  return v;
}

// y[m0 + r, col0 + j] for r < MB, j < cols (cols <= kPanel): one pass over panel wp [K, 8];
// each output is a plain sequential sum over k of fused multiply-adds.
template <int MB>
inline void Panel(const float* wp, const float* x, float* y, int64_t k, int64_t n_total,
                  int64_t col0, int64_t cols, int64_t m0) {
  Vec acc[MB];
  for (int r = 0; r < MB; ++r) acc[r] = Vec{};
  const float* x0 = x + m0 * k;
  for (int64_t kk = 0; kk < k; ++kk) {
    __builtin_prefetch(wp + kk * kPanel + kPrefetchFloats, 0, 2);
    const Vec w = Load(wp + kk * kPanel);
    for (int r = 0; r < MB; ++r) acc[r] += w * x0[r * k + kk];
  }
  for (int r = 0; r < MB; ++r) {
    float* out = y + (m0 + r) * n_total + col0;
    if (cols == kPanel) {
      __builtin_memcpy(out, &acc[r], sizeof(Vec));
    } else {
      alignas(64) float tmp[kPanel];
      __builtin_memcpy(tmp, &acc[r], sizeof(Vec));
      for (int64_t j = 0; j < cols; ++j) out[j] = tmp[j];
    }
  }
}

// Panels [p0, p1): each panel is read from memory once, for every row of x.
void Panels(const float* wp, const float* x, float* y, int64_t m, int64_t k, int64_t n_total,
            int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = wp + p * k * kPanel;
    const int64_t col0 = p * kPanel;
    const int64_t cols = std::min<int64_t>(kPanel, n_total - col0);
    int64_t m0 = 0;
    for (; m0 + kRowBlock <= m; m0 += kRowBlock)
      Panel<kRowBlock>(panel, x, y, k, n_total, col0, cols, m0);
    switch (m - m0) {
      case 7: Panel<7>(panel, x, y, k, n_total, col0, cols, m0); break;
      case 6: Panel<6>(panel, x, y, k, n_total, col0, cols, m0); break;
      case 5: Panel<5>(panel, x, y, k, n_total, col0, cols, m0); break;
      case 4: Panel<4>(panel, x, y, k, n_total, col0, cols, m0); break;
      case 3: Panel<3>(panel, x, y, k, n_total, col0, cols, m0); break;
      case 2: Panel<2>(panel, x, y, k, n_total, col0, cols, m0); break;
      case 1: Panel<1>(panel, x, y, k, n_total, col0, cols, m0); break;
      default: break;
    }
  }
}

struct Job {
  const float* w;
  const float* x;
  float* y;
  int64_t m, k, n, n_panels, chunk, n_chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> finished{0};

  // Claims and runs chunks until none are left; returns when it claims past the end.
  void Work() {
    for (;;) {
      const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
      if (c >= n_chunks) return;
      const int64_t p0 = c * chunk;
      Panels(w, x, y, m, k, n, p0, std::min(n_panels, p0 + chunk));
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error RowsByWeight(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> x,
                        ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions();
  const auto xd = x.dimensions();
  const auto yd = y->dimensions();
  if (wd.size() != 3 || wd[2] != kPanel || xd.size() != 2 || wd[1] != xd[1] || yd.size() != 2 ||
      yd[0] != xd[0] || yd[1] > wd[0] * kPanel || yd[1] <= (wd[0] - 1) * kPanel)
    return ffi::Error::InvalidArgument(
        "rows_by_weight: expected packed w [ceil(N / 8), K, 8], x [M, K] and y [M, N]");
  auto job = std::make_shared<Job>();
  job->w = w.typed_data();
  job->x = x.typed_data();
  job->y = y->typed_data();
  job->m = xd[0];
  job->k = wd[1];
  job->n = yd[1];
  job->n_panels = wd[0];
  // ~128 KiB of weights per chunk: enough chunks to balance two or more threads, few enough
  // that claiming one costs nothing next to streaming it.
  job->chunk = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(job->k * kPanel, 1));
  job->n_chunks = (job->n_panels + job->chunk - 1) / job->chunk;
  // Helpers that start late find nothing left and return; the job outlives them (shared_ptr).
  // The caller never waits for a chunk nobody has claimed, so a busy pool cannot stall it.
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), job->n_chunks) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([job] { job->Work(); });
  job->Work();
  while (job->finished.load(std::memory_order_acquire) < job->n_chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxvrlRowsByWeight, RowsByWeight,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
