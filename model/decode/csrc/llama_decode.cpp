// One decode step of a Llama-architecture decoder in C++ (see model/decode/native.py for why and how
// it is built). The projections are fbgemm int8 linears, activations quantized row by row (or float ones, at::linear):
// the same kernels the eager int8 path calls. Everything between them (RMSNorm, smoothing
// scales, RoPE, the K/V write into the paged cache, grouped-query attention over each row's own
// history, read block by block where it lies, SiLU gating, residuals) is plain loops over
// contiguous float32 rows, so a step costs its kernels and little else.
//
// The lineages after Llama are described by data, never by a second copy per lineage: a q/k/v
// bias rides in the projection; per layer, optional q/k norms (over each head, before RoPE),
// optional norms on each sublayer's output (Gemma's post-norms), a sliding window and which of
// two rotary tables it reads; per model, an embedding scale and the gate's activation (SiLU or
// tanh GELU). set_features / set_layer_features set them; without those calls it is a Llama.
//
// Shapes: B rows (one new token each), d model width, nh query heads, nkv key/value heads,
// hs head size, ff feed-forward width, BL positions per cache block. The cache is a pool of blocks
// (layers, nkv, blocks, BL, hs); row b's position p lies in block tables[b, p / BL] at offset p % BL.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <limits>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

// The vectorised attention is compiled for AVX-512 whatever the build flags (function target
// attributes) and chosen at run time by what the CPU supports, so a portable build (the
// container's) still uses it on a CPU that has it.
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define TSERVE_AVX512 1
#define TSERVE_TARGET_AVX512 __attribute__((target("avx512f")))
#endif

namespace {

using at::Tensor;

// A second thread for steps of a few rows. Under a passive OpenMP wait policy such a step runs
// on one intra-op thread (model/decode/threads.py: waking sleeping OpenMP threads for each of a
// step's hundreds of small regions cost more than it gained), which leaves half the memory
// bandwidth of a 2-core host unused at batch 1. This thread shares each projection and the
// attention of a step: the work comes as numbered chunks (a projection's halves or tiles,
// attention items), and both threads claim the next unclaimed chunk until none is left. The
// step's thread never waits for a partner that is asleep or not scheduled: it takes every chunk
// the partner has not claimed, and waits only for chunks the partner is running. Which thread
// runs a chunk changes no bit: a chunk is a set of whole outputs. The partner spins briefly
// between the pieces of a step and sleeps on a condition variable between steps, so the event
// loop has the core while the engine does its Python work.
class Partner {
 public:
  Partner() : thread_([this] { loop(); }) {}
  ~Partner() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_one();
    thread_.join();
  }

  // chunk(c) for c in [0, n), shared with the partner thread; returns when all are done.
  void run(int64_t n, const std::function<void(int64_t)>& chunk) {
    if (n <= 0) return;
    TORCH_CHECK(n < 0xffff, "at most 65,534 chunks per handoff");
    task_.store(&chunk, std::memory_order_relaxed);
    chunks_.store(n, std::memory_order_relaxed);
    // The state word: ticket (high 32 bits), next unclaimed chunk (16 bits), chunks the
    // partner is running (low 16 bits). A new ticket starts only once the last one's chunks
    // are all done, so the partner can never claim a chunk of an old task.
    ticket_ = (ticket_ + 1) & 0xffffffffu;
    state_.store(ticket_ << 32, std::memory_order_release);
    // seq_cst on posted_ and sleeping_: the partner sets sleeping_ then reads posted_, this reads
    // them the other way round, so one of the two always sees the other's write (no lost wake-up).
    posted_.fetch_add(1);
    if (sleeping_.load()) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_one();
    }
    int64_t c;
    while ((c = claim(false)) >= 0) chunk(c);
    // Every chunk is claimed: wait for the ones the partner is running (spin, then yield: a
    // partner woken onto this core runs only when this thread lets it).
    for (int spins = 0; (state_.load(std::memory_order_acquire) & 0xffffu) != 0; ++spins) {
      if (spins < 4096)
        cpu_relax();
      else
        std::this_thread::yield();
    }
    // Closed: the next chunk past any count. A partner still holding this ticket must not read
    // the next task's chunk count (written before its ticket is) against this ticket's word
    // and claim a chunk this task does not have.
    state_.store((ticket_ << 32) | (uint64_t{0xffff} << 16), std::memory_order_release);
  }

 private:
  static void cpu_relax() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  // The next chunk of the current ticket (and, for the partner, one more chunk running), or -1.
  int64_t claim(bool partner) {
    uint64_t s = state_.load(std::memory_order_acquire);
    while (true) {
      const int64_t next = static_cast<int64_t>((s >> 16) & 0xffffu);
      if ((s >> 32) != ticket_seen(partner) || next >= chunks_.load(std::memory_order_relaxed)) return -1;
      const uint64_t want = s + (uint64_t{1} << 16) + (partner ? 1u : 0u);
      if (state_.compare_exchange_weak(s, want, std::memory_order_acq_rel)) return next;
    }
  }
  uint64_t ticket_seen(bool partner) const { return partner ? partner_ticket_ : ticket_; }

  // Its kernels run inline: a task only comes during a step of one intra-op thread, so the
  // thread count this thread takes on its first parallel call (torch reads it once per thread)
  // is 1.
  void loop() {
    uint64_t seen = 0;
    while (true) {
      // Spin a little for the next piece of the same step, then sleep until the next step.
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
      while (posted_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until)
        cpu_relax();
      if (posted_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleeping_.store(true);
        wake_.wait(lock, [&] { return stop_ || posted_.load() != seen; });
        sleeping_.store(false);
        if (stop_) return;
      }
      seen = posted_.load(std::memory_order_acquire);
      // The ticket of the task posted last; if the step's thread has moved on since, its state
      // word carries a newer ticket and nothing is claimed here.
      partner_ticket_ = state_.load(std::memory_order_acquire) >> 32;
      const std::function<void(int64_t)>* task = task_.load(std::memory_order_relaxed);
      int64_t c;
      while ((c = claim(true)) >= 0) {
        (*task)(c);
        state_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  std::atomic<const std::function<void(int64_t)>*> task_{nullptr};  // written before the state word (release)
  std::atomic<int64_t> chunks_{0};
  uint64_t ticket_ = 0;  // the step's thread's
  uint64_t partner_ticket_ = 0;  // the partner's copy
  std::atomic<uint64_t> state_{0};
  std::atomic<uint64_t> posted_{0};
  std::atomic<bool> sleeping_{false};
  bool stop_ = false;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::thread thread_;
};

// fn(b0, b1) over rows [0, B) in pieces of at least ~16k values (`per_row` values a row): shared
// with `partner` where there is one and torch runs on one thread (a step's own work), else over
// torch's threads. A decode step's few rows stay in one piece, on this thread; a prompt's hundreds
// of rows are split, so the partner is not idle through the step's row-wise passes (norms, RoPE,
// activations, quantizing). Each row's arithmetic is the same whichever thread runs it.
template <typename F>
void over_rows(Partner* partner, int64_t B, int64_t per_row, const F& fn) {
  const int64_t rows_per = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(per_row, 1));
  if (partner != nullptr && at::get_num_threads() == 1) {
    if (B <= rows_per) return fn(0, B);
    const int64_t pieces = std::min<int64_t>((B + rows_per - 1) / rows_per, 64);
    const int64_t per = (B + pieces - 1) / pieces;
    partner->run((B + per - 1) / per, [&](int64_t c) { fn(c * per, std::min(B, (c + 1) * per)); });
    return;
  }
  at::parallel_for(0, B, rows_per, fn);
}

// 4-bit weights as GGUF's Q4_0 / Q4_1 store them: each run of 32 inputs of an output row has its
// own scale d and offset m (float16), w = d q + m with q in [0, 15]. Activations go in as 8-bit
// integers with one scale per run of 32 of the row (a = s_a r, r in [-127, 127]), so a run's
// product is one integer dot product:
//   sum_k w_k a_k = s_a (d sum_k q_k r_k + m sum_k r_k).
// Half the bytes of int8 per weight (0.625 with the two scales), which is what a step of a few
// rows waits for. Each (row, output) sums its runs in the same order whatever the rows beside
// it, so a row's result never depends on the batch.
//
// Layout, built by model/quant/q4.py (pack_q4): outputs in tiles of 16, each tile's runs one after
// the other, a run in Q4_RUN_BYTES = 320 bytes: four 64-byte chunks of nibbles, then the 16 d, then
// the 16 m (float16 bits). Byte 4j + t of chunk c holds, for output j of the tile, input
// 8c + t of the run in its low nibble and input 8c + 4 + t in its high nibble: so a chunk's low
// nibbles and its high nibbles are each one VNNI operand (16 outputs x 4 consecutive inputs).
constexpr int64_t Q4_TILE = 16, Q4_RUN = 32, Q4_RUN_BYTES = 320;
constexpr int64_t Q4_CHUNK = 4;  // tiles per chunk shared with the partner thread
// From this many rows an int8 projection shared with the partner splits its rows, not its outputs.
constexpr int64_t kRowSplit = 64;

// One row of activations, quantized run by run: r (K int8), and per run its scale s_a and
// s_a * sum(r) (for the offsets).
struct Q8Rows {
  std::vector<int8_t> r;
  std::vector<float> scale, scaled_sum;
  void quantize(const float* x, int64_t B, int64_t K) {
    const int64_t runs = K / Q4_RUN;
    r.resize(B * K);
    scale.resize(B * runs);
    scaled_sum.resize(B * runs);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t u = 0; u < runs; ++u) {
        const float* xs = x + b * K + u * Q4_RUN;
        float top = 0.0f;
        for (int64_t k = 0; k < Q4_RUN; ++k) top = std::max(top, std::fabs(xs[k]));
        const float s = top / 127.0f, inv = top > 0.0f ? 127.0f / top : 0.0f;
        int32_t sum = 0;
        int8_t* rs = r.data() + b * K + u * Q4_RUN;
        for (int64_t k = 0; k < Q4_RUN; ++k) {
          const int32_t v = static_cast<int32_t>(std::nearbyint(xs[k] * inv));
          rs[k] = static_cast<int8_t>(std::max(-127, std::min(127, v)));
          sum += rs[k];
        }
        scale[b * runs + u] = s;
        scaled_sum[b * runs + u] = s * static_cast<float>(sum);
      }
  }
};

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 113;
      while ((man & 0x400u) == 0) {
        man <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
    }
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Output tiles [t0, t1) of y (B, N) for B rows: the portable loop, in the vector loop's order
// (an exact integer dot per run, then y += float(dot) * (d * s_a), then y += m * (s_a sum r)),
// so both give the same bits.
void q4_tiles_scalar(const uint8_t* w, const Q8Rows& a, int64_t B, int64_t K, int64_t N, int64_t t0, int64_t t1,
                     float* y) {
  const int64_t runs = K / Q4_RUN;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t b = 0; b < B; ++b) {
      float acc[Q4_TILE] = {0};
      for (int64_t u = 0; u < runs; ++u) {
        const uint8_t* run = w + (t * runs + u) * Q4_RUN_BYTES;
        const uint16_t* dm = reinterpret_cast<const uint16_t*>(run + 256);
        const int8_t* r = a.r.data() + b * K + u * Q4_RUN;
        const float s = a.scale[b * runs + u], ss = a.scaled_sum[b * runs + u];
        for (int64_t j = 0; j < Q4_TILE; ++j) {
          int32_t dot = 0;
          for (int c = 0; c < 4; ++c)
            for (int t4 = 0; t4 < 4; ++t4) {
              const uint8_t byte = run[c * 64 + 4 * j + t4];
              dot += static_cast<int32_t>(byte & 0x0f) * r[8 * c + t4] + static_cast<int32_t>(byte >> 4) * r[8 * c + 4 + t4];
            }
          acc[j] = std::fma(static_cast<float>(dot), half_to_float(dm[j]) * s, acc[j]);
          acc[j] = std::fma(half_to_float(dm[16 + j]), ss, acc[j]);
        }
      }
      std::copy_n(acc, Q4_TILE, y + b * N + t * Q4_TILE);
    }
}

#if defined(TSERVE_AVX512)
#define TSERVE_TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
// The same with VNNI: per tile and run, the four chunks are widened into eight operands once and
// used for up to eight rows at a time.
TSERVE_TARGET_VNNI inline void q4_unpack(const uint8_t* run, __m512i* q, __m512& d, __m512& m) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int c = 0; c < 4; ++c) {
    const __m512i bytes = _mm512_loadu_si512(run + 64 * c);
    q[2 * c] = _mm512_and_si512(bytes, low);
    q[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
  }
  d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + 256)));
  m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + 288)));
}

// acc += float(q . r) * (d s) + m (s sum r) for one tile and one row's run.
TSERVE_TARGET_VNNI inline __m512 q4_run_row(const __m512i* q, __m512 d, __m512 m, const __m512i* r, __m512 s,
                                            __m512 ss, __m512 acc) {
  __m512i dot = _mm512_setzero_si512();
  for (int g = 0; g < 8; ++g) dot = _mm512_dpbusd_epi32(dot, q[g], r[g]);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, s), acc);
  return _mm512_fmadd_ps(m, ss, acc);
}

// The same with VNNI. A tile's run is widened into eight operands once and used for up to
// MB rows; tiles go two at a time, sharing each row's broadcast activations.
TSERVE_TARGET_VNNI void q4_tiles_vnni(const uint8_t* w, const Q8Rows& a, int64_t B, int64_t K, int64_t N, int64_t t0,
                                      int64_t t1, float* y) {
  constexpr int64_t MB = 4;
  const int64_t runs = K / Q4_RUN;
  int64_t t = t0;
  for (; t + 2 <= t1; t += 2)
    for (int64_t b0 = 0; b0 < B; b0 += MB) {
      const int64_t rows = std::min(MB, B - b0);
      __m512 acc0[MB], acc1[MB];
      for (int64_t i = 0; i < MB; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
      for (int64_t u = 0; u < runs; ++u) {
        __m512i q0[8], q1[8];
        __m512 d0, m0, d1, m1;
        q4_unpack(w + (t * runs + u) * Q4_RUN_BYTES, q0, d0, m0);
        q4_unpack(w + ((t + 1) * runs + u) * Q4_RUN_BYTES, q1, d1, m1);
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t b = b0 + i;
          const int32_t* groups = reinterpret_cast<const int32_t*>(a.r.data() + b * K + u * Q4_RUN);
          __m512i r[8];
          for (int g = 0; g < 8; ++g) r[g] = _mm512_set1_epi32(groups[g]);
          const __m512 s = _mm512_set1_ps(a.scale[b * runs + u]), ss = _mm512_set1_ps(a.scaled_sum[b * runs + u]);
          acc0[i] = q4_run_row(q0, d0, m0, r, s, ss, acc0[i]);
          acc1[i] = q4_run_row(q1, d1, m1, r, s, ss, acc1[i]);
        }
      }
      for (int64_t i = 0; i < rows; ++i) {
        _mm512_storeu_ps(y + (b0 + i) * N + t * Q4_TILE, acc0[i]);
        _mm512_storeu_ps(y + (b0 + i) * N + (t + 1) * Q4_TILE, acc1[i]);
      }
    }
  for (; t < t1; ++t)  // an odd tile at the end
    for (int64_t b = 0; b < B; ++b) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t u = 0; u < runs; ++u) {
        __m512i q[8];
        __m512 d, m;
        q4_unpack(w + (t * runs + u) * Q4_RUN_BYTES, q, d, m);
        const int32_t* groups = reinterpret_cast<const int32_t*>(a.r.data() + b * K + u * Q4_RUN);
        __m512i r[8];
        for (int g = 0; g < 8; ++g) r[g] = _mm512_set1_epi32(groups[g]);
        acc = q4_run_row(q, d, m, r, _mm512_set1_ps(a.scale[b * runs + u]), _mm512_set1_ps(a.scaled_sum[b * runs + u]), acc);
      }
      _mm512_storeu_ps(y + b * N + t * Q4_TILE, acc);
    }
}
#endif

void q4_tiles(const uint8_t* w, const Q8Rows& a, int64_t B, int64_t K, int64_t N, int64_t t0, int64_t t1, float* y) {
#if defined(TSERVE_AVX512)
  static const bool vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  if (vnni) return q4_tiles_vnni(w, a, B, K, N, t0, t1, y);
#endif
  q4_tiles_scalar(w, a, B, K, N, t0, t1, y);
}

// One projection y = W (x * inv_scale) + b: 4-bit runs when `q4` is set (q4_tiles), fbgemm int8 when
// `packed` is set, else float.
// One row of rowwise_int8_linear's correction, out = s ((out - b) - z W1) + b, with every product
// rounded on its own (no fused multiply-add): the arithmetic of its tensor operations, bit for bit.
__attribute__((optimize("fp-contract=off"))) void correct_row_unfused_plain(float* out, int64_t m, float s, float z,
                                                                            const float* row_sum, const float* bias) {
  if (bias == nullptr) {
    for (int64_t j = 0; j < m; ++j) out[j] = s * (out[j] - z * row_sum[j]);
    return;
  }
  for (int64_t j = 0; j < m; ++j) out[j] = s * ((out[j] - bias[j]) - z * row_sum[j]) + bias[j];
}

// A row's int8 range, lo = min(0, min x), hi = max(0, max x) (NaN skipped, as std::min / std::max
// skip it), and its values on the shared grid, u = x / s + z.
void row_range_plain(const float* row, int64_t n, float& lo, float& hi) {
  lo = hi = 0.0f;
  for (int64_t k = 0; k < n; ++k) {
    lo = std::min(lo, row[k]);
    hi = std::max(hi, row[k]);
  }
}
void to_grid_plain(const float* row, int64_t n, float s, float z, float* u) {
  for (int64_t k = 0; k < n; ++k) u[k] = row[k] / s + z;
}

#if defined(TSERVE_AVX512)
// The same three on 16-float vectors, every operation the scalar one (min / max pick what
// std::min / std::max pick, NaN included; division, products and sums each rounded on their
// own), so the same bits: at an encoder's thousands of rows these passes cost as much as the
// product, and the compiler leaves the range's min / max and the unfused correction scalar.
TSERVE_TARGET_AVX512 void row_range_avx512(const float* row, int64_t n, float& lo, float& hi) {
  __m512 l = _mm512_setzero_ps(), h = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m512 x = _mm512_loadu_ps(row + k);
    l = _mm512_min_ps(x, l);  // (x < l) ? x : l, as std::min(l, x)
    h = _mm512_max_ps(x, h);  // (x > h) ? x : h, as std::max(h, x)
  }
  lo = _mm512_reduce_min_ps(l);
  hi = _mm512_reduce_max_ps(h);
  for (; k < n; ++k) {
    lo = std::min(lo, row[k]);
    hi = std::max(hi, row[k]);
  }
}
__attribute__((target("avx512f"), optimize("fp-contract=off"))) void to_grid_avx512(const float* row, int64_t n, float s,
                                                                                    float z, float* u) {
  const __m512 sv = _mm512_set1_ps(s), zv = _mm512_set1_ps(z);
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) _mm512_storeu_ps(u + k, _mm512_add_ps(_mm512_div_ps(_mm512_loadu_ps(row + k), sv), zv));
  for (; k < n; ++k) u[k] = row[k] / s + z;
}
// (the compiler would fuse the intrinsics' product and difference into one rounding otherwise)
__attribute__((target("avx512f"), optimize("fp-contract=off"))) void correct_row_unfused_avx512(
    float* out, int64_t m, float s, float z, const float* row_sum, const float* bias) {
  const __m512 sv = _mm512_set1_ps(s), zv = _mm512_set1_ps(z);
  int64_t j = 0;
  for (; j + 16 <= m; j += 16) {
    __m512 y = _mm512_loadu_ps(out + j);
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + j) : _mm512_setzero_ps();
    if (bias != nullptr) y = _mm512_sub_ps(y, b);
    y = _mm512_mul_ps(sv, _mm512_sub_ps(y, _mm512_mul_ps(zv, _mm512_loadu_ps(row_sum + j))));
    if (bias != nullptr) y = _mm512_add_ps(y, b);
    _mm512_storeu_ps(out + j, y);
  }
  if (j < m) correct_row_unfused_plain(out + j, m - j, s, z, row_sum + j, bias != nullptr ? bias + j : nullptr);
}
#endif

inline bool has_avx512() {
#if defined(TSERVE_AVX512)
  static const bool yes = __builtin_cpu_supports("avx512f");
  return yes;
#else
  return false;
#endif
}

void row_range(const float* row, int64_t n, float& lo, float& hi) {
#if defined(TSERVE_AVX512)
  if (has_avx512()) return row_range_avx512(row, n, lo, hi);
#endif
  row_range_plain(row, n, lo, hi);
}
void to_grid(const float* row, int64_t n, float s, float z, float* u) {
#if defined(TSERVE_AVX512)
  if (has_avx512()) return to_grid_avx512(row, n, s, z, u);
#endif
  to_grid_plain(row, n, s, z, u);
}
void correct_row_unfused(float* out, int64_t m, float s, float z, const float* row_sum, const float* bias) {
#if defined(TSERVE_AVX512)
  if (has_avx512()) return correct_row_unfused_avx512(out, m, s, z, row_sum, bias);
#endif
  correct_row_unfused_plain(out, m, s, z, row_sum, bias);
}

struct Projection {
  c10::intrusive_ptr<LinearPackedParamsBase> packed;
  // The same weights as two packs of output features [0, split) and [split, N), for a step
  // shared with the partner thread (set when the decoder has one and the projection is wide
  // enough to split; `partner` is set whenever the decoder has one).
  c10::intrusive_ptr<LinearPackedParamsBase> first, second;
  int64_t split = 0;
  Partner* partner = nullptr;
  Tensor weight, bias;  // the float path
  Tensor q4;  // the 4-bit path: uint8, (N / 16) * (K / 32) runs of Q4_RUN_BYTES
  int64_t q4_n = 0, q4_k = 0;
  std::vector<float> q4_bias;  // empty: none
  std::vector<float> unsmooth;  // 1 / inv_scale: the 4-bit weights take the int8 ones' smoothed input back
  Partner* q4_partner = nullptr;  // shares the 4-bit tiles (the int8 halves have their own `partner`)
  std::vector<float> inv_scale;  // SmoothQuant's 1 / s per input channel; empty: none
  std::vector<float> row_sum, int8_bias;  // int8: W 1 (dequantized weights summed over inputs), b (or empty)
  int64_t int8_in = 0;  // int8: input features

  // `prompt`: rows of prompts, which take the int8 weights where the projection has both: at tens
  // to thousands of rows fbgemm's int8 GEMM is 2-3x faster than the 4-bit kernel, whose float
  // scale per run of 32 costs arithmetic that only a step of a few rows, waiting for its bytes,
  // hides. Decode steps take the 4-bit weights whatever their rows, so a row's logits never
  // depend on the batch.
  Tensor operator()(const Tensor& x, bool prompt = false) const {
    if (q4.defined() && !(prompt && packed)) return q4_rows(x.contiguous());
    if (packed) return int8_rows(x.contiguous());
    return at::linear(x, weight, bias.defined() ? c10::optional<Tensor>(bias) : c10::nullopt);
  }

  // Each row's activations quantized to 7 bits over the row's own range, as
  // model.quant.int8.rowwise_int8_linear does (its docstring has the algebra): a row's result
  // never depends on the rows beside it. fbgemm takes one activation scale per call, so each
  // row goes onto the shared grid u = x / s + z in [0, 127] and is corrected back afterwards.
  // `unfused`: the correction rounds each product on its own, as rowwise_int8_linear's tensor
  // operations do (Int8Linear: the Python step's projections, which must give its bits).
  Tensor int8_rows(const Tensor& x, bool unfused = false) const {
    const int64_t B = x.size(0), n = x.size(1);
    Tensor u = at::empty_like(x);
    std::vector<float> scale(B), zero(B);
    const float* xp = x.data_ptr<float>();
    float* up = u.data_ptr<float>();
    // rows in pieces (an encoder's or a prompt's hundreds of rows shared between the threads; a
    // decode step's few rows in one piece)
    over_rows(partner, B, n, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const float* row = xp + b * n;
        float lo, hi;
        row_range(row, n, lo, hi);
        float s = (hi - lo) / 127.0f;
        if (!(s > 0.0f)) s = 1.0f;
        const float z = std::nearbyint(-lo / s);
        scale[b] = s;
        zero[b] = z;
        to_grid(row, n, s, z, up + b * n);
      }
    });
    // Shared with the partner (torch on one thread): a step of a few rows as the two packs'
    // output halves; a prompt's rows in pieces through the whole pack (each piece quantized once,
    // where the halves would each quantize every row). fbgemm sums each output in int32 and
    // rescales it on its own, so the bits do not depend on the split. The pieces are copied into
    // one output by the correction pass below.
    std::vector<Tensor> parts;
    int64_t piece_rows = 0;  // > 0: parts are row pieces of this many rows; 0: output halves
    Tensor y;
    if (partner != nullptr && at::get_num_threads() == 1 && (B >= kRowSplit || first)) {
      if (B >= kRowSplit) {
        const int64_t pieces = std::min<int64_t>(4, B / (kRowSplit / 2));
        piece_rows = (B + pieces - 1) / pieces;
        parts.resize((B + piece_rows - 1) / piece_rows);
        partner->run(static_cast<int64_t>(parts.size()), [&](int64_t c) {
          const int64_t r0 = c * piece_rows;
          parts[c] = packed->apply_with_input_q_dq_qweight_dq_output_fp32(
              u.narrow(0, r0, std::min(B, r0 + piece_rows) - r0), 1.0, 0);
        });
      } else {
        parts.resize(2);
        partner->run(2, [&](int64_t c) {
          parts[c] = (c == 0 ? first : second)->apply_with_input_q_dq_qweight_dq_output_fp32(u, 1.0, 0);
        });
      }
      y = at::empty({B, static_cast<int64_t>(row_sum.size())}, x.options());  // every output feature
    } else {
      y = packed->apply_with_input_q_dq_qweight_dq_output_fp32(u, 1.0, 0);
    }
    const int64_t m = y.size(1);
    float* yp = y.data_ptr<float>();
    const bool has_bias = !int8_bias.empty();
    // Rows in pieces: a prompt's or a vocabulary-wide head's correction is shared between the
    // threads, a decode step's layer stays in one piece (each output's arithmetic is the same
    // whichever thread does it).
    over_rows(partner, B, m, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        float* out = yp + b * m;
        if (piece_rows > 0) {
          const Tensor& part = parts[b / piece_rows];
          std::copy_n(part.data_ptr<float>() + (b % piece_rows) * m, m, out);
        } else if (!parts.empty()) {
          const int64_t m0 = parts[0].size(1);
          std::copy_n(parts[0].data_ptr<float>() + b * m0, m0, out);
          std::copy_n(parts[1].data_ptr<float>() + b * (m - m0), m - m0, out + m0);
        }
        const float* bias = has_bias ? int8_bias.data() : nullptr;
        if (unfused)
          correct_row_unfused(out, m, scale[b], zero[b], row_sum.data(), bias);
        else
          for (int64_t j = 0; j < m; ++j) {
            const float bj = has_bias ? bias[j] : 0.0f;
            out[j] = scale[b] * ((out[j] - bj) - zero[b] * row_sum[j]) + bj;
          }
      }
    });
    return y;
  }
  float scale(int64_t j) const { return inv_scale.empty() ? 1.0f : inv_scale[j]; }

  // x (B, K) -> (B, N) through the 4-bit runs, the output tiles shared between the threads (with
  // a partner: the first half here, the second there).
  Tensor q4_rows(const Tensor& x, bool portable = false) const {
    TORCH_CHECK(x.size(1) == q4_k, "a 4-bit projection of ", q4_k, " inputs got ", x.size(1));
    const int64_t B = x.size(0), tiles = q4_n / Q4_TILE;
    Q8Rows a;
    std::vector<float> plain;
    if (unsmooth.empty()) {
      a.quantize(x.data_ptr<float>(), B, q4_k);
    } else {
      plain.resize(B * q4_k);
      const float* xp = x.data_ptr<float>();
      for (int64_t b = 0; b < B; ++b)
        for (int64_t k = 0; k < q4_k; ++k) plain[b * q4_k + k] = xp[b * q4_k + k] * unsmooth[k];
      a.quantize(plain.data(), B, q4_k);
    }
    Tensor y = at::empty({B, q4_n}, x.options());
    const uint8_t* w = q4.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    if (portable) {
      q4_tiles_scalar(w, a, B, q4_k, q4_n, 0, tiles, yp);
    } else if (q4_partner != nullptr && at::get_num_threads() == 1) {
      // chunks of Q4_CHUNK tiles (an even count: the vector loop takes tiles two at a time)
      const int64_t chunks = (tiles + Q4_CHUNK - 1) / Q4_CHUNK;
      q4_partner->run(chunks, [&](int64_t c) {
        q4_tiles(w, a, B, q4_k, q4_n, c * Q4_CHUNK, std::min(tiles, (c + 1) * Q4_CHUNK), yp);
      });
    } else {
      at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) { q4_tiles(w, a, B, q4_k, q4_n, t0, t1, yp); });
    }
    if (!q4_bias.empty())
      for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < q4_n; ++j) yp[b * q4_n + j] += q4_bias[j];
    return y;
  }
};

struct Layer {
  std::vector<float> attn_norm, ffn_norm;
  Projection qkv, o, gate, up, down;
  bool up_has_own_input = false;  // up's smoothing scale differs from gate's: its input is its own
  std::vector<float> q_norm, k_norm;  // (hs,) each, or empty: RMSNorm over each head of q / k before RoPE
  std::vector<float> post_attn_norm, post_ffn_norm;  // (d,) each, or empty: a norm on each sublayer's output
  int64_t window = 0;  // > 0: attend to the last `window` positions only
  bool local_rope = false;  // read the second rotary table
};

enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

// out[j] = x[j] / rms(x) * w[j] * inv[j] for one row of width d (RMSNorm, then a smoothing scale).
void rms_row(const float* x, const float* w, const Projection& next, float eps, int64_t d, float* out) {
  double sum = 0.0;
  for (int64_t j = 0; j < d; ++j) sum += static_cast<double>(x[j]) * x[j];
  const float r = 1.0f / std::sqrt(static_cast<float>(sum / d) + eps);
  for (int64_t j = 0; j < d; ++j) out[j] = x[j] * r * w[j] * next.scale(j);
}

// RMSNorm of each of `heads` rows of width hs, in place.
void rms_heads(float* x, const float* w, float eps, int64_t heads, int64_t hs) {
  for (int64_t h = 0; h < heads; ++h, x += hs) {
    double sum = 0.0;
    for (int64_t j = 0; j < hs; ++j) sum += static_cast<double>(x[j]) * x[j];
    const float r = 1.0f / std::sqrt(static_cast<float>(sum / hs) + eps);
    for (int64_t j = 0; j < hs; ++j) x[j] = x[j] * r * w[j];
  }
}

// Rotate each (x_i, x_{i+hs/2}) pair of `heads` heads by the angles of one position.
void rope_row(float* x, const float* cos, const float* sin, int64_t heads, int64_t hs) {
  const int64_t half = hs / 2;
  for (int64_t h = 0; h < heads; ++h, x += hs) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      x[i] = a * cos[i] - b * sin[i];
      x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

// Dot product written as 16 independent lanes, so the compiler vectorises it without
// reassociating a single sum (no -ffast-math needed).
inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += a[i + j] * b[i + j];
  float s = 0.0f;
  for (; i < n; ++i) s += a[i] * b[i];
  for (int j = 0; j < 16; ++j) s += lanes[j];
  return s;
}

// e^x for the activations, branch-free so that the compiler vectorizes a row's loop: x = n ln2 + r
// (Cody-Waite, two parts of ln2), e^r by its degree-6 Taylor polynomial on |r| <= ln2 / 2
// (relative error under 2e-7), times 2^n put into the exponent bits. glibc's scalar expf and
// tanhf were a third of Gemma 3's prompt time (its tanh GELU over 2,048 features a row). The
// result depends on x alone, never on where x sits in a row or batch.
inline float fast_exp(float x) {
  x = std::min(88.0f, std::max(-87.0f, x));
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// The KV cache holds float32 or bfloat16 (as uint16_t bits). bfloat16 is the top half of a
// float32, rounded to nearest even as torch's own conversion rounds, so a row written here
// equals the row the Python path writes.
inline float to_float(float x) { return x; }
inline float to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline void store(float x, float* dst) { *dst = x; }
inline void store(float x, uint16_t* dst) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a (quiet) NaN
    *dst = 0x7fc0;
    return;
  }
  *dst = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// One cache row as float32: the row itself, or its conversion into `scratch`.
inline const float* row_as_float(const float* row, float*, int64_t) { return row; }
inline const float* row_as_float(const uint16_t* row, float* scratch, int64_t n) {
  for (int64_t i = 0; i < n; ++i) scratch[i] = to_float(row[i]);
  return scratch;
}

// The cached rows of one (sequence, K/V head): position first + t lies in the block its table
// names, at its offset there; rows within a block are contiguous.
template <typename T>
struct PagedRows {
  const T* base;  // this layer's pool, K or V
  const int64_t* table;  // the sequence's block table
  int64_t shift, block_stride, head_offset, hs, first;  // block_len = 1 << shift (a shift, not a division, per key)
  const T* row(int64_t t) const {
    const int64_t p = first + t;
    return base + table[p >> shift] * block_stride + head_offset + (p & ((int64_t{1} << shift) - 1)) * hs;
  }
};

// log2 of a block length (a power of two): PagedRows' shift.
inline int64_t shift_of(int64_t block_len) {
  int64_t shift = 0;
  while ((int64_t{1} << shift) < block_len) ++shift;
  return shift;
}

// fn(k, v) with a K/V pair's base pointers: float32, or bfloat16 as its bits (uint16_t).
template <typename F>
void with_kv_bits(const Tensor& k, const Tensor& v, const F& fn) {
  if (k.scalar_type() == at::kBFloat16)
    fn(reinterpret_cast<uint16_t*>(k.data_ptr<at::BFloat16>()), reinterpret_cast<uint16_t*>(v.data_ptr<at::BFloat16>()));
  else
    fn(k.data_ptr<float>(), v.data_ptr<float>());
}

// Attention of one (row, K/V head) item: `group` query heads q (group, hs) over n cached
// positions -> out (group, hs) = softmax(q k^T * scale) v. Scratch from the caller (no
// allocation per item): `scores` group * n floats, `total` group floats.
template <typename T>
void attend_one(const float* q, const PagedRows<T>& keys, const PagedRows<T>& values, int64_t n, int64_t group,
                int64_t hs, float scale, float* scores, float* total, float* out) {
  for (int64_t t = 0; t < n; ++t) {
    float scratch[512];  // head sizes up to 512 (checked at construction)
    const float* k = row_as_float(keys.row(t), scratch, hs);
    for (int64_t h = 0; h < group; ++h) scores[h * n + t] = dot(q + h * hs, k, hs) * scale;
  }
  for (int64_t h = 0; h < group; ++h) {
    float* row = scores + h * n;
    const float top = *std::max_element(row, row + n);
    total[h] = 0.0f;
    for (int64_t t = 0; t < n; ++t) total[h] += (row[t] = std::exp(row[t] - top));
  }
  std::fill(out, out + group * hs, 0.0f);
  for (int64_t t = 0; t < n; ++t) {
    float scratch[512];
    const float* v = row_as_float(values.row(t), scratch, hs);
    for (int64_t h = 0; h < group; ++h) {
      const float p = scores[h * n + t];
      float* a = out + h * hs;
      for (int64_t i = 0; i < hs; ++i) a[i] += p * v[i];
    }
  }
  for (int64_t h = 0; h < group; ++h)
    for (int64_t i = 0; i < hs; ++i) out[h * hs + i] /= total[h];
}

#if defined(TSERVE_AVX512)
// The same with 16-float vectors, for head sizes that are a multiple of 16 (C = hs / 16
// vectors per row): each K/V row is loaded (and widened from bfloat16) once for the whole
// group, and the softmax's exponentials are vectorised too.
TSERVE_TARGET_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
TSERVE_TARGET_AVX512 inline __m512 load16(const uint16_t* p) {  // bfloat16 bits -> the top half of float32
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// exp(x) for x <= 0: 2^k e^r with k = round(x / ln 2), |r| <= ln(2) / 2, e^r by its Taylor
// series to r^6 (relative error ~1.2e-7), 2^k applied exactly by scalef.
TSERVE_TARGET_AVX512 inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);  // ln 2 in two parts
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.42860682030941723e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}

template <int C, typename T>
TSERVE_TARGET_AVX512 void attend_one_avx512(const float* q, const PagedRows<T>& keys, const PagedRows<T>& values, int64_t n,
                                            int64_t group, float scale, float* scores, float* total, float* out) {
  constexpr int64_t hs = 16 * C;
  for (int64_t t = 0; t < n; ++t) {
    __m512 k[C];
    const T* key = keys.row(t);
    for (int c = 0; c < C; ++c) k[c] = load16(key + 16 * c);
    for (int64_t h = 0; h < group; ++h) {
      __m512 s = _mm512_mul_ps(_mm512_loadu_ps(q + h * hs), k[0]);
      for (int c = 1; c < C; ++c) s = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * hs + 16 * c), k[c], s);
      scores[h * n + t] = _mm512_reduce_add_ps(s) * scale;
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    float* row = scores + h * n;
    __m512 top16 = _mm512_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 16 <= n; t += 16) top16 = _mm512_max_ps(top16, _mm512_loadu_ps(row + t));
    float top = _mm512_reduce_max_ps(top16);
    for (; t < n; ++t) top = std::max(top, row[t]);
    __m512 sum16 = _mm512_setzero_ps();
    for (t = 0; t + 16 <= n; t += 16) {
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + t), _mm512_set1_ps(top)));
      _mm512_storeu_ps(row + t, e);
      sum16 = _mm512_add_ps(sum16, e);
    }
    if (t < n) {  // the tail, masked
      const __mmask16 m = static_cast<__mmask16>((1u << (n - t)) - 1u);
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + t), _mm512_set1_ps(top)));
      _mm512_mask_storeu_ps(row + t, m, e);
      sum16 = _mm512_add_ps(sum16, _mm512_maskz_mov_ps(m, e));
    }
    total[h] = _mm512_reduce_add_ps(sum16);
  }
  for (int64_t h = 0; h < group; ++h) {
    __m512 acc[C];
    for (int c = 0; c < C; ++c) acc[c] = _mm512_setzero_ps();
    const float* p = scores + h * n;
    for (int64_t t = 0; t < n; ++t) {
      const __m512 w = _mm512_set1_ps(p[t]);
      const T* value = values.row(t);
      for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(w, load16(value + 16 * c), acc[c]);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / total[h]);
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + h * hs + 16 * c, _mm512_mul_ps(acc[c], inv));
  }
}
#endif

#if defined(TSERVE_AVX512)
#define TSERVE_TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

inline bool has_avx512_bf16() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512bf16");
  return yes;
}

// Prompt rows attending as a block over a bfloat16 cache with the CPU's bfloat16 dot products
// (AVX512-BF16's vdpbf16ps: 32 products a vector into 16 float32 sums, twice float32 FMA's rate),
// flash style: keys in tiles of 64, an online softmax per query row, nothing the size of
// rows x keys in memory. What is rounded to bfloat16: q (times the softmax scale) and each
// tile's probabilities before they weight V; K and V already are. Scores, the softmax and the
// sums stay float32. So it is close to, not bit for bit, the float32 path (torch's flash
// attention over the keys widened to float32), which it replaces where the CPU has the
// instructions.
//
// The unit: `n` rows of one sequence at positions p0 .. p0 + n - 1 (row i: its `group` query
// heads at q(i, h) = qkv + i * row_w + h * HS), one K/V head (keys/values, PagedRows with
// first = 0: row(p) is position p). Row i sees key positions [lo_i, p0 + i], lo_i = 0 or, with a
// window, p0 + i - window + 1. Out: y + i * y_w + h * HS, times out_scale (HS per head) where
// given. Scratch is the calling thread's own.
template <int HS>
TSERVE_TARGET_BF16 void attend_block_bf16(const float* qkv, int64_t row_w, int64_t group, const PagedRows<uint16_t>& keys,
                                          const PagedRows<uint16_t>& values, int64_t p0, int64_t n, int64_t window,
                                          float scale, float* y, int64_t y_w, const float* out_scale) {
  constexpr int64_t PAIRS = HS / 2, TILE = 64, TV = TILE / 16, RB = 4, OV = HS / 16;  // TV, OV: float vectors per tile, per output row
  static_assert(HS % 64 == 0, "head sizes of 64, 128, 256");
  const int64_t lo_all = window > 0 ? std::max<int64_t>(0, p0 - window + 1) : 0, end = p0 + n;
  const int64_t tiles = (end - lo_all + TILE - 1) / TILE;
  // K as VNNI pairs: tile t, pair d2 -> TILE keys' (k[2 d2], k[2 d2 + 1]) words; V as key pairs:
  // tile t, pair j -> HS words (v_{2j}[d], v_{2j+1}[d]). Keys past the end are zero.
  thread_local std::vector<uint32_t> kp, vp, qb;
  kp.assign(tiles * PAIRS * TILE, 0u);
  vp.assign(tiles * (TILE / 2) * HS, 0u);
  for (int64_t p = lo_all; p < end; ++p) {
    const int64_t t = (p - lo_all) / TILE, c = (p - lo_all) % TILE;
    const uint32_t* kr = reinterpret_cast<const uint32_t*>(keys.row(p));
    uint32_t* kd = kp.data() + t * PAIRS * TILE + c;
    for (int64_t d2 = 0; d2 < PAIRS; ++d2) kd[d2 * TILE] = kr[d2];
    const uint16_t* vr = values.row(p);
    uint16_t* vd = reinterpret_cast<uint16_t*>(vp.data() + (t * (TILE / 2) + c / 2) * HS) + (c & 1);
    for (int64_t d = 0; d < HS; ++d) vd[2 * d] = vr[d];
  }
  // q rows (i, h) in order r = i * group + h, times the scale, as bfloat16 pairs
  const int64_t R = n * group;
  qb.resize(R * PAIRS);
  for (int64_t r = 0; r < R; ++r) {
    const float* q = qkv + (r / group) * row_w + (r % group) * HS;
    for (int64_t c = 0; c < HS; c += 32) {
      const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q + c), _mm512_set1_ps(scale));
      const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(q + c + 16), _mm512_set1_ps(scale));
      _mm512_storeu_si512(qb.data() + r * PAIRS + c / 2, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // Each row's running max, denominator (16 partial sums, added up at the end) and output: kept
  // across chunks of keys, so every row block walks one chunk (K and V of 512 keys, 128 kB at
  // head size 64) while it is in this core's cache, not the whole span (768 kB at 3,000 keys).
  thread_local std::vector<float> st_m, st_l, st_o;
  st_m.assign(R, -std::numeric_limits<float>::infinity());
  st_l.assign(R * 16, 0.0f);
  st_o.assign(R * HS, 0.0f);
  constexpr int64_t CHUNK_TILES = 512 / TILE;
  for (int64_t t_begin = 0; t_begin < tiles; t_begin += CHUNK_TILES) {
    const int64_t t_end = std::min(tiles, t_begin + CHUNK_TILES);
    for (int64_t r0 = 0; r0 < R; r0 += RB) {
      const int64_t rb = std::min<int64_t>(RB, R - r0);
      int64_t lo[RB], hi[RB];
      float* m = st_m.data() + r0;
      float(*l)[16] = reinterpret_cast<float(*)[16]>(st_l.data() + r0 * 16);
      float(*o)[HS] = reinterpret_cast<float(*)[HS]>(st_o.data() + r0 * HS);
      alignas(64) uint32_t pp[RB][TILE / 2];
      int64_t first_key = end, last_key = 0;
      const uint32_t* qrow[RB];  // a short last block repeats its last row
      for (int64_t r = 0; r < RB; ++r) {
        qrow[r] = qb.data() + (r0 + std::min(r, rb - 1)) * PAIRS;
        const int64_t i = (r0 + std::min(r, rb - 1)) / group;
        hi[r] = p0 + i;
        lo[r] = window > 0 ? std::max<int64_t>(0, p0 + i - window + 1) : 0;
        first_key = std::min(first_key, lo[r]);
        last_key = std::max(last_key, hi[r]);
      }
      const int64_t t0 = std::max(t_begin, (first_key - lo_all) / TILE);
      const int64_t t1 = std::min(t_end - 1, (last_key - lo_all) / TILE);
      for (int64_t t = t0; t <= t1; ++t) {
        const int64_t key0 = lo_all + t * TILE;
        const uint32_t* kt = kp.data() + t * PAIRS * TILE;
        __m512 s[RB][TV];  // unrolled: the sixteen sums stay in registers
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
          for (int v = 0; v < TV; ++v) s[r][v] = _mm512_setzero_ps();
        for (int64_t d2 = 0; d2 < PAIRS; ++d2) {
          __m512bh k[TV];
#pragma GCC unroll 4
          for (int v = 0; v < TV; ++v) k[v] = (__m512bh)_mm512_loadu_si512(kt + d2 * TILE + 16 * v);
#pragma GCC unroll 4
          for (int r = 0; r < RB; ++r) {
            const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(qrow[r][d2]));
#pragma GCC unroll 4
            for (int v = 0; v < TV; ++v) s[r][v] = _mm512_dpbf16_ps(s[r][v], qv, k[v]);
          }
        }
        alignas(64) float sc[RB][TILE];  // the softmax below indexes rows at run time: from memory
#pragma GCC unroll 4
        for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
          for (int v = 0; v < TV; ++v) _mm512_store_ps(sc[r] + 16 * v, s[r][v]);
        for (int64_t r = 0; r < rb; ++r) {
          // keys of this tile the row sees: lo <= key0 + c <= hi
          const __m512i vlo = _mm512_set1_epi32(static_cast<int>(lo[r])), vhi = _mm512_set1_epi32(static_cast<int>(hi[r]));
          __mmask16 in[TV];
          __mmask16 any = 0;
          for (int v = 0; v < TV; ++v) {
            const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(key0 + 16 * v)), iota);
            in[v] = _mm512_cmpge_epi32_mask(pos, vlo) & _mm512_cmple_epi32_mask(pos, vhi);
            any |= in[v];
          }
          if (any == 0) {
            std::fill(pp[r], pp[r] + TILE / 2, 0u);
            continue;
          }
          __m512 a[TV];
          __m512 top_v = neg_inf;
          for (int v = 0; v < TV; ++v) {
            a[v] = _mm512_mask_mov_ps(neg_inf, in[v], _mm512_load_ps(sc[r] + 16 * v));
            top_v = _mm512_max_ps(top_v, a[v]);
          }
          const float m_new = std::max(m[r], _mm512_reduce_max_ps(top_v));
          const float alpha = m_new == m[r] ? 1.0f : std::exp(m[r] - m_new);  // 0 on the row's first tile (m = -inf)
          const __m512 shift = _mm512_set1_ps(m_new);
          __m512 sum = _mm512_setzero_ps();
          for (int v = 0; v < TV; ++v) {
            a[v] = _mm512_maskz_mov_ps(in[v], exp_nonpositive(_mm512_sub_ps(a[v], shift)));
            sum = _mm512_add_ps(sum, a[v]);
          }
          _mm512_storeu_ps(l[r], _mm512_fmadd_ps(_mm512_loadu_ps(l[r]), _mm512_set1_ps(alpha), sum));
          m[r] = m_new;
          if (alpha != 1.0f)
            for (int64_t c = 0; c < OV; ++c)
              _mm512_storeu_ps(o[r] + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(o[r] + 16 * c), _mm512_set1_ps(alpha)));
          for (int v = 0; v < TV; v += 2)  // 32 probabilities as 16 bfloat16 pairs: keys 16 v .. 16 v + 31
            _mm512_store_si512(pp[r] + 8 * v, (__m512i)_mm512_cvtne2ps_pbh(a[v + 1], a[v]));
        }
        const uint32_t* vt = vp.data() + t * (TILE / 2) * HS;
        for (int64_t r = 0; r < rb; r += 2) {  // two rows at a time share each V load
          const bool two = r + 1 < rb;
          for (int64_t cg = 0; cg < HS; cg += 64) {  // 64 outputs at a time: 8 sums in registers
            __m512 acc0[4], acc1[4];
            for (int64_t c = 0; c < 4; ++c) {
              acc0[c] = _mm512_loadu_ps(o[r] + cg + 16 * c);
              acc1[c] = two ? _mm512_loadu_ps(o[r + 1] + cg + 16 * c) : _mm512_setzero_ps();
            }
            for (int64_t j = 0; j < TILE / 2; ++j) {
              const __m512bh p0v = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r][j]));
              const __m512bh p1v = (__m512bh)_mm512_set1_epi32(static_cast<int>(two ? pp[r + 1][j] : 0u));
              for (int64_t c = 0; c < 4; ++c) {
                const __m512bh v = (__m512bh)_mm512_loadu_si512(vt + j * HS + cg + 16 * c);
                acc0[c] = _mm512_dpbf16_ps(acc0[c], p0v, v);
                acc1[c] = _mm512_dpbf16_ps(acc1[c], p1v, v);
              }
            }
            for (int64_t c = 0; c < 4; ++c) {
              _mm512_storeu_ps(o[r] + cg + 16 * c, acc0[c]);
              if (two) _mm512_storeu_ps(o[r + 1] + cg + 16 * c, acc1[c]);
            }
          }
        }
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = r / group, h = r % group;
    float* dst = y + i * y_w + h * HS;
    const float* o = st_o.data() + r * HS;
    const float inv = 1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(st_l.data() + r * 16));
    for (int64_t d = 0; d < HS; ++d) dst[d] = o[d] * inv * (out_scale ? out_scale[h * HS + d] : 1.0f);
  }
}
#endif

template <typename T>
void attend_item(const float* q, const PagedRows<T>& keys, const PagedRows<T>& values, int64_t n, int64_t group,
                 int64_t hs, float scale,
                 float* scores, float* total, float* out) {
#if defined(TSERVE_AVX512)
  const bool avx512 = has_avx512();
  if (avx512 && hs == 64) return attend_one_avx512<4>(q, keys, values, n, group, scale, scores, total, out);
  if (avx512 && hs == 128) return attend_one_avx512<8>(q, keys, values, n, group, scale, scores, total, out);
  if (avx512 && hs == 256) return attend_one_avx512<16>(q, keys, values, n, group, scale, scores, total, out);  // Gemma 3
#endif
  attend_one(q, keys, values, n, group, hs, scale, scores, total, out);
}

class LlamaDecoder : public torch::CustomClassHolder {
 public:
  LlamaDecoder(int64_t n_heads, int64_t n_kv, int64_t head_dim, double eps, double scale)
      : nh_(n_heads), nkv_(n_kv), hs_(head_dim), eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)) {
    TORCH_CHECK(n_heads > 0 && n_kv > 0 && n_heads % n_kv == 0, "n_heads must be a multiple of n_kv");
    TORCH_CHECK(head_dim % 2 == 0 && head_dim <= 512, "head_dim must be even (rotary pairs) and at most 512");
  }

  // Model-level tensors: token embeddings (V, d), the final norm (d,), the rotary table (2, P, hs).
  // The embeddings may be bfloat16 (a served model's, halved: only a row per token is read).
  void set_model(Tensor embed, Tensor final_norm, Tensor rope) {
    TORCH_CHECK(embed.device().is_cpu() && (embed.scalar_type() == at::kFloat || embed.scalar_type() == at::kBFloat16),
                "embed must be a float32 or bfloat16 CPU tensor");
    embed_ = embed.detach().contiguous();
    d_ = embed_.size(1);
    final_norm_ = to_vector(final_norm, d_, "final_norm");
    rope_ = float_contiguous(rope, "rope");
    TORCH_CHECK(rope_.dim() == 3 && rope_.size(0) == 2 && rope_.size(2) == hs_, "rope must be (2, P, head_dim)");
  }

  // What the whole model does beyond a Llama: token embeddings times `embed_scale`, the gate's
  // activation (Activation), and a second rotary table (2, P, hs) for layers that ask for it.
  void set_features(double embed_scale, int64_t activation, c10::optional<Tensor> rope_local) {
    TORCH_CHECK(activation == kSilu || activation == kGeluTanh, "activation must be 0 (SiLU) or 1 (tanh GELU)");
    embed_scale_ = static_cast<float>(embed_scale);
    activation_ = activation;
    if (rope_local) {
      rope_local_ = float_contiguous(*rope_local, "rope_local");
      TORCH_CHECK(rope_local_.sizes() == rope_.sizes(), "rope_local must have the shape of rope");
    }
  }

  // The last added layer's features beyond a Llama (each optional; window 0: none).
  void set_layer_features(c10::optional<Tensor> q_norm, c10::optional<Tensor> k_norm,
                          c10::optional<Tensor> post_attn_norm, c10::optional<Tensor> post_ffn_norm, int64_t window,
                          bool local_rope) {
    TORCH_CHECK(!layers_.empty() && !has_head_, "set_layer_features follows its add_layer");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q and k norms come together");
    TORCH_CHECK(post_attn_norm.has_value() == post_ffn_norm.has_value(), "the two post-norms come together");
    TORCH_CHECK(window >= 0, "window must be >= 0");
    TORCH_CHECK(!local_rope || rope_local_.defined(), "a layer reads the local rotary table but none was set");
    Layer& L = layers_.back();
    if (q_norm) {
      L.q_norm = to_vector(*q_norm, hs_, "q_norm");
      L.k_norm = to_vector(*k_norm, hs_, "k_norm");
    }
    if (post_attn_norm) {
      L.post_attn_norm = to_vector(*post_attn_norm, d_, "post_attn_norm");
      L.post_ffn_norm = to_vector(*post_ffn_norm, d_, "post_ffn_norm");
    }
    L.window = window;
    L.local_rope = local_rope;
  }

  void add_layer(Tensor attn_norm, Tensor ffn_norm) {
    TORCH_CHECK(layers_.empty() || next_ == 5, "a layer needs its five projections before the next");
    TORCH_CHECK(!has_head_, "layers come before the output head");
    next_ = 0;
    layers_.emplace_back();
    layers_.back().attn_norm = to_vector(attn_norm, d_, "attn_norm");
    layers_.back().ffn_norm = to_vector(ffn_norm, d_, "ffn_norm");
  }

  // Projections in the order qkv, o, gate, up, down of each layer, then the head once.
  void add_int8(c10::IValue packed, c10::optional<Tensor> inv_scale) {
    Projection p = int8_projection(packed);
    if (partner_) {
      auto unpacked = p.packed->unpack();
      split_for_partner(p, std::get<0>(unpacked), std::get<1>(unpacked));
    }
    finish(std::move(p), inv_scale);
  }

  // An int8 projection of fbgemm's packed weights, given as their script object
  // (torch.classes.quantized.LinearPackedParamsBase): the pack, W 1 and the bias.
  static Projection int8_projection(const c10::IValue& packed) {
    TORCH_CHECK(packed.isObject(), "packed must be fbgemm's packed linear parameters");
    Projection p;
    // A script object holds its C++ instance in its first slot (a capsule).
    auto holder = packed.toObjectRef().getSlot(0).toCapsule();
    p.packed = c10::static_intrusive_pointer_cast<LinearPackedParamsBase>(holder);
    auto unpacked = p.packed->unpack();
    Tensor row_sum = std::get<0>(unpacked).dequantize().to(at::kFloat).sum(1);
    p.row_sum = to_vector(row_sum, row_sum.numel(), "row_sum");
    if (std::get<1>(unpacked)) p.int8_bias = to_vector(*std::get<1>(unpacked), row_sum.numel(), "bias");
    p.int8_in = std::get<0>(unpacked).size(1);
    return p;
  }

  // 4-bit weights for the projection added last, an int8 one: decode steps read these, prompts the
  // int8 ones. `runs` (uint8) as model/quant/q4.py packs them for n outputs (a multiple of 16) of
  // k inputs (a multiple of 32), an optional bias (n,). With a partner, the tiles are split
  // between the two threads as they lie (no second copy).
  void attach_q4(Tensor runs, int64_t n, int64_t k, c10::optional<Tensor> bias) {
    TORCH_CHECK(has_head_ || (!layers_.empty() && next_ > 0), "attach_q4 follows the projection it is for");
    Projection& p = has_head_ ? head_ : *slots(layers_.back())[next_ - 1];
    TORCH_CHECK(p.packed && !p.q4.defined(), "4-bit weights attach once, to an int8 projection");
    TORCH_CHECK(static_cast<int64_t>(p.row_sum.size()) == n, "the 4-bit weights have ", n, " outputs, the int8 ones ",
                p.row_sum.size());
    Projection q = make_q4(runs, n, k, bias);
    p.q4 = q.q4;
    p.q4_n = n;
    p.q4_k = k;
    p.q4_bias = std::move(q.q4_bias);
    p.q4_partner = partner_.get();
    // The int8 weights are smoothed: their input arrives multiplied by inv_scale. The 4-bit ones
    // are the model's own, so their input is divided back.
    p.unsmooth.clear();
    for (float v : p.inv_scale) p.unsmooth.push_back(1.0f / v);
  }

  // A 4-bit projection (no int8 weights, no partner): attach_q4's and q4_linear's checks.
  static Projection make_q4(const Tensor& runs, int64_t n, int64_t k, const c10::optional<Tensor>& bias) {
    TORCH_CHECK(n > 0 && k > 0 && n % Q4_TILE == 0 && k % Q4_RUN == 0, "a 4-bit projection needs outputs in "
                "multiples of 16 and inputs in multiples of 32, got ", n, " x ", k);
    TORCH_CHECK(runs.device().is_cpu() && runs.scalar_type() == at::kByte && runs.is_contiguous() &&
                    runs.numel() == (n / Q4_TILE) * (k / Q4_RUN) * Q4_RUN_BYTES,
                "runs must be a contiguous uint8 CPU tensor of (n / 16) * (k / 32) * 320 bytes");
    Projection p;
    p.q4 = runs;
    p.q4_n = n;
    p.q4_k = k;
    if (bias) p.q4_bias = to_vector(*bias, n, "bias");
    return p;
  }

  // Steps of a few rows share each int8 projection with a second thread (see Partner). Call
  // before the projections are added.
  void use_partner(bool on) {
    TORCH_CHECK(layers_.empty() && !has_head_, "use_partner comes before the layers");
    if (on && !partner_) partner_ = std::make_unique<Partner>();
    if (!on) partner_.reset();
  }

  void add_float(Tensor weight, c10::optional<Tensor> bias, c10::optional<Tensor> inv_scale) {
    Projection p;
    p.weight = float_contiguous(weight, "weight");
    if (bias) p.bias = float_contiguous(*bias, "bias");
    finish(std::move(p), inv_scale);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Prompts: a run of at least `min_rows` rows of one sequence is attended as a block (on layers
  // with a window, one wider than a block; see attend); 0 = always row by row, as decode steps are.
  void set_prompt_attention(int64_t min_rows) {
    TORCH_CHECK(min_rows >= 0, "min_rows must be >= 0");
    prompt_attention_rows_ = min_rows;
  }

  // Whether blocks over a bfloat16 cache use the CPU's bfloat16 dot products (attend_block_bf16;
  // the default, where the CPU has AVX512-BF16) or torch's flash attention over the keys widened
  // to float32. Returns whether the bfloat16 kernel can run here at all.
  bool set_prompt_bf16(bool on) {
    prompt_bf16_ = on;
#if defined(TSERVE_AVX512)
    return has_avx512_bf16();
#else
    return false;
#endif
  }

  // tokens (B,) long at `positions` -> next-token logits (B, V) float32. Writes each row's K/V
  // at its position in k_cache / v_cache (layers, blocks, nkv, BL, hs) through its block table
  // (tables (B, n) long) and attends over its positions 0..position, block by block in place.
  // Every row's K/V is written before any row attends, so rows of one sequence at consecutive
  // positions (speculative drafts, a prompt) attend causally to each other.
  Tensor step(Tensor tokens, Tensor k_cache, Tensor v_cache, Tensor tables, std::vector<int64_t> positions) {
    return run(tokens, k_cache, v_cache, tables, positions, nullptr);
  }

  // A prompt (or several) as rows: like `step`, but the logits (R, V) of the rows `logit_rows`
  // only (each prompt's last token), so a long prompt does not pay the vocabulary projection on
  // every token.
  Tensor prefill(Tensor tokens, Tensor k_cache, Tensor v_cache, Tensor tables, std::vector<int64_t> positions,
                 std::vector<int64_t> logit_rows) {
    TORCH_CHECK(!logit_rows.empty(), "logit_rows must name at least one row");
    for (int64_t r : logit_rows)
      TORCH_CHECK(r >= 0 && r < static_cast<int64_t>(positions.size()), "logit row ", r, " out of range");
    return run(tokens, k_cache, v_cache, tables, positions, &logit_rows);
  }

 private:
  Tensor run(const Tensor& tokens, const Tensor& k_cache, const Tensor& v_cache, const Tensor& tables,
             const std::vector<int64_t>& positions, const std::vector<int64_t>* logit_rows) {
    TORCH_CHECK(has_head_ && !layers_.empty(), "the decoder is not fully built (no layers or no output head)");
    TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.device().is_cpu(),
                "tables must be a (B, n) long CPU tensor");
    Tensor table_rows = tables.contiguous();
    const int64_t B = table_rows.size(0), width = table_rows.size(1);
    TORCH_CHECK(B > 0 && static_cast<int64_t>(positions.size()) == B && tokens.numel() == B,
                "tokens, tables and positions must have one entry per row");
    check_cache(k_cache, "k_cache");
    check_cache(v_cache, "v_cache");
    TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.sizes() == v_cache.sizes(),
                "k_cache and v_cache must have the same shape and dtype");
    const int64_t n_blocks = k_cache.size(2), BL = k_cache.size(3);
    TORCH_CHECK(BL > 0 && (BL & (BL - 1)) == 0, "the block length must be a power of two, got ", BL);
    const int64_t* block_table = table_rows.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(positions[b] >= 0 && positions[b] < width * BL && positions[b] < rope_.size(1),
                  "position ", positions[b], " is past the block table or the rotary table");
      for (int64_t i = 0; i <= positions[b] / BL; ++i)
        TORCH_CHECK(block_table[b * width + i] >= 0 && block_table[b * width + i] < n_blocks, "block ",
                    block_table[b * width + i], " out of range [0, ", n_blocks, ")");
    }
    Tensor ids = tokens.to(at::kLong).contiguous().view({-1});
    const int64_t V = embed_.size(0);
    const int64_t* id = ids.data_ptr<int64_t>();
    auto opts = embed_.options().dtype(at::kFloat);
    Tensor x = at::empty({B, d_}, opts);
    const bool bf16 = embed_.scalar_type() == at::kBFloat16;
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(id[b] >= 0 && id[b] < V, "token id ", id[b], " out of range [0, ", V, ")");
      float* xb = x.data_ptr<float>() + b * d_;
      if (bf16) {  // exact in float32, then scaled as the float rows are (x * 1.0f is x)
        const uint16_t* e = reinterpret_cast<const uint16_t*>(embed_.data_ptr<at::BFloat16>()) + id[b] * d_;
        for (int64_t j = 0; j < d_; ++j) xb[j] = to_float(e[j]) * embed_scale_;
        continue;
      }
      const float* e = embed_.data_ptr<float>() + id[b] * d_;
      if (embed_scale_ == 1.0f)
        std::copy_n(e, d_, xb);
      else
        for (int64_t j = 0; j < d_; ++j) xb[j] = e[j] * embed_scale_;
    }
    const int64_t q_w = nh_ * hs_, kv_w = nkv_ * hs_;
    Tensor h = at::empty({B, d_}, opts), h2 = at::empty({B, d_}, opts), y = at::empty({B, q_w}, opts);
    float* xs = x.data_ptr<float>();
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& L = layers_[l];
      norm_rows(xs, L.attn_norm.data(), L.qkv, B, h.data_ptr<float>());
      const bool prompt = logit_rows != nullptr;
      Tensor qkv = L.qkv(h, prompt).contiguous();  // (B, q_w + 2 kv_w)
      const Tensor& table = L.local_rope ? rope_local_ : rope_;
      over_rows(partner_.get(), B, q_w + 2 * kv_w, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {  // (q/k norms, then) RoPE on q and k
          float* row = qkv.data_ptr<float>() + b * (q_w + 2 * kv_w);
          if (!L.q_norm.empty()) {
            rms_heads(row, L.q_norm.data(), eps_, nh_, hs_);
            rms_heads(row + q_w, L.k_norm.data(), eps_, nkv_, hs_);
          }
          const float* cos = table.data_ptr<float>() + positions[b] * hs_;
          const float* sin = cos + table.size(1) * hs_;
          rope_row(row, cos, sin, nh_, hs_);
          rope_row(row + q_w, cos, sin, nkv_, hs_);
        }
      });
      const int64_t layer_at = static_cast<int64_t>(l) * n_blocks * nkv_ * BL * hs_;
      auto cache_layer = [&](auto* k_base, auto* v_base) {  // float or bfloat16 bits
        write_kv(qkv.data_ptr<float>(), k_base, v_base, block_table, width, positions, n_blocks, BL, B);
        attend(qkv.data_ptr<float>(), k_base, v_base, block_table, width, positions, n_blocks, BL, L.o, L.window, B,
               y.data_ptr<float>(), logit_rows != nullptr);
      };
      with_kv_bits(k_cache, v_cache, [&](auto* k, auto* v) { cache_layer(k + layer_at, v + layer_at); });
      add_output(xs, L.o(y, prompt), L.post_attn_norm, B);
      norm_rows(xs, L.ffn_norm.data(), L.gate, B, h.data_ptr<float>());
      Tensor g = L.gate(h, prompt).contiguous();
      if (L.up_has_own_input) norm_rows(xs, L.ffn_norm.data(), L.up, B, h2.data_ptr<float>());
      Tensor u = L.up(L.up_has_own_input ? h2 : h, prompt).contiguous();
      const int64_t ff = g.size(1);
      float* gs = g.data_ptr<float>();
      const float* us = u.data_ptr<float>();
      // act(gate) * up, scaled for the down projection where it is smoothed
      const float* down_scale = L.down.inv_scale.empty() ? nullptr : L.down.inv_scale.data();
      over_rows(partner_.get(), B, ff, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          float* row = gs + b * ff;
          const float* up = us + b * ff;
          if (activation_ == kSilu)
            down_scale ? act_row<kSilu, true>(row, up, down_scale, ff) : act_row<kSilu, false>(row, up, nullptr, ff);
          else
            down_scale ? act_row<kGeluTanh, true>(row, up, down_scale, ff)
                       : act_row<kGeluTanh, false>(row, up, nullptr, ff);
        }
      });
      add_output(xs, L.down(g, prompt), L.post_ffn_norm, B);
    }
    if (logit_rows != nullptr) {  // the rows whose logits are wanted, gathered first
      const int64_t R = static_cast<int64_t>(logit_rows->size());
      Tensor picked = at::empty({R, d_}, opts);
      for (int64_t r = 0; r < R; ++r) std::copy_n(xs + (*logit_rows)[r] * d_, d_, picked.data_ptr<float>() + r * d_);
      Tensor hr = at::empty({R, d_}, opts);
      norm_rows(picked.data_ptr<float>(), final_norm_.data(), head_, R, hr.data_ptr<float>());
      return head_(hr, true).to(at::kFloat);
    }
    norm_rows(xs, final_norm_.data(), head_, B, h.data_ptr<float>());
    return head_(h).to(at::kFloat);
  }

  static Tensor float_contiguous(const Tensor& t, const char* name) {
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, " must be a float32 CPU tensor");
    return t.detach().contiguous();
  }

  static std::vector<float> to_vector(const Tensor& t, int64_t n, const char* name) {
    Tensor c = float_contiguous(t, name);
    TORCH_CHECK(c.numel() == n, name, " has ", c.numel(), " values, expected ", n);
    return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + n);
  }

  void finish(Projection p, const c10::optional<Tensor>& inv_scale) {
    if (inv_scale) {
      Tensor s = float_contiguous(*inv_scale, "inv_scale");
      p.inv_scale.assign(s.data_ptr<float>(), s.data_ptr<float>() + s.numel());
    }
    TORCH_CHECK(!layers_.empty(), "add_layer comes before its projections");
    Layer& L = layers_.back();
    if (next_ < 5) {
      *slots(L)[next_++] = std::move(p);
      if (next_ == 5) L.up_has_own_input = L.up.inv_scale != L.gate.inv_scale;
      return;
    }
    TORCH_CHECK(!has_head_, "every projection is already set");
    head_ = std::move(p);
    has_head_ = true;
  }

  static std::array<Projection*, 5> slots(Layer& L) { return {&L.qkv, &L.o, &L.gate, &L.up, &L.down}; }

  // The projection's weights as two packs, output features [0, N/2) and [N/2, N) (rounded to
  // 64 features), quantized exactly as the whole: the int8 values and per-channel scales sliced.
  void split_for_partner(Projection& p, const Tensor& qweight, const c10::optional<Tensor>& bias) {
    p.partner = partner_.get();  // a prompt's rows are shared through the whole pack
    const int64_t n = qweight.size(0);
    const int64_t half = (n / 2 + 63) / 64 * 64;
    if (n < 128 || half >= n || qweight.qscheme() != at::kPerChannelAffine) return;
    static auto prepack = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("quantized::linear_prepack", "")
                              .typed<c10::intrusive_ptr<LinearPackedParamsBase>(Tensor, c10::optional<Tensor>)>();
    Tensor ints = qweight.int_repr(), scales = qweight.q_per_channel_scales(),
           zeros = qweight.q_per_channel_zero_points();
    auto part = [&](int64_t a, int64_t b) {
      Tensor w = at::_make_per_channel_quantized_tensor(ints.slice(0, a, b).contiguous(),
                                                        scales.slice(0, a, b).contiguous(),
                                                        zeros.slice(0, a, b).contiguous(), 0);
      c10::optional<Tensor> pb = bias ? c10::optional<Tensor>(bias->slice(0, a, b).contiguous()) : c10::nullopt;
      return prepack.call(w, pb);
    };
    p.first = part(0, half);
    p.second = part(half, n);
    p.split = half;
  }

  void check_cache(const Tensor& c, const char* name) const {
    TORCH_CHECK(c.device().is_cpu() && (c.scalar_type() == at::kFloat || c.scalar_type() == at::kBFloat16) &&
                    c.is_contiguous(),
                name, " must be a contiguous float32 or bfloat16 CPU tensor");
    TORCH_CHECK(c.dim() == 5 && c.size(0) == num_layers() && c.size(1) == nkv_ && c.size(4) == hs_, name,
                " must be (layers, n_kv, blocks, block_len, head_dim)");
  }

  void norm_rows(const float* x, const float* w, const Projection& next, int64_t B, float* out) const {
    over_rows(partner_.get(), B, d_, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) rms_row(x + b * d_, w, next, eps_, d_, out + b * d_);
    });
  }

  // x += N(delta) row by row where the layer has a post-norm `w`, else x += delta.
  void add_output(float* x, const Tensor& delta, const std::vector<float>& w, int64_t B) const {
    Tensor c = delta.contiguous();
    const float* dp = c.data_ptr<float>();
    static const Projection unscaled;
    over_rows(partner_.get(), B, d_, [&](int64_t b0, int64_t b1) {
      if (w.empty()) {
        for (int64_t i = b0 * d_; i < b1 * d_; ++i) x[i] += dp[i];
        return;
      }
      std::vector<float> normed(d_);
      for (int64_t b = b0; b < b1; ++b) {
        rms_row(dp + b * d_, w.data(), unscaled, eps_, d_, normed.data());
        for (int64_t j = 0; j < d_; ++j) x[b * d_ + j] += normed[j];
      }
    });
  }

  // g[j] = act(g[j]) * u[j] * s[j] over one row. tanh GELU through tanh(z) = 1 - 2 / (1 + e^{2z})
  // (at the extremes e^{2z} saturates and tanh goes to -1 or 1).
  // (Without a scale the product skips it: the bits of x * 1.0f.) One loop per variant, which the
  // compiler vectorizes.
  template <int64_t kAct, bool kScaled>
  static void act_row(float* g, const float* u, const float* s, int64_t ff) {
    for (int64_t j = 0; j < ff; ++j) {
      const float a = g[j];
      float act;
      if constexpr (kAct == kSilu) {
        act = a / (1.0f + fast_exp(-a));
      } else {
        const float inner = 0.7978845608028654f * (a + 0.044715f * a * a * a);  // sqrt(2 / pi)
        act = 0.5f * a * (2.0f - 2.0f / (1.0f + fast_exp(2.0f * inner)));
      }
      g[j] = kScaled ? act * u[j] * s[j] : act * u[j];
    }
  }

  // Each row's new k and v (after RoPE, in its qkv row) into its block at its position.
  template <typename T>
  void write_kv(const float* qkv, T* k_base, T* v_base, const int64_t* table, int64_t width,
                const std::vector<int64_t>& positions, int64_t n_blocks, int64_t BL, int64_t B) const {
    const int64_t q_w = nh_ * hs_, kv_w = nkv_ * hs_;
    over_rows(partner_.get(), B, 2 * kv_w, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        const float* row = qkv + b * (q_w + 2 * kv_w);
        const int64_t block = table[b * width + positions[b] / BL], offset = positions[b] % BL;
        for (int64_t g = 0; g < nkv_; ++g) {
          const int64_t at_pos = ((g * n_blocks + block) * BL + offset) * hs_;
          for (int64_t i = 0; i < hs_; ++i) {
            store(row[q_w + g * hs_ + i], k_base + at_pos + i);
            store(row[q_w + kv_w + g * hs_ + i], v_base + at_pos + i);
          }
        }
      }
    });
  }

  // y (B, nh * hs) = softmax(q k^T * scale) v for each row over its own positions
  // 0..position (with a window: the last `window` of them), one work item per (row, key/value
  // head): the group's query heads share each K/V row they read. Scaled on the way out for the
  // output projection's smoothing.
  //
  // `prompt`: rows of prompts. There a run of at least `prompt_attention_rows_` rows of one
  // sequence at consecutive positions is attended as a block (attend_block: torch's flash
  // attention over the sequence's keys gathered once), since walking each row's positions one by
  // one costs a prompt of n rows at position p about n p scalar dot products with their
  // reductions. Only float rounding differs between the two. On a layer with a window, blocks
  // need a window wider than a block and one more key (every row of a block then sees its whole
  // block and at least one earlier key); narrower windows keep the row walk.
  template <typename T>
  void attend(const float* qkv, const T* k_base, const T* v_base, const int64_t* table, int64_t width,
              const std::vector<int64_t>& positions, int64_t n_blocks, int64_t BL, const Projection& out_proj,
              int64_t window, int64_t B, float* y, bool prompt) const {
    const int64_t group = nh_ / nkv_, q_w = nh_ * hs_, row_w = q_w + 2 * nkv_ * hs_;
    const int64_t shift = shift_of(BL);
    std::vector<std::pair<int64_t, int64_t>> blocks;  // [first row, end row) attended as blocks
    std::vector<int64_t> rows;  // the rest, row by row
    if (prompt && (window == 0 || window >= kBlockRows + 2) && prompt_attention_rows_ > 0) {
      int64_t r0 = 0;
      for (int64_t b = 1; b <= B; ++b) {
        const bool continues = b < B && positions[b] == positions[b - 1] + 1 &&
                               std::memcmp(table + b * width, table + (b - 1) * width, width * sizeof(int64_t)) == 0;
        if (continues) continue;
        if (b - r0 >= prompt_attention_rows_)  // in pieces of at most kBlockRows rows, for the threads to share
          for (int64_t r = r0; r < b; r += kBlockRows) blocks.emplace_back(r, std::min(b, r + kBlockRows));
        else
          for (int64_t r = r0; r < b; ++r) rows.push_back(r);
        r0 = b;
      }
    } else {
      rows.resize(B);
      for (int64_t b = 0; b < B; ++b) rows[b] = b;
    }
    const int64_t block_units = static_cast<int64_t>(blocks.size()) * nkv_;  // items before the row items
    auto items = [&](int64_t begin, int64_t end, int64_t stride) {
      thread_local std::vector<float> scores, acc, total;  // each thread's scratch, kept between calls
      acc.resize(group * hs_);
      total.resize(group);
      for (int64_t item = begin; item < end; item += stride) {
        if (item < block_units) {  // a (block, K/V head) unit: the long ones, taken first
          const auto [r0, r1] = blocks[item / nkv_];
          const int64_t g = item % nkv_;
          const PagedRows<T> keys{k_base, table + r0 * width, shift, BL * hs_, g * n_blocks * BL * hs_, hs_, 0};
          PagedRows<T> values = keys;
          values.base = v_base;
          attend_block(qkv, keys, values, positions, r0, r1, g, window, out_proj, y);
          continue;
        }
        const int64_t b = rows[(item - block_units) / nkv_], g = (item - block_units) % nkv_;
        const int64_t first = window > 0 ? std::max<int64_t>(0, positions[b] + 1 - window) : 0;
        const int64_t n = positions[b] + 1 - first;
        const PagedRows<T> keys{k_base, table + b * width, shift, BL * hs_, g * n_blocks * BL * hs_, hs_, first};
        PagedRows<T> values = keys;
        values.base = v_base;
        scores.resize(group * n);
        attend_item(qkv + b * row_w + g * group * hs_, keys, values, n, group, hs_, scale_, scores.data(),
                    total.data(), acc.data());
        for (int64_t h = 0; h < group; ++h) {
          const int64_t head = g * group + h;
          float* out = y + b * q_w + head * hs_;
          for (int64_t i = 0; i < hs_; ++i) out[i] = acc[h * hs_ + i] * out_proj.scale(head * hs_ + i);
        }
      }
    };
    const int64_t n_items = (static_cast<int64_t>(rows.size()) + static_cast<int64_t>(blocks.size())) * nkv_;
    if (partner_ && n_items > 1 && at::get_num_threads() == 1) {
      // one item a chunk: whichever thread is free takes the next (a prompt's rows grow in cost
      // with their position)
      const int64_t per = (n_items + 4095) / 4096;  // items a chunk: at most 4,096 chunks
      partner_->run((n_items + per - 1) / per,
                    [&](int64_t c) { items(c * per, std::min(n_items, (c + 1) * per), 1); });
    } else {
      at::parallel_for(0, n_items, 1, [&](int64_t begin, int64_t end) { items(begin, end, 1); });
    }
  }

  // Rows [r0, r1) of one sequence (positions p0 .. p0 + n - 1, its keys 0 .. p0 + n - 1 in the
  // cache), K/V head g: its keys and values gathered as float32 once, then torch's CPU flash
  // attention in two parts merged by their log-sum-exp: the rows over the keys before the block
  // and over the block's own keys (causal, a square). Scaled on the way out as attend. With a
  // window (wider than the block: attend's condition) only the keys some row still sees are
  // gathered, from p0 - window + 1, and the earlier part is masked where a key has left a row's
  // window (row i sees key position j when j > p0 + i - window).
  template <typename T>
  void attend_block(const float* qkv, const PagedRows<T>& keys, const PagedRows<T>& values,
                    const std::vector<int64_t>& positions, int64_t r0, int64_t r1, int64_t g, int64_t window,
                    const Projection& out_proj, float* y) const {
    const int64_t group = nh_ / nkv_, q_w = nh_ * hs_, row_w = q_w + 2 * nkv_ * hs_;
    const int64_t n = r1 - r0, before = positions[r0], total = before + n;
#if defined(TSERVE_AVX512)
    if constexpr (std::is_same_v<T, uint16_t>) {  // a bfloat16 cache: its own dot products where the CPU has them
      if (prompt_bf16_ && has_avx512_bf16() && (hs_ == 64 || hs_ == 128 || hs_ == 256)) {
        const int64_t at = g * group * hs_;
        const float* os = out_proj.inv_scale.empty() ? nullptr : out_proj.inv_scale.data() + at;
        const float* q = qkv + r0 * row_w + at;
        float* out = y + r0 * q_w + at;
        if (hs_ == 64)
          attend_block_bf16<64>(q, row_w, group, keys, values, before, n, window, scale_, out, q_w, os);
        else if (hs_ == 128)
          attend_block_bf16<128>(q, row_w, group, keys, values, before, n, window, scale_, out, q_w, os);
        else
          attend_block_bf16<256>(q, row_w, group, keys, values, before, n, window, scale_, out, q_w, os);
        return;
      }
    }
#endif
    const int64_t first = window > 0 ? std::max<int64_t>(0, before - window + 1) : 0;  // earliest key seen
    const int64_t span = total - first, earlier_keys = before - first;
    auto opts = at::TensorOptions().dtype(at::kFloat);
    Tensor q = at::empty({1, group, n, hs_}, opts), k = at::empty({1, 1, span, hs_}, opts),
           v = at::empty({1, 1, span, hs_}, opts);
    float* qp = q.data_ptr<float>();
    for (int64_t h = 0; h < group; ++h)
      for (int64_t i = 0; i < n; ++i)
        std::copy_n(qkv + (r0 + i) * row_w + (g * group + h) * hs_, hs_, qp + (h * n + i) * hs_);
    float* kp = k.data_ptr<float>();
    float* vp = v.data_ptr<float>();
    for (int64_t t = 0; t < span; ++t) {
      const T* kr = keys.row(first + t);
      const T* vr = values.row(first + t);
      for (int64_t i = 0; i < hs_; ++i) {
        kp[t * hs_ + i] = to_float(kr[i]);
        vp[t * hs_ + i] = to_float(vr[i]);
      }
    }
    auto flash = [&](const Tensor& kk, const Tensor& vv, bool causal, const c10::optional<Tensor>& mask) {
      const int64_t m = kk.size(2);
      return at::_scaled_dot_product_flash_attention_for_cpu(q, kk.expand({1, group, m, hs_}),
                                                             vv.expand({1, group, m, hs_}), 0.0, causal, mask,
                                                             static_cast<double>(scale_));
    };
    std::tuple<Tensor, Tensor> own =
        flash(k.narrow(2, earlier_keys, n), v.narrow(2, earlier_keys, n), true, c10::nullopt);
    Tensor out = std::get<0>(own).contiguous(), lse = std::get<1>(own);
    if (earlier_keys > 0) {  // merge with the rows' attention over the keys before the block
      c10::optional<Tensor> mask = c10::nullopt;
      if (window > 0) {
        // additive: -inf where key position first + j <= p0 + i - window (out of row i's window)
        Tensor m = at::zeros({n, earlier_keys}, opts);
        float* mp = m.data_ptr<float>();
        const float neg = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < earlier_keys && first + j <= before + i - window; ++j) mp[i * earlier_keys + j] = neg;
        mask = m;
      }
      std::tuple<Tensor, Tensor> earlier = flash(k.narrow(2, 0, earlier_keys), v.narrow(2, 0, earlier_keys), false, mask);
      Tensor out0 = std::get<0>(earlier), lse0 = std::get<1>(earlier);
      Tensor top = at::maximum(lse, lse0);
      Tensor a = (lse - top).exp(), b = (lse0 - top).exp();
      out = (out * a.unsqueeze(-1) + out0.contiguous() * b.unsqueeze(-1)) / (a + b).unsqueeze(-1);
      out = out.contiguous();
    }
    const float* op = out.data_ptr<float>();
    for (int64_t h = 0; h < group; ++h) {
      const int64_t head = g * group + h;
      for (int64_t i = 0; i < n; ++i) {
        float* dst = y + (r0 + i) * q_w + head * hs_;
        const float* src = op + (h * n + i) * hs_;
        for (int64_t j = 0; j < hs_; ++j) dst[j] = src[j] * out_proj.scale(head * hs_ + j);
      }
    }
  }

  int64_t prompt_attention_rows_ = 0;  // 0: prompts attend row by row (set_prompt_attention)
  bool prompt_bf16_ = true;  // blocks over a bfloat16 cache through attend_block_bf16 where the CPU can
  static constexpr int64_t kBlockRows = 256;  // rows of one block (a piece of a longer run)
  int64_t nh_, nkv_, hs_, d_ = 0;
  float eps_, scale_;
  float embed_scale_ = 1.0f;
  int64_t activation_ = kSilu;
  Tensor embed_, rope_, rope_local_;
  std::vector<float> final_norm_;
  std::vector<Layer> layers_;
  Projection head_;
  bool has_head_ = false;
  std::unique_ptr<Partner> partner_;  // declared after the projections that point to it: destroyed first
  int next_ = 0;
};

// One int8 projection on its own: the int8 path of the Python decode step's projections
// (model.quant.int8.DecodeInt8Linear on the CPU, where the library is built), which is
// model.quant.int8.rowwise_int8_linear bit for bit in one call. In Python that is some fifteen
// tensor operations around fbgemm's product, each a pass over the rows: ~100 us a layer at 32
// rows of 512, and five passes over 32 x 58k floats for a translator's vocabulary-wide head. Here
// it is one loop before the product and one after (Projection::int8_rows, the native step's).
class Int8Linear : public torch::CustomClassHolder {
 public:
  // inv_scale (in,) float32 or None: SmoothQuant's explicit scale, x * inv_scale goes in
  Int8Linear(c10::IValue packed, c10::optional<Tensor> inv_scale) : p_(LlamaDecoder::int8_projection(packed)) {
    if (inv_scale) {
      TORCH_CHECK(inv_scale->device().is_cpu() && inv_scale->scalar_type() == at::kFloat && inv_scale->dim() == 1 &&
                      inv_scale->size(0) == p_.int8_in,
                  "inv_scale must be a (", p_.int8_in, ",) float32 CPU tensor");
      inv_scale_ = inv_scale->detach().contiguous();
    }
  }

  // x (B, in) float32 -> (B, out) float32; each row quantized over its own range
  Tensor forward(Tensor x) const {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.size(1) == p_.int8_in,
                "x must be (B, ", p_.int8_in, ") float32 on the CPU");
    if (inv_scale_.defined()) return p_.int8_rows((x * inv_scale_).contiguous(), true);
    return p_.int8_rows(x.contiguous(), true);
  }

  int64_t in_features() const { return p_.int8_in; }
  int64_t out_features() const { return static_cast<int64_t>(p_.row_sum.size()); }

 private:
  Projection p_;
  Tensor inv_scale_;
};

// One decode step of an encoder-decoder's decoder (a translator: Marian and its like), int8
// projections, in C++. The Python step runs the same layers as some forty Python-dispatched
// operations a layer; at 32 rows that dispatch, not arithmetic, was most of a step. Here every
// operation is the one the Python step calls (at::embedding, at::layer_norm, the activations,
// the adds; Projection::int8_rows unfused, which is RowwiseInt8Linear's int8 path; the decode
// attention kernels below), on the same values in the same order, so a step gives the Python
// step's logits bit for bit (tested), with one call from Python instead of hundreds.
//
// Per layer: self-attention (q, k, v; the new K/V written into the paged pool; each row over its
// own positions), cross-attention (q; each row over its source's memory), the feed-forward
// (up -> activation -> down), each wrapped in residual + LayerNorm, pre or post.
Tensor paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor lengths, double scale,
                              int64_t window);
Tensor cross_decode_attention(Tensor q, Tensor k_mem, Tensor v_mem, Tensor slots, Tensor lengths, double scale);

class EncDecDecoder : public torch::CustomClassHolder {
 public:
  // activation: 0 relu, 1 gelu (erf), 2 gelu (tanh), 3 silu
  EncDecDecoder(int64_t n_heads, int64_t head_dim, double self_scale, double cross_scale, bool pre_norm,
                int64_t activation, double eps)
      : nh_(n_heads), hs_(head_dim), self_scale_(self_scale), cross_scale_(cross_scale), pre_norm_(pre_norm),
        activation_(activation), eps_(eps) {
    TORCH_CHECK(n_heads > 0 && head_dim > 0 && head_dim <= 512, "n_heads > 0 and 0 < head_dim <= 512");
    TORCH_CHECK(activation >= 0 && activation <= 3, "activation code ", activation, " not in [0, 3]");
  }

  // tokens (V, d); scale: the embedding scale (1: none); positions (P, d): added by position
  // (a sinusoid table or learned embeddings); norm: the embedding LayerNorm's weight and bias
  void set_embedding(Tensor tokens, double scale, Tensor positions, c10::optional<Tensor> norm_w,
                     c10::optional<Tensor> norm_b) {
    TORCH_CHECK(tokens.dim() == 2 && positions.dim() == 2 && positions.size(1) == tokens.size(1),
                "tokens (V, d) and positions (P, d)");
    tokens_ = tokens.detach();
    positions_ = positions.detach();
    embed_scale_ = scale;
    d_ = tokens.size(1);
    if (norm_w) embed_norm_ = {norm_w->detach(), norm_b ? norm_b->detach() : Tensor()};
  }

  // norms: (weight, bias) of the self-attention, cross-attention and feed-forward LayerNorms.
  // Then its projections, in order: q, k, v (or one fused qkv), out; cross q, cross out; up, down.
  void add_layer(std::vector<Tensor> norms, bool fused_qkv) {
    TORCH_CHECK(norms.size() == 6, "a layer takes six norm tensors");
    TORCH_CHECK(layers_.empty() || complete(layers_.back()), "a layer needs all its projections before the next");
    TORCH_CHECK(!head_set_, "layers come before the head");
    Layer L;
    for (int i = 0; i < 3; ++i) L.norms[i] = {norms[2 * i].detach(), norms[2 * i + 1].detach()};
    L.fused = fused_qkv;
    layers_.push_back(std::move(L));
  }

  // the next projection: fbgemm's packed int8 weights (RowwiseInt8Linear's) and its optional
  // smoothing scale; after the last layer's, the output head's
  void add_projection(c10::IValue packed, c10::optional<Tensor> inv_scale) {
    Proj p;
    p.q = LlamaDecoder::int8_projection(packed);
    if (inv_scale) p.inv_scale = inv_scale->detach().to(at::kFloat).contiguous();
    if (!layers_.empty() && !complete(layers_.back())) {
      layers_.back().proj.push_back(std::move(p));
      return;
    }
    TORCH_CHECK(!head_set_, "every projection is already set");
    head_ = std::move(p);
    head_set_ = true;
  }

  // final: the decoder's final LayerNorm (weight, bias), or none
  void set_final_norm(c10::optional<Tensor> w, c10::optional<Tensor> b) {
    if (w) final_norm_ = {w->detach(), b ? b->detach() : Tensor()};
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // tokens (B,) at positions (B,); k_pool, v_pool (layers, nkv, blocks, BL, hs) the cache's pools;
  // tables (B, n) long; cross_k, cross_v (layers, slots, nh, S, hs); slots (B,) long: each row's
  // memory row; src_lengths (B,) long -> logits (B, V) float32
  Tensor step(Tensor tokens, Tensor positions, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor cross_k,
              Tensor cross_v, Tensor slots, Tensor src_lengths) {
    TORCH_CHECK(head_set_ && !layers_.empty() && complete(layers_.back()), "the decoder is not fully built");
    const int64_t n_layers = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(k_pool.dim() == 5 && k_pool.size(0) == n_layers && cross_k.dim() == 5 && cross_k.size(0) == n_layers,
                "k_pool (layers, nkv, blocks, BL, hs) and cross_k (layers, slots, nh, S, hs) for ", n_layers,
                " layers");
    TORCH_CHECK(k_pool.sizes() == v_pool.sizes() && cross_k.sizes() == cross_v.sizes(),
                "K and V must have one shape");
    TORCH_CHECK(k_pool.scalar_type() == at::kFloat || k_pool.scalar_type() == at::kBFloat16,
                "the pool must be float32 or bfloat16");
    Tensor ids = tokens.to(at::kLong).contiguous().view({-1});
    Tensor pos = positions.to(at::kLong).contiguous().view({-1});
    const int64_t B = ids.size(0);
    TORCH_CHECK(B > 0 && pos.size(0) == B && tables.dim() == 2 && tables.size(0) == B,
                "tokens, positions and tables need one entry per row");
    const int64_t V = tokens_.size(0);
    Tensor table_rows = tables.contiguous();
    const int64_t nkv = k_pool.size(1), n_blocks = k_pool.size(2), BL = k_pool.size(3);
    TORCH_CHECK(k_pool.size(4) == hs_ && nkv > 0 && nh_ % nkv == 0, "the pool's heads do not fit the model's");
    TORCH_CHECK(BL > 0 && (BL & (BL - 1)) == 0, "the block length must be a power of two");
    const int64_t width = table_rows.size(1);
    const int64_t* table = table_rows.data_ptr<int64_t>();
    const int64_t* p = pos.data_ptr<int64_t>();
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(id[b] >= 0 && id[b] < V, "token id ", id[b], " out of range [0, ", V, ")");
      TORCH_CHECK(p[b] >= 0 && p[b] < positions_.size(0), "position ", p[b], " is past the position table (",
                  positions_.size(0), ")");
      TORCH_CHECK(p[b] < width * BL, "position ", p[b], " is past row ", b, "'s block table");
      const int64_t blk = table[b * width + p[b] / BL];
      TORCH_CHECK(blk >= 0 && blk < n_blocks, "block ", blk, " out of range [0, ", n_blocks, ")");
    }
    Tensor lengths = pos + 1;

    // the embeddings, as model.nn.layers.Embeddings computes them
    Tensor x = at::embedding(tokens_, ids);
    if (embed_scale_ != 1.0) x = x * embed_scale_;
    x = x + positions_.index_select(0, pos).to(x.scalar_type());
    if (embed_norm_.first.defined()) x = norm(x, embed_norm_);

    for (int64_t l = 0; l < n_layers; ++l) {
      const Layer& L = layers_[l];
      Tensor kp = k_pool.select(0, l), vp = v_pool.select(0, l);
      x = residual(x, L.norms[0], [&](const Tensor& h) { return self_attention(L, h, kp, vp, table_rows, p, lengths); });
      x = residual(x, L.norms[1], [&](const Tensor& h) {
        const size_t c = L.fused ? 2 : 4;  // cross q, cross out
        Tensor q = L.proj[c](h).view({B, nh_, hs_});
        Tensor y = cross_decode_attention(q, cross_k.select(0, l), cross_v.select(0, l), slots, src_lengths, cross_scale_);
        return L.proj[c + 1](y.view({B, nh_ * hs_}));
      });
      x = residual(x, L.norms[2], [&](const Tensor& h) { return feed_forward(L, h); });
    }
    if (final_norm_.first.defined()) x = norm(x, final_norm_);
    return head_(x).to(at::kFloat);
  }

 private:
  struct Proj {
    Projection q;
    Tensor inv_scale;
    Tensor operator()(const Tensor& x) const {
      return q.int8_rows(inv_scale.defined() ? (x * inv_scale).contiguous() : x.contiguous(), true);
    }
  };
  using Norm = std::pair<Tensor, Tensor>;
  struct Layer {
    std::array<Norm, 3> norms;  // self, cross, feed-forward
    bool fused = false;
    std::vector<Proj> proj;
  };
  static size_t wanted(const Layer& L) { return (L.fused ? 1 : 3) + 1 + 2 + 2; }
  static bool complete(const Layer& L) { return L.proj.size() == wanted(L); }

  Tensor norm(const Tensor& x, const Norm& n) const {
    return at::layer_norm(x, {d_}, n.first, n.second.defined() ? c10::optional<Tensor>(n.second) : c10::nullopt, eps_);
  }

  // x + f(x) written into f(x)'s own (fresh) output: an add is the same either way round
  template <typename F>
  Tensor residual(const Tensor& x, const Norm& n, const F& fn) const {
    if (pre_norm_) return fn(norm(x, n)).add_(x);
    return norm(fn(x).add_(x), n);
  }

  // in place on the up projection's fresh output: the same values as torch's functions
  Tensor activate(Tensor x) const {
    switch (activation_) {
      case 0: return at::relu_(x);
      case 1: return at::gelu(x);
      case 2: return at::gelu(x, "tanh");
      default: return at::silu_(x);
    }
  }

  Tensor feed_forward(const Layer& L, const Tensor& h) const {
    const size_t f = (L.fused ? 1 : 3) + 3;  // up, then down
    return L.proj[f + 1](activate(L.proj[f](h)));
  }

  Tensor self_attention(const Layer& L, const Tensor& h, const Tensor& kp, const Tensor& vp, const Tensor& tables,
                        const int64_t* p, const Tensor& lengths) const {
    const int64_t B = h.size(0), nkv = kp.size(0);
    Tensor q, k, v;
    if (L.fused) {
      Tensor qkv = L.proj[0](h);
      q = qkv.narrow(1, 0, nh_ * hs_);
      k = qkv.narrow(1, nh_ * hs_, nkv * hs_);
      v = qkv.narrow(1, (nh_ + nkv) * hs_, nkv * hs_);
    } else {
      q = L.proj[0](h);
      k = L.proj[1](h);
      v = L.proj[2](h);
    }
    // the new K/V into the pool: row b's position p[b] lies in block tables[b, p / BL] at p % BL
    const int64_t n_blocks = kp.size(1), BL = kp.size(2), width = tables.size(1);
    const int64_t* table = tables.data_ptr<int64_t>();
    // rows read where they lie (a fused qkv's k and v are column slices of its output)
    Tensor kc = k.stride(1) == 1 ? k : k.contiguous(), vc = v.stride(1) == 1 ? v : v.contiguous();
    const float* ks = kc.data_ptr<float>();
    const float* vs = vc.data_ptr<float>();
    const int64_t k_row = kc.stride(0), v_row = vc.stride(0);
    with_kv_bits(kp, vp, [&](auto* k_base, auto* v_base) {
      for (int64_t b = 0; b < B; ++b) {
        const int64_t blk = table[b * width + p[b] / BL], off = p[b] % BL;
        for (int64_t g = 0; g < nkv; ++g) {
          const int64_t dst = ((g * n_blocks + blk) * BL + off) * hs_;
          const float* src_k = ks + b * k_row + g * hs_;
          const float* src_v = vs + b * v_row + g * hs_;
          for (int64_t i = 0; i < hs_; ++i) {
            store(src_k[i], k_base + dst + i);
            store(src_v[i], v_base + dst + i);
          }
        }
      }
    });
    Tensor y = paged_decode_attention(q.view({B, nh_, hs_}), kp, vp, tables, lengths, self_scale_, 0);
    return L.proj[L.fused ? 1 : 3](y.view({B, nh_ * hs_}));
  }

  int64_t nh_, hs_, d_ = 0;
  double self_scale_, cross_scale_;
  bool pre_norm_;
  int64_t activation_;
  double eps_;
  Tensor tokens_, positions_;
  double embed_scale_ = 1.0;
  Norm embed_norm_, final_norm_;
  std::vector<Layer> layers_;
  Proj head_;
  bool head_set_ = false;
};

// The 4-bit kernel on its own, for tests and measurements: x (B, k) float32 -> (B, n);
// `portable`: the plain loops, whatever the CPU has.
Tensor q4_linear(Tensor x, Tensor runs, int64_t n, int64_t k, c10::optional<Tensor> bias, bool portable) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(), "x must be (B, k) float32");
  c10::optional<Tensor> b;
  if (bias) b = bias->to(at::kFloat);
  return LlamaDecoder::make_q4(runs.contiguous(), n, k, b).q4_rows(x.contiguous(), portable);
}

// q (B, nh, hs) as the decode-attention ops read it: each row's heads contiguous, the rows
// wherever they lie (a fused qkv's q is a column slice of its output), else a contiguous copy.
Tensor rows_in_place(const Tensor& q) { return q.stride(2) == 1 && q.stride(1) == q.size(2) ? q : q.contiguous(); }

// The K/V pair a decode-attention op reads (a layer's pool, or its cross-attention memory):
// contiguous CPU tensors of one shape and dtype, float32 or bfloat16, (·, ·, ·, hs) with q's hs.
void check_kv_pair(const Tensor& q, const Tensor& k, const Tensor& v, const char* layout) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.device().is_cpu(), "q must be (B, nh, hs) float32");
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type() && k.is_contiguous() &&
                  v.is_contiguous() && k.device().is_cpu(),
              "the K/V pair must be contiguous ", layout, " CPU tensors of one shape and dtype");
  TORCH_CHECK(k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16, "the K/V pair must be float32 or bfloat16");
  TORCH_CHECK(k.size(3) == q.size(2) && q.size(2) <= 512, "the K/V head size must be q's (at most 512)");
}

// One new token per row attending over its cached positions where they lie in the block pool:
// the Python step's decode attention on the CPU (an encoder-decoder's self-attention, a model the
// native step does not run). It replaces a gather of every row's history into a padded copy
// (twice: K and V, on every layer of every step) and SDPA over that copy with a length mask.
// q (B, nh, hs) float32; k_pool, v_pool one layer's pool (nkv, blocks, BL, hs), float32 or
// bfloat16; tables (B, n) long; lengths (B,) long: row b attends to its positions
// [max(0, lengths[b] - window), lengths[b]) (window 0: all of them). -> (B, nh, hs) float32.
// The attention of each (row, K/V head) is the native step's (attend_item), so a row's result
// does not depend on the rows beside it.
Tensor paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor tables, Tensor lengths, double scale,
                              int64_t window) {
  check_kv_pair(q, k_pool, v_pool, "(nkv, blocks, block_len, hs)");
  const int64_t B = q.size(0), nh = q.size(1), hs = q.size(2);
  const int64_t nkv = k_pool.size(0), n_blocks = k_pool.size(1), BL = k_pool.size(2);
  TORCH_CHECK(nkv > 0 && nh % nkv == 0, "query heads must be a multiple of the pool's K/V heads");
  TORCH_CHECK(BL > 0 && (BL & (BL - 1)) == 0, "the block length must be a power of two, got ", BL);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && tables.scalar_type() == at::kLong && tables.device().is_cpu(),
              "tables must be a (B, n) long CPU tensor");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == B && lengths.scalar_type() == at::kLong && lengths.device().is_cpu(),
              "lengths must be a (B,) long CPU tensor");
  Tensor qc = rows_in_place(q), table_rows = tables.contiguous(), ends = lengths.contiguous();
  const int64_t q_row = qc.stride(0);
  const int64_t width = table_rows.size(1), group = nh / nkv;
  const int64_t* table = table_rows.data_ptr<int64_t>();
  const int64_t* end = ends.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(end[b] >= 1 && end[b] <= width * BL, "row ", b, " attends to ", end[b], " positions; its table holds ",
                width * BL);
    for (int64_t i = 0; i < (end[b] + BL - 1) / BL; ++i)
      TORCH_CHECK(table[b * width + i] >= 0 && table[b * width + i] < n_blocks, "block ", table[b * width + i],
                  " out of range [0, ", n_blocks, ")");
  }
  const int64_t shift = shift_of(BL);
  Tensor out = at::empty({B, nh, hs}, qc.options());
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  with_kv_bits(k_pool, v_pool, [&](const auto* k_base, const auto* v_base) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(k_base)>>;
    at::parallel_for(0, B * nkv, 1, [&](int64_t begin, int64_t stop) {
      std::vector<float> scores, total(group);
      for (int64_t item = begin; item < stop; ++item) {
        const int64_t b = item / nkv, g = item % nkv;
        const int64_t first = window > 0 ? std::max<int64_t>(0, end[b] - window) : 0, n = end[b] - first;
        const PagedRows<T> keys{k_base, table + b * width, shift, BL * hs, g * n_blocks * BL * hs, hs, first};
        PagedRows<T> values = keys;
        values.base = v_base;
        scores.resize(group * n);
        attend_item(qp + b * q_row + g * group * hs, keys, values, n, group, hs, static_cast<float>(scale),
                    scores.data(), total.data(), op + (b * nh + g * group) * hs);
      }
    });
  });
  return out;
}

// One new token per row attending over its source's encoder memory (an encoder-decoder's
// cross-attention): q (B, nh, hs) float32; k_mem, v_mem one layer's memory (slots, nh, S, hs),
// float32 or bfloat16, contiguous; slots (B,) long: the memory row each row reads; lengths (B,)
// long: its source's tokens (the rest of S is padding, never read). -> (B, nh, hs) float32. The
// same per-row attention as paged_decode_attention (a source is one block of S rows).
Tensor cross_decode_attention(Tensor q, Tensor k_mem, Tensor v_mem, Tensor slots, Tensor lengths, double scale) {
  check_kv_pair(q, k_mem, v_mem, "(slots, nh, S, hs)");
  const int64_t B = q.size(0), nh = q.size(1), hs = q.size(2), n_slots = k_mem.size(0), S = k_mem.size(2);
  TORCH_CHECK(k_mem.size(1) == nh, "the memory's heads must be q's");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == B && slots.scalar_type() == at::kLong && lengths.dim() == 1 &&
                  lengths.size(0) == B && lengths.scalar_type() == at::kLong && slots.device().is_cpu() &&
                  lengths.device().is_cpu(),
              "slots and lengths must be (B,) long CPU tensors");
  Tensor qc = rows_in_place(q), rows = slots.contiguous(), ends = lengths.contiguous();
  const int64_t q_row = qc.stride(0);
  const int64_t* slot = rows.data_ptr<int64_t>();
  const int64_t* end = ends.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(slot[b] >= 0 && slot[b] < n_slots, "slot ", slot[b], " out of range [0, ", n_slots, ")");
    TORCH_CHECK(end[b] >= 1 && end[b] <= S, "row ", b, " has ", end[b], " source tokens; the memory holds ", S);
  }
  Tensor out = at::empty({B, nh, hs}, qc.options());
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  with_kv_bits(k_mem, v_mem, [&](const auto* k_base, const auto* v_base) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(k_base)>>;
    at::parallel_for(0, B * nh, 1, [&](int64_t begin, int64_t stop) {
      std::vector<float> scores;
      float total = 0.0f;
      for (int64_t item = begin; item < stop; ++item) {
        const int64_t b = item / nh, h = item % nh;
        // one block holding all S rows: the shift keeps every position in block 0 (the row's slot)
        const PagedRows<T> keys{k_base, slot + b, 62, nh * S * hs, h * S * hs, hs, 0};
        PagedRows<T> values = keys;
        values.base = v_base;
        scores.resize(end[b]);
        attend_item(qp + b * q_row + h * hs, keys, values, end[b], 1, hs, static_cast<float>(scale), scores.data(), &total,
                    op + item * hs);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tserve_native, m) {
  m.def("cross_decode_attention", &cross_decode_attention);
  m.def("q4_linear", &q4_linear);
  m.def("paged_decode_attention", &paged_decode_attention);
  m.class_<Int8Linear>("Int8Linear")
      .def(torch::init<c10::IValue, c10::optional<Tensor>>())
      .def("forward", &Int8Linear::forward)
      .def("in_features", &Int8Linear::in_features)
      .def("out_features", &Int8Linear::out_features);
  m.class_<EncDecDecoder>("EncDecDecoder")
      .def(torch::init<int64_t, int64_t, double, double, bool, int64_t, double>())
      .def("set_embedding", &EncDecDecoder::set_embedding)
      .def("add_layer", &EncDecDecoder::add_layer)
      .def("add_projection", &EncDecDecoder::add_projection)
      .def("set_final_norm", &EncDecDecoder::set_final_norm)
      .def("num_layers", &EncDecDecoder::num_layers)
      .def("step", &EncDecDecoder::step);
  m.class_<LlamaDecoder>("LlamaDecoder")
      .def(torch::init<int64_t, int64_t, int64_t, double, double>())
      .def("set_model", &LlamaDecoder::set_model)
      .def("set_features", &LlamaDecoder::set_features)
      .def("set_layer_features", &LlamaDecoder::set_layer_features)
      .def("add_layer", &LlamaDecoder::add_layer)
      .def("add_int8", &LlamaDecoder::add_int8)
      .def("add_float", &LlamaDecoder::add_float)
      .def("attach_q4", &LlamaDecoder::attach_q4)
      .def("num_layers", &LlamaDecoder::num_layers)
      .def("use_partner", &LlamaDecoder::use_partner)
      .def("set_prompt_attention", &LlamaDecoder::set_prompt_attention)
      .def("set_prompt_bf16", &LlamaDecoder::set_prompt_bf16)
      .def("step", &LlamaDecoder::step)
      .def("prefill", &LlamaDecoder::prefill);
}
