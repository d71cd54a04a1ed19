// The GGUF block kernels (kquant.h has the maths): activations quantized per block, the integers
// of each weight block by scalar or AVX2 loops, then one float combination for all.
#include "kquant_blocks.h"

#include <cstdlib>
#include <cstdint>
#include <functional>
#include <string>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace tserve_native {
namespace {

// --- the integers, scalar ----------------------------------------------------------------------
// Each ints_* writes the kq_ints(qtype) integers of `blocks` consecutive blocks of one weight row
// against one activation row (r, sum16 at the same blocks) into out[kq_ints i ..].

// Q6_K's value v: its 6-bit q (0-63) and sub-block v / 16; its partial sum is 2 (v / 128) + (v % 32) / 16
// (sub-blocks 8h + odd + 2c, c = 0-3: the packed loops' order).
inline int32_t q6_value(const uint8_t* w, int v) {
  const int h = v / 128, c = (v % 128) / 32, l = v % 32;
  const uint8_t ql = w[64 * h + 32 * (c % 2) + l];
  return (c < 2 ? ql & 15 : ql >> 4) | (((w[128 + 32 * h + l] >> (2 * c)) & 3) << 4);
}

void ints_scalar(int64_t qtype, const uint8_t* w, const int16_t* r, const int32_t* sum16, int64_t blocks,
                 int32_t* out) {
  const int64_t bytes = kq_format(qtype).bytes, per = kq_ints(qtype);
  for (int64_t i = 0; i < blocks; ++i, w += bytes, out += per) {
    if (qtype == KQ4_K || qtype == KQ5_K) {
      const int16_t* ri = r + 256 * i;
      const uint8_t* qs = w + (qtype == KQ4_K ? 16 : 48);
      int32_t sc[8], mn[8], part[2] = {0, 0};
      scale_min_k4(w + 4, sc, mn);
      for (int s = 0; s < 8; ++s) {  // sub-block s: nibble s % 2 of bytes 32 (s / 2) ...
        int32_t dot = 0;
        for (int l = 0; l < 32; ++l) {
          int32_t q = (qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 15;
          if (qtype == KQ5_K) q |= ((w[16 + l] >> s) & 1) << 4;
          dot += q * ri[32 * s + l];
        }
        part[s / 4] += sc[s] * dot;
      }
      if (qtype == KQ4_K) {
        out[0] = part[0] + part[1];
        out[1] = minima_dot(mn, sum16 + 16 * i);
      } else {
        out[0] = part[0];
        out[1] = part[1];
        out[2] = minima_dot(mn, sum16 + 16 * i);
      }
    } else if (qtype == KQ6_K) {
      const int16_t* ri = r + 256 * i;
      const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
      int32_t part[4] = {0, 0, 0, 0};
      for (int s = 0; s < 16; ++s) {
        int32_t dot = 0;
        for (int v = 16 * s; v < 16 * s + 16; ++v) dot += (q6_value(w, v) - 32) * ri[v];
        part[2 * (s / 8) + s % 2] += sc[s] * dot;
      }
      for (int g = 0; g < 4; ++g) out[g] = part[g];
    } else {
      const int16_t* ri = r + 32 * i;
      const int32_t sum = sum16[2 * i] + sum16[2 * i + 1];
      int32_t i0 = 0, i1 = 0;
      if (qtype == KQ8_0) {
        for (int l = 0; l < 32; ++l) i0 += static_cast<int8_t>(w[2 + l]) * ri[l];
      } else {
        const bool five = qtype == KQ5_0 || qtype == KQ5_1, offset = qtype == KQ4_1 || qtype == KQ5_1;
        const uint8_t* qs = w + (offset ? 4 : 2) + (five ? 4 : 0);
        uint32_t qh = 0;
        if (five) std::memcpy(&qh, w + (offset ? 4 : 2), 4);
        for (int l = 0; l < 32; ++l) i0 += (nib32(qs, l) | (five ? ((qh >> l) & 1) << 4 : 0)) * ri[l];
        if (offset) {
          i1 = sum;
        } else {
          i0 -= (five ? 16 : 8) * sum;
        }
      }
      out[0] = i0;
      out[1] = i1;
    }
  }
}

// --- the integers, AVX2, a row at a time ------------------------------------------------------------
// The same integers from 16 values at a time widened to int16 (times their sub-block scale where
// there is one: at most 31 x 63 or 32 x 128, within int16) and madd against the int16 activations.
// Every lane sum is an exact integer (kquant.h bounds each result within int32, and the
// intermediate sums wrap exactly as int32 does), so the order of the sums changes no bit. kquant_linear
// takes these (the Python forward of a KQuantLinear); the native step's projections take the packed
// loops (kquant_packed.cpp).
#if defined(TSERVE_KQ_X86)
TSERVE_KQ_AVX2 inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// 32 weights (bytes, unsigned; signed where `sign`) times a scale, against 32 int16 activations:
// eight int32 lanes whose sum is sc * sum q r.
TSERVE_KQ_AVX2 inline __m256i dot32(__m256i q, const int16_t* r, int16_t sc, int16_t minus, bool sign) {
  const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
  __m256i w0 = sign ? _mm256_cvtepi8_epi16(q0) : _mm256_cvtepu8_epi16(q0);
  __m256i w1 = sign ? _mm256_cvtepi8_epi16(q1) : _mm256_cvtepu8_epi16(q1);
  const __m256i m = _mm256_set1_epi16(minus), s = _mm256_set1_epi16(sc);
  w0 = _mm256_mullo_epi16(_mm256_sub_epi16(w0, m), s);
  w1 = _mm256_mullo_epi16(_mm256_sub_epi16(w1, m), s);
  return _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r))),
                          _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 16))));
}

// 16 bytes of nibbles -> 32 bytes: values 0-15 (low nibbles), then 16-31 (high nibbles).
TSERVE_KQ_AVX2 inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), low = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
}

// The 32 bits of qh as bytes 0x10 (bit set) or 0 (clear), byte j for bit j.
TSERVE_KQ_AVX2 inline __m256i fifth_bits(uint32_t qh) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                          3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(qh)), spread);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
}

TSERVE_KQ_AVX2 void ints_avx2(int64_t qtype, const uint8_t* w, const int16_t* r, const int32_t* sum16, int64_t blocks,
                              int32_t* out) {
  const int64_t bytes = kq_format(qtype).bytes, per = kq_ints(qtype);
  const __m256i low = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1), three = _mm256_set1_epi8(3);
  for (int64_t i = 0; i < blocks; ++i, w += bytes, out += per) {
    for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(w + 4 * bytes + line), _MM_HINT_T0);
    if (qtype == KQ4_K || qtype == KQ5_K) {
      const int16_t* ri = r + 256 * i;
      const uint8_t* qs = w + (qtype == KQ4_K ? 16 : 48);
      int32_t sc[8], mn[8];
      scale_min_k4(w + 4, sc, mn);
      __m256i part[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      __m256i qh = qtype == KQ5_K ? loadu(w + 16) : _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i q = loadu(qs + 32 * c);
        __m256i lo = _mm256_and_si256(q, low), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
        if (qtype == KQ5_K) {  // bit 2c of qh[l] tops up value l of sub-block 2c, bit 2c + 1 of 2c + 1
          lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
          qh = _mm256_srli_epi16(qh, 1);
          hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
          qh = _mm256_srli_epi16(qh, 1);
        }
        part[c / 2] = _mm256_add_epi32(part[c / 2], dot32(lo, ri + 64 * c, static_cast<int16_t>(sc[2 * c]), 0, false));
        part[c / 2] = _mm256_add_epi32(part[c / 2], dot32(hi, ri + 64 * c + 32, static_cast<int16_t>(sc[2 * c + 1]), 0, false));
      }
      if (qtype == KQ4_K) {
        out[0] = hsum(_mm256_add_epi32(part[0], part[1]));
        out[1] = minima_dot(mn, sum16 + 16 * i);
      } else {
        out[0] = hsum(part[0]);
        out[1] = hsum(part[1]);
        out[2] = minima_dot(mn, sum16 + 16 * i);
      }
    } else if (qtype == KQ6_K) {
      const int16_t* ri = r + 256 * i;
      const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
      __m256i part[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
      for (int h = 0; h < 2; ++h) {
        const __m256i ql0 = loadu(w + 64 * h), ql1 = loadu(w + 64 * h + 32), qh = loadu(w + 128 + 32 * h);
        const __m256i nib[4] = {_mm256_and_si256(ql0, low), _mm256_and_si256(ql1, low),
                                _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low),
                                _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low)};
        for (int c = 0; c < 4; ++c) {  // values 128h + 32c ..: sub-blocks 8h + 2c (partial 2h) and + 1 (2h + 1)
          const __m256i q = _mm256_or_si256(nib[c], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), three), 4));
          const int s = 8 * h + 2 * c;
          const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
          const __m256i m32 = _mm256_set1_epi16(32);
          const __m256i w0 = _mm256_mullo_epi16(_mm256_sub_epi16(_mm256_cvtepu8_epi16(q0), m32), _mm256_set1_epi16(sc[s]));
          const __m256i w1 = _mm256_mullo_epi16(_mm256_sub_epi16(_mm256_cvtepu8_epi16(q1), m32), _mm256_set1_epi16(sc[s + 1]));
          const int16_t* rv = ri + 128 * h + 32 * c;
          part[2 * h] = _mm256_add_epi32(part[2 * h], _mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rv))));
          part[2 * h + 1] = _mm256_add_epi32(part[2 * h + 1], _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rv + 16))));
        }
      }
      for (int g = 0; g < 4; ++g) out[g] = hsum(part[g]);
    } else {
      const int16_t* ri = r + 32 * i;
      const int32_t sum = sum16[2 * i] + sum16[2 * i + 1];
      if (qtype == KQ8_0) {
        out[0] = hsum(dot32(loadu(w + 2), ri, 1, 0, true));
        out[1] = 0;
        continue;
      }
      const bool five = qtype == KQ5_0 || qtype == KQ5_1, offset = qtype == KQ4_1 || qtype == KQ5_1;
      __m256i q = nibbles32(w + (offset ? 4 : 2) + (five ? 4 : 0));
      if (five) {
        uint32_t qh;
        std::memcpy(&qh, w + (offset ? 4 : 2), 4);
        q = _mm256_or_si256(q, fifth_bits(qh));
      }
      const int32_t dot = hsum(dot32(q, ri, 1, 0, false));
      out[0] = offset ? dot : dot - (five ? 16 : 8) * sum;
      out[1] = offset ? sum : 0;
    }
  }
}
#endif

// --- one float combination for every path ----------------------------------------------------------
// Row sum over blocks in order: acc = fma(d s_a, i, acc) for each of the block's scaled integers in
// order, then the minima / offsets term.
float combine(int64_t qtype, const uint8_t* w, const int32_t* ints, const float* scale, int64_t blocks) {
  const int64_t bytes = kq_format(qtype).bytes, per = kq_ints(qtype);
  float acc = 0.0f;
  for (int64_t i = 0; i < blocks; ++i, w += bytes, ints += per) {
    const float sa = scale[i];
    switch (qtype) {
      case KQ4_K:
      case KQ5_K: {
        const float dd = kq_half(w) * sa, dm = kq_half(w + 2) * sa;
        for (int64_t p = 0; p + 1 < per; ++p) acc = std::fma(dd, static_cast<float>(ints[p]), acc);
        acc = std::fma(-dm, static_cast<float>(ints[per - 1]), acc);
        break;
      }
      case KQ6_K: {
        const float dd = kq_half(w + 208) * sa;
        for (int64_t p = 0; p < 4; ++p) acc = std::fma(dd, static_cast<float>(ints[p]), acc);
        break;
      }
      case KQ4_1:
      case KQ5_1: {
        const float dd = kq_half(w) * sa, mm = kq_half(w + 2) * sa;
        acc = std::fma(dd, static_cast<float>(ints[0]), acc);
        acc = std::fma(mm, static_cast<float>(ints[1]), acc);
        break;
      }
      default: {
        const float dd = kq_half(w) * sa;
        acc = std::fma(dd, static_cast<float>(ints[0]), acc);
      }
    }
  }
  return acc;
}

using IntsFn = void (*)(int64_t, const uint8_t*, const int16_t*, const int32_t*, int64_t, int32_t*);

bool isa_runs(int64_t isa) {
  if (isa == KQ_SCALAR) return true;
  if (isa == KQ_PACKED) return kq_packed_runs();
#if defined(TSERVE_KQ_X86)
  if (isa == KQ_AVX2) return __builtin_cpu_supports("avx2");
#endif
  return false;
}

// The default, read once: TSERVE_NATIVE_ISA=scalar forces the scalar loops (to check that a
// result does not depend on the vector units), else the best this build and CPU have.
int64_t default_isa() {
  static const int64_t chosen = [] {
    const char* env = std::getenv("TSERVE_NATIVE_ISA");
    if (env != nullptr && std::string(env) == "scalar") return KQ_SCALAR;
    return isa_runs(KQ_AVX2) ? KQ_AVX2 : KQ_SCALAR;
  }();
  return chosen;
}

IntsFn ints_for(int64_t isa) {
#if defined(TSERVE_KQ_X86)
  if (isa == KQ_AVX2) return ints_avx2;
#endif
  return ints_scalar;
}

// A projection's repacked bytes, with the kernel asked for 2 MB pages over every whole 2 MB span
// inside them (MADV_HUGEPAGE before the first write: transparent huge pages in "madvise" mode or
// "always"; where that fails or they are off, nothing changes). A decode step streams every byte
// once a token (1 GB on the 1.5B), and on 4 KB pages that is a page walk every 4 KB: in-process
// the 1.5B's one-row step took 0.85-0.91x the time (docs/benchmarks.md; ~70 % of its bytes
// on 2 MB pages: a projection under 4 MB may have no whole span). The same bytes and memory.
Tensor packed_buffer(int64_t bytes, const at::TensorOptions& options) {
  Tensor t = at::empty({bytes}, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t huge = uintptr_t{2} << 20;
  const uintptr_t start = reinterpret_cast<uintptr_t>(t.data_ptr<uint8_t>());
  const uintptr_t lo = (start + huge - 1) / huge * huge, hi = (start + static_cast<uintptr_t>(bytes)) / huge * huge;
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#endif
  return t;
}

// Work over `partner` where there is one and torch runs on one thread (a step of the native
// decoder), else over torch's threads: n items in chunks of `chunk`.
void kq_share(Partner* partner, int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& f) {
  if (partner != nullptr && at::get_num_threads() == 1) {
    partner->run((n + chunk - 1) / chunk, [&](int64_t c) { f(c * chunk, std::min(n, (c + 1) * chunk)); });
  } else {
    at::parallel_for(0, n, chunk, f);
  }
}

// x (B, k) quantized per block of `block`, rows shared among the threads (each row alone).
void kq_quantize(KqActs& a, const float* x, int64_t B, int64_t k, int64_t block, Partner* partner) {
  a.size(B, k, block);
  kq_share(partner, B, std::max<int64_t>(1, 16384 / k), [&](int64_t b0, int64_t b1) { a.quantize(x, b0, b1, k, block); });
}

// y[:, 0:n) (rows `stride` apart) = x W^T for one part (`a`: x quantized per this type's block):
// outputs in chunks of kq_chunk(n), shared as kq_share does: up to 128 outputs (16 tiles) rather
// than 16, since each chunk is a claim on the partner's shared word and a cold start for the
// prefetches (at one row the 1.5B's step took ~15 % less time, in-process, 2 threads, alternated;
// 256 gave the same as 128), but at least 8 chunks a projection where it has 128 outputs or more,
// so that a small model's projections (SmolLM2's 576 outputs: 5 chunks of 128) still split evenly
// between the two threads. Multiples of 8: whole tiles. Each (row, output) is computed alone,
// so neither the chunking nor the loops chosen change a bit.
constexpr int64_t KQ_CHUNK = 128;
int64_t kq_chunk(int64_t n) { return std::min<int64_t>(KQ_CHUNK, std::max<int64_t>(16, n / 64 * 8)); }

void kq_part(const KqActs& a, int64_t B, int64_t k, const uint8_t* w, int64_t qtype, int64_t n, int64_t isa,
             const float* bias, Partner* partner, float* y, int64_t stride, const uint8_t* packed = nullptr) {
  const KqFormat f = kq_format(qtype);
  const int64_t blocks = k / f.values, row = blocks * f.bytes;
  const IntsFn ints = ints_for(isa);
  if (packed != nullptr) {  // chunks are whole tiles of 8
    kq_share(partner, n, kq_chunk(n), [&](int64_t j0, int64_t j1) { kq_packed_rows(a, B, k, packed, qtype, j0, j1, bias, y, stride); });
    return;
  }
  kq_share(partner, n, kq_chunk(n), [&](int64_t j0, int64_t j1) {
    thread_local std::vector<int32_t> buf;  // per-block sums, reused: no allocation per chunk of outputs
    buf.resize(kq_ints(qtype) * blocks);
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t bi = 0; bi < B; ++bi) {
        ints(qtype, w + j * row, a.r.data() + bi * k, a.sum16.data() + bi * k / 16, blocks, buf.data());
        const float v = combine(qtype, w + j * row, buf.data(), a.scale.data() + bi * blocks, blocks);
        y[bi * stride + j] = bias == nullptr ? v : v + bias[j];
      }
  });
}

void check_part(const Tensor& raw, int64_t qtype, int64_t n, int64_t k) {
  const KqFormat f = kq_format(qtype);
  TORCH_CHECK(f.values > 0, "GGUF type ", qtype, " is not one the block kernels read");
  TORCH_CHECK(n > 0 && k > 0 && k % f.values == 0, "inputs must be a positive multiple of ", f.values, ", got ", k);
  const int64_t row = k / f.values * f.bytes;
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.numel() == n * row,
              "raw must be a contiguous uint8 CPU tensor of ", n, " rows of ", row, " bytes");
}

}  // namespace

void kquant_dequantize_row(int64_t qtype, const uint8_t* row, int64_t k, float* out) {
  // the same float operations, in the same order, as kquant.py's _dequantize_blocks (built with
  // -ffp-contract=off: no product is fused into the sum that follows it)
  const KqFormat f = kq_format(qtype);
  TORCH_CHECK(f.values > 0 && k % f.values == 0, "GGUF type ", qtype, " rows of ", k, " are not read");
  for (int64_t b = 0; b < k / f.values; ++b, row += f.bytes, out += f.values) {
    const uint8_t* w = row;
    switch (qtype) {
      case KQ8_0: {
        const float d = kq_half(w);
        for (int l = 0; l < 32; ++l) out[l] = static_cast<float>(static_cast<int8_t>(w[2 + l])) * d;
        break;
      }
      case KQ4_0: case KQ4_1: {
        const float d = kq_half(w);
        const uint8_t* qs = w + (qtype == KQ4_0 ? 2 : 4);
        for (int l = 0; l < 32; ++l) {
          const int32_t q = nib32(qs, l);
          out[l] = qtype == KQ4_0 ? d * static_cast<float>(q - 8) : d * static_cast<float>(q) + kq_half(w + 2);
        }
        break;
      }
      case KQ5_0: case KQ5_1: {
        const float d = kq_half(w);
        const int at = qtype == KQ5_0 ? 2 : 4;
        uint32_t qh;
        std::memcpy(&qh, w + at, 4);
        for (int l = 0; l < 32; ++l) {
          const int32_t q = nib32(w + at + 4, l) | static_cast<int32_t>(((qh >> l) & 1u) << 4);
          out[l] = qtype == KQ5_0 ? d * static_cast<float>(q - 16) : d * static_cast<float>(q) + kq_half(w + 2);
        }
        break;
      }
      case KQ4_K: case KQ5_K: {
        int32_t sc[8], mn[8];
        scale_min_k4(w + 4, sc, mn);
        const float d = kq_half(w), dmin = kq_half(w + 2);
        const uint8_t* qs = w + (qtype == KQ4_K ? 16 : 48);
        for (int s = 0; s < 8; ++s) {
          const float ds = d * static_cast<float>(sc[s]), ms = dmin * static_cast<float>(mn[s]);
          for (int l = 0; l < 32; ++l) {  // sub-block s: nibbles (low for even s) of bytes 32 (s / 2) + l
            int32_t q = (s % 2 ? qs[32 * (s / 2) + l] >> 4 : qs[32 * (s / 2) + l] & 15);
            if (qtype == KQ5_K) q |= ((w[16 + l] >> s) & 1) << 4;
            out[32 * s + l] = ds * static_cast<float>(q) - ms;
          }
        }
        break;
      }
      case KQ6_K: {
        const float d = kq_half(w + 208);
        for (int h = 0; h < 2; ++h) {
          const uint8_t* ql = w + 64 * h;
          const uint8_t* qh = w + 128 + 32 * h;
          for (int c = 0; c < 4; ++c)
            for (int l = 0; l < 32; ++l) {
              const int32_t low = c < 2 ? ql[32 * c + l] & 15 : ql[32 * (c - 2) + l] >> 4;
              const int32_t q = (low | (((qh[l] >> (2 * c)) & 3) << 4)) - 32;
              const int64_t v = 128 * h + 32 * c + l;
              const float s = d * static_cast<float>(static_cast<int8_t>(w[192 + v / 16]));
              out[v] = s * static_cast<float>(q);
            }
        }
        break;
      }
      default: TORCH_CHECK(false, "GGUF type ", qtype, " is not one the block kernels read");
    }
  }
}

int64_t kquant_row_bytes(int64_t qtype, int64_t k) {
  const KqFormat f = kq_format(qtype);
  return f.values > 0 && k > 0 && k % f.values == 0 ? k / f.values * f.bytes : 0;
}

Tensor kquant_rows(Tensor raw, int64_t qtype, int64_t k, Tensor ids) {
  const int64_t row = kquant_row_bytes(qtype, k);
  TORCH_CHECK(row > 0, "GGUF type ", qtype, " rows of ", k, " are not read");
  TORCH_CHECK(raw.device().is_cpu() && raw.scalar_type() == at::kByte && raw.is_contiguous() && raw.numel() % row == 0,
              "raw must be a contiguous uint8 CPU tensor of rows of ", row, " bytes");
  const int64_t n = raw.numel() / row;
  const Tensor idc = ids.to(at::kLong).contiguous().view({-1});
  Tensor out = at::empty({idc.numel(), k}, at::TensorOptions().dtype(at::kFloat));
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < idc.numel(); ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < n, "row ", id[i], " out of range [0, ", n, ")");
    kquant_dequantize_row(qtype, raw.data_ptr<uint8_t>() + id[i] * row, k, out.data_ptr<float>() + i * k);
  }
  return out;
}

int64_t kquant_isa(int64_t isa) {
  if (isa == KQ_AUTO) return default_isa();
  return isa_runs(isa) ? isa : -1;
}

Tensor kquant_linear(Tensor x, Tensor raw, int64_t qtype, int64_t n, int64_t k, c10::optional<Tensor> bias,
                     int64_t isa) {
  check_part(raw, qtype, n, k);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be (B, ", k, ") float32");
  const int64_t chosen = isa == KQ_AUTO ? default_isa() : isa;
  TORCH_CHECK(isa_runs(chosen), "the block kernels' loops ", isa, " are not available in this build or on this CPU");
  std::vector<float> b;
  if (bias) b = to_vector(*bias, n, "bias");
  const Tensor xc = x.contiguous();
  Tensor y = at::empty({xc.size(0), n}, xc.options());
  Tensor packed;
  if (chosen == KQ_PACKED) {
    TORCH_CHECK(kq_packed_type(qtype), "GGUF type ", qtype, " is not one the packed loops read");
    packed = at::empty({kq_packed_bytes(qtype, n, k)}, raw.options());
    kq_pack(raw.data_ptr<uint8_t>(), qtype, n, k, packed.data_ptr<uint8_t>());
  }
  KqActs a;
  kq_quantize(a, xc.data_ptr<float>(), xc.size(0), k, kq_format(qtype).values, nullptr);
  kq_part(a, xc.size(0), k, raw.data_ptr<uint8_t>(), qtype, n, chosen, b.empty() ? nullptr : b.data(), nullptr,
          y.data_ptr<float>(), n, packed.defined() ? packed.data_ptr<uint8_t>() : nullptr);
  return y;
}

Projection kquant_projection(const std::vector<Tensor>& raw, const std::vector<int64_t>& qtype,
                             const std::vector<int64_t>& n, int64_t k, const c10::optional<Tensor>& bias) {
  TORCH_CHECK(!raw.empty() && raw.size() == qtype.size() && raw.size() == n.size(),
              "a GGUF projection needs one type and output count per part");
  Projection p;
  int64_t total = 0;
  for (size_t i = 0; i < raw.size(); ++i) {
    check_part(raw[i], qtype[i], n[i], k);
    total += n[i];
  }
  p.kq_raw = raw;
  // Every part repacked once where the default loops are AVX2 (not under TSERVE_NATIVE_ISA=scalar):
  // the packed loops give the same bits at every batch.
  for (size_t i = 0; i < raw.size(); ++i) {
    Tensor packed;
    if (default_isa() == KQ_AVX2 && kq_packed_runs() && kq_packed_bytes(qtype[i], n[i], k) > 0) {
      packed = packed_buffer(kq_packed_bytes(qtype[i], n[i], k), raw[i].options());
      kq_pack(raw[i].data_ptr<uint8_t>(), qtype[i], n[i], k, packed.data_ptr<uint8_t>());
    }
    p.kq_packed.push_back(packed);
  }
  p.kq_type = qtype;
  p.kq_n = n;
  p.kq_k = k;
  if (bias) p.kq_bias = to_vector(*bias, total, "bias");
  return p;
}

Tensor Projection::kq_rows(const Tensor& x) const {
  TORCH_CHECK(x.size(1) == kq_k, "a GGUF projection of ", kq_k, " inputs got ", x.size(1));
  int64_t total = 0;
  for (int64_t n : kq_n) total += n;
  const int64_t B = x.size(0);
  Tensor y = at::empty({B, total}, x.options());
  float* yp = y.data_ptr<float>();
  const float* bias = kq_bias.empty() ? nullptr : kq_bias.data();
  KqActs acts[2];  // x quantized per 256 and per 32, each when a part first needs it
  int64_t first = 0;  // the part's first output
  for (size_t i = 0; i < kq_raw.size(); ++i) {
    const int64_t block = kq_format(kq_type[i]).values;
    KqActs& a = acts[block == 256 ? 0 : 1];
    if (a.empty()) kq_quantize(a, x.data_ptr<float>(), B, kq_k, block, kq_partner);
    const Tensor& packed = kq_packed[i];
    kq_part(a, B, kq_k, kq_raw[i].data_ptr<uint8_t>(), kq_type[i], kq_n[i], default_isa(),
            bias == nullptr ? nullptr : bias + first, kq_partner, yp + first, total,
            packed.defined() ? packed.data_ptr<uint8_t>() : nullptr);
    first += kq_n[i];
  }
  return y;
}

}  // namespace tserve_native
