// CPU kernels for decode steps (XLA FFI custom calls, float32):
// - RowsByWeight: the skinny matmul y[m, n] = sum_k x[m, k] * w[n, k], w packed in panels of 8
//   rows at an offset of a flat buffer (PackRows from [N, K], PackColumns from an nnx.Linear
//   kernel [K, N], both in place);
// - DecodeAttention: one query per row over the KV cache (the model's masked softmax);
// - GreedyPick: each row's first maximum (suppressed ids excluded) and its log-prob, in two
//   vectorised passes over the logits (XLA's CPU backend takes ~3 ms for this at V = 152k);
// - CategoricalPick: the same for a draw from softmax(logits / temperature) by inverse CDF
//   with one given uniform number per row (rules.categorical's method).
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
#include <cmath>
#include <functional>
#include <limits>
#include <cstring>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

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

// Runs fn(c) for c in [0, n): the caller and up to pool.num_threads() - 1 pool tasks claim
// indices from a shared counter. Helpers that start late find nothing left and return (the
// state outlives them: shared_ptr), and the caller never waits for an index nobody claimed,
// so a busy pool cannot stall it.
void ParallelFor(ffi::ThreadPool& pool, int64_t n, std::function<void(int64_t)> fn) {
  struct State {
    std::function<void(int64_t)> fn;
    int64_t n;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> finished{0};
    void Work() {
      for (;;) {
        const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
        if (c >= n) return;
        fn(c);
        finished.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto state = std::make_shared<State>();
  state->fn = std::move(fn);
  state->n = n;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([state] { state->Work(); });
  state->Work();
  while (state->finished.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// Chunks of ~128 KiB of weights: enough to balance two or more threads, few enough that
// claiming one costs nothing next to streaming it.
int64_t PanelsPerChunk(int64_t k) {
  return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(k * kPanel, 1));
}

// Weights live in one flat float32 buffer, each packed at its own offset (in floats): the
// sampler packs every decode weight into one buffer that it reuses from call to call.
ffi::Error RowsByWeight(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> buf, ffi::Buffer<ffi::F32> x,
                        ffi::ResultBuffer<ffi::F32> y, int64_t offset) {
  const auto xd = x.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || yd[0] != xd[0])
    return ffi::Error::InvalidArgument("rows_by_weight: expected x [M, K] and y [M, N]");
  const int64_t m = xd[0], k = xd[1], n = yd[1];
  const int64_t n_panels = (n + kPanel - 1) / kPanel;
  if (offset < 0 || offset + n_panels * k * kPanel > static_cast<int64_t>(buf.element_count()))
    return ffi::Error::InvalidArgument("rows_by_weight: the packed weight runs past its buffer");
  const float* wp = buf.typed_data() + offset;
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  const int64_t chunk = PanelsPerChunk(k);
  ParallelFor(pool, (n_panels + chunk - 1) / chunk, [=](int64_t c) {
    Panels(wp, xp, yp, m, k, n, c * chunk, std::min(n_panels, (c + 1) * chunk));
  });
  return ffi::Error::Success();
}

// Packs a weight into panels at `offset` of the buffer (in place: the output is the input
// buffer, aliased): from rows w [N, K] (columns = false) or from columns w [K, N] (columns =
// true, an nnx.Linear kernel) to [ceil(N / 8), K, 8], zero-padded.
ffi::Error Pack(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> out,
                int64_t offset, bool columns) {
  const auto wd = w.dimensions();
  if (wd.size() != 2) return ffi::Error::InvalidArgument("pack: expected w [N, K] (or [K, N])");
  const int64_t n = columns ? wd[1] : wd[0], k = columns ? wd[0] : wd[1];
  const int64_t n_panels = (n + kPanel - 1) / kPanel;
  if (offset < 0 || offset + n_panels * k * kPanel > static_cast<int64_t>(out->element_count()))
    return ffi::Error::InvalidArgument("pack: the packed weight runs past its buffer");
  const float* src = w.typed_data();
  float* dst = out->typed_data() + offset;
  const int64_t chunk = PanelsPerChunk(k);
  ParallelFor(pool, (n_panels + chunk - 1) / chunk, [=](int64_t c) {
    for (int64_t p = c * chunk; p < std::min(n_panels, (c + 1) * chunk); ++p) {
      float* panel = dst + p * k * kPanel;
      const int64_t cols = std::min<int64_t>(kPanel, n - p * kPanel);
      if (columns) {
        for (int64_t kk = 0; kk < k; ++kk) {
          const float* row = src + kk * n + p * kPanel;
          for (int64_t j = 0; j < kPanel; ++j) panel[kk * kPanel + j] = j < cols ? row[j] : 0.0f;
        }
      } else {
        for (int64_t j = 0; j < kPanel; ++j) {
          const float* row = src + (p * kPanel + j) * k;
          for (int64_t kk = 0; kk < k; ++kk) panel[kk * kPanel + j] = j < cols ? row[kk] : 0.0f;
        }
      }
    }
  });
  return ffi::Error::Success();
}

// `buf` is the operand that XLA aliases to `out` (input_output_aliases): written through `out`.
ffi::Error PackRows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> buf, ffi::Buffer<ffi::F32> w,
                    ffi::ResultBuffer<ffi::F32> out, int64_t offset) {
  return Pack(pool, w, out, offset, false);
}

ffi::Error PackColumns(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> buf, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> out, int64_t offset) {
  return Pack(pool, w, out, offset, true);
}

// An uninitialised buffer (XLA allocates the output; nothing is written): the packing
// buffer when the caller passes none.
ffi::Error Empty(ffi::ResultBuffer<ffi::F32> out) { return ffi::Error::Success(); }

typedef int32_t IVec __attribute__((vector_size(kPanel * sizeof(int32_t))));

// exp(x) for x <= 0 (Cephes' expf polynomial, within 2 ulp); 0 below -87.3.
inline Vec Exp(Vec x) {
  const Vec tiny = x < -87.3f ? Vec{} + 1.0f : Vec{};  // lanes that underflow
  x = x < -87.3f ? Vec{} - 87.3f : x;
  Vec fx = x * 1.44269504088896341f + 0.5f;
  IVec i = __builtin_convertvector(fx, IVec);
  i += (__builtin_convertvector(i, Vec) > fx);  // truncation -> floor (true is -1)
  fx = __builtin_convertvector(i, Vec);
  x = x - fx * 0.693359375f + fx * 2.12194440e-4f;
  const Vec z = x * x;
  Vec y = 1.9875691500e-4f * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  const IVec bits = (i + 127) << 23;
  Vec scale;
  __builtin_memcpy(&scale, &bits, sizeof(Vec));
  return tiny > 0.0f ? Vec{} : y * scale;
}

// Exp of one value (lane 0 of a vector whose other lanes give 0): the same polynomial as the
// vector passes, for tails and masked entries.
inline float Exp1(float x) {
  Vec one = Vec{} - std::numeric_limits<float>::infinity();
  one[0] = x;
  return Exp(one)[0];
}

inline float LaneSum(Vec v) {
  alignas(64) float a[kPanel];
  __builtin_memcpy(a, &v, sizeof(Vec));
  for (int width = kPanel / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) a[l] += a[l + width];
  return a[0];
}

inline bool IsSuppressed(int64_t i, const int32_t* suppress, int64_t n_suppress) {
  bool hit = false;
  for (int64_t s = 0; s < n_suppress; ++s) hit |= suppress[s] == i;
  return hit;
}

// A row's maximum over every entry, and its first maximum among the ids not in `suppress`.
struct RowTop {
  float row_max;  // over all V entries
  float top;      // over the ids that may be picked
  int64_t arg;    // the first of those holding `top`
};

RowTop FindTop(const float* x, int64_t v, const int32_t* suppress, int64_t n_suppress) {
  const int64_t vv = v - v % kPanel;
  Vec best = Vec{} - std::numeric_limits<float>::infinity();
  IVec where = IVec{};
  IVec idx;
  for (int l = 0; l < kPanel; ++l) idx[l] = l;
  for (int64_t i = 0; i < vv; i += kPanel, idx += kPanel) {
    const Vec xi = Load(x + i);
    const auto gt = xi > best;  // strict: each lane keeps its first maximum
    best = gt ? xi : best;
    where = gt ? idx : where;
  }
  float top = -std::numeric_limits<float>::infinity();
  int64_t arg = 0;
  for (int l = 0; l < kPanel; ++l)
    if (best[l] > top || (best[l] == top && where[l] < arg)) top = best[l], arg = where[l];
  for (int64_t i = vv; i < v; ++i)
    if (x[i] > top) top = x[i], arg = i;
  const float row_max = top;
  if (IsSuppressed(arg, suppress, n_suppress)) {
    // rare: a suppressed id holds the maximum; rescan without the suppressed ids
    top = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < v; ++i)
      if (!IsSuppressed(i, suppress, n_suppress) && x[i] > top) top = x[i], arg = i;
  }
  return {row_max, top, arg};
}

// Sums of exp(x / temp - shift) over blocks of kBlock entries: float32 partial sums per block
// (two interleaved vector accumulators), so that the error does not grow with V (a plain
// running float sum over 152k entries is off by ~2e-5 relative).
constexpr int64_t kBlock = 64 * kPanel;

inline float BlockExpSum(const float* x, float temp, float shift) {
  Vec acc0 = Vec{}, acc1 = Vec{};
  for (int64_t i = 0; i < kBlock; i += 2 * kPanel) {
    acc0 += Exp(Load(x + i) / temp - shift);
    acc1 += Exp(Load(x + i + kPanel) / temp - shift);
  }
  return LaneSum(acc0 + acc1);
}

// Greedy pick for one row of logits x [V]: the first maximum among the ids not in
// `suppress`, and its log-prob under softmax over all V entries (suppressed ones included).
void GreedyRow(const float* x, int64_t v, const int32_t* suppress, int64_t n_suppress,
               int32_t* tok, float* lp) {
  const RowTop t = FindTop(x, v, suppress, n_suppress);
  double total = 0.0;  // sum of exp(x - row_max): the normaliser, shifted by the maximum
  int64_t i = 0;
  for (; i + kBlock <= v; i += kBlock) total += BlockExpSum(x + i, 1.0f, t.row_max);
  for (; i < v; ++i) total += Exp1(x[i] - t.row_max);
  *tok = static_cast<int32_t>(t.arg);
  *lp = static_cast<float>(x[t.arg] - t.row_max - std::log(total));
}

// Sampled pick for one row: a draw from softmax(x / temp) over the ids not in `suppress`, by
// inverse CDF with the row's uniform number u in [0, 1) (block masses, then the entries of the
// chosen block, in double), and its log-prob under softmax(x / temp) over all V entries (the
// suppressed ones included, as the teacher-forced pass computes it).
void SampleRow(const float* x, int64_t v, float temp, float u, const int32_t* suppress,
               int64_t n_suppress, int32_t* tok, float* lp) {
  const RowTop t = FindTop(x, v, suppress, n_suppress);
  const float shift = t.top / temp;  // = max of x / temp over the pickable ids
  const int64_t n_blocks = (v + kBlock - 1) / kBlock;
  std::vector<double> mass(n_blocks);  // per block, over the pickable ids
  double total = 0.0;                  // over the pickable ids, relative to the shift
  std::vector<double> others;          // the suppressed ids' x / temp (normaliser only)
  int64_t last = -1;                   // the last block with mass
  for (int64_t b = 0; b < n_blocks; ++b) {
    const int64_t b0 = b * kBlock, b1 = std::min(v, b0 + kBlock);
    bool plain = b1 - b0 == kBlock;
    for (int64_t s = 0; s < n_suppress; ++s) plain &= suppress[s] < b0 || suppress[s] >= b1;
    double m = 0.0;
    if (plain) {
      m = BlockExpSum(x + b0, temp, shift);
    } else {
      for (int64_t i = b0; i < b1; ++i) {
        if (IsSuppressed(i, suppress, n_suppress))
          others.push_back(static_cast<double>(x[i] / temp));
        else
          m += Exp1(x[i] / temp - shift);
      }
    }
    mass[b] = m;
    total += m;
    if (m > 0.0) last = b;
  }
  const double target = static_cast<double>(u) * total;
  double before = 0.0;
  int64_t b = 0;
  for (; b < last; before += mass[b], ++b)
    if (mass[b] > 0.0 && before + mass[b] > target) break;
  // within block b: the first id whose running mass passes the target; float rounding (the
  // block's vector sum against this scalar one) can leave it just short: the block's last
  // id with mass then
  int64_t pick = t.arg;
  double run = before;
  for (int64_t i = b * kBlock; i < std::min(v, (b + 1) * kBlock); ++i) {
    if (IsSuppressed(i, suppress, n_suppress)) continue;
    const float e = Exp1(x[i] / temp - shift);
    if (e <= 0.0f) continue;
    pick = i;
    run += e;
    if (run > target) break;
  }
  *tok = static_cast<int32_t>(pick);
  // log of the normaliser over every id: a suppressed id may lie far above the shift (exp
  // would overflow even in double), so the sum is taken relative to the largest term
  double top = shift;
  for (double o : others) top = std::max(top, o);
  double sum = total * std::exp(shift - top);
  for (double o : others) sum += std::exp(o - top);
  *lp = static_cast<float>(static_cast<double>(x[pick] / temp) - top - std::log(sum));
}

ffi::Error GreedyPick(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                      ffi::Buffer<ffi::S32> suppress, ffi::ResultBuffer<ffi::S32> tok,
                      ffi::ResultBuffer<ffi::F32> lp) {
  const auto ld = logits.dimensions();
  if (ld.size() != 2 || suppress.dimensions().size() != 1 ||
      static_cast<int64_t>(tok->element_count()) != ld[0] ||
      static_cast<int64_t>(lp->element_count()) != ld[0])
    return ffi::Error::InvalidArgument("greedy_pick: expected logits [B, V], suppress [S]");
  const float* x = logits.typed_data();
  const int32_t* sup = suppress.typed_data();
  const int64_t n_sup = suppress.element_count(), v = ld[1];
  int32_t* t = tok->typed_data();
  float* l = lp->typed_data();
  ParallelFor(pool, ld[0], [=](int64_t b) { GreedyRow(x + b * v, v, sup, n_sup, t + b, l + b); });
  return ffi::Error::Success();
}

ffi::Error CategoricalPick(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                           ffi::Buffer<ffi::F32> uniform, ffi::Buffer<ffi::S32> suppress,
                           ffi::ResultBuffer<ffi::S32> tok, ffi::ResultBuffer<ffi::F32> lp,
                           float temperature) {
  const auto ld = logits.dimensions();
  if (ld.size() != 2 || suppress.dimensions().size() != 1 ||
      static_cast<int64_t>(uniform.element_count()) != ld[0] ||
      static_cast<int64_t>(tok->element_count()) != ld[0] ||
      static_cast<int64_t>(lp->element_count()) != ld[0] || !(temperature > 0.0f))
    return ffi::Error::InvalidArgument(
        "categorical_pick: expected logits [B, V], uniform [B], suppress [S], temperature > 0");
  const float* x = logits.typed_data();
  const float* u = uniform.typed_data();
  const int32_t* sup = suppress.typed_data();
  const int64_t n_sup = suppress.element_count(), v = ld[1];
  int32_t* t = tok->typed_data();
  float* l = lp->typed_data();
  ParallelFor(pool, ld[0], [=](int64_t b) {
    SampleRow(x + b * v, v, temperature, u[b], sup, n_sup, t + b, l + b);
  });
  return ffi::Error::Success();
}

// One decode query per row over a float32 KV cache, for one (row, kv head): q [G, H] (the G
// query heads sharing the kv head), keys [H, S], values [S, H], mask [S] -> out [G, H]. Like
// the model's masked_softmax: scores * scale, masked keys excluded, softmax in float32, a
// fully masked row gives zeros.
void AttendOne(const float* q, const float* keys, const float* values, const bool* mask,
               float* out, int64_t g, int64_t h, int64_t s, float scale) {
  std::vector<float> scores(g * s, 0.0f);
  for (int64_t hh = 0; hh < h; ++hh) {
    const float* krow = keys + hh * s;
    for (int64_t gg = 0; gg < g; ++gg) {
      const float qv = q[gg * h + hh];
      float* sc = scores.data() + gg * s;
      for (int64_t j = 0; j < s; ++j) sc[j] += qv * krow[j];
    }
  }
  for (int64_t gg = 0; gg < g; ++gg) {
    float* sc = scores.data() + gg * s;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < s; ++j)
      if (mask[j]) top = std::max(top, sc[j] * scale);
    // exp(score * scale - top), masked keys at -inf (exp 0), kPanel keys at a time; the
    // normaliser is summed key by key in double
    const int64_t sv = s - s % kPanel;
    for (int64_t j = 0; j < sv; j += kPanel) {
      Vec z = Load(sc + j) * scale - top;
      for (int l = 0; l < kPanel; ++l)
        if (!mask[j + l]) z[l] = -std::numeric_limits<float>::infinity();
      const Vec e = Exp(z);
      __builtin_memcpy(sc + j, &e, sizeof(Vec));
    }
    for (int64_t j = sv; j < s; ++j) sc[j] = mask[j] ? Exp1(sc[j] * scale - top) : 0.0f;
    double total = 0.0;
    for (int64_t j = 0; j < s; ++j) total += sc[j];
    const float inv = total > 0.0 ? static_cast<float>(1.0 / total) : 0.0f;
    float* o = out + gg * h;
    for (int64_t hh = 0; hh < h; ++hh) o[hh] = 0.0f;
    for (int64_t j = 0; j < s; ++j) {
      const float p = sc[j] * inv;
      if (p == 0.0f) continue;
      const float* vrow = values + j * h;
      for (int64_t hh = 0; hh < h; ++hh) o[hh] += p * vrow[hh];
    }
  }
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask,
                           ffi::ResultBuffer<ffi::F32> out, float scale) {
  const auto qd = q.dimensions();  // [B, K, G, H]
  const auto kd = k.dimensions();  // [B, K, H, S]
  const auto vd = v.dimensions();  // [B, K, S, H]
  const auto md = mask.dimensions();  // [B, S]
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || md.size() != 2 || kd[0] != qd[0] ||
      kd[1] != qd[1] || kd[2] != qd[3] || vd[0] != qd[0] || vd[1] != qd[1] || vd[2] != kd[3] ||
      vd[3] != qd[3] || md[0] != qd[0] || md[1] != kd[3])
    return ffi::Error::InvalidArgument(
        "decode_attention: expected q [B, K, G, H], keys [B, K, H, S], values [B, K, S, H], "
        "mask [B, S]");
  const int64_t b = qd[0], kv = qd[1], g = qd[2], h = qd[3], s = kd[3];
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const bool* mp = mask.typed_data();
  float* op = out->typed_data();
  ParallelFor(pool, b * kv, [=](int64_t i) {
    const int64_t row = i / kv;
    AttendOne(qp + i * g * h, kp + i * h * s, vp + i * s * h, mp + row * s, op + i * g * h, g, h,
              s, scale);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxvrlRowsByWeight, RowsByWeight,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxvrlPackRows, PackRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxvrlPackColumns, PackColumns,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxvrlEmpty, Empty,
                              ffi::Ffi::Bind().Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxvrlGreedyPick, GreedyPick,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxvrlCategoricalPick, CategoricalPick,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("temperature"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxvrlDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
