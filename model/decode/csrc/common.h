// What every file of the native decode step shares: the includes, which vector units this CPU has
// (detected once, here), bfloat16 bits and small maths helpers used inside hot loops.
//
// Files, by kind of kernel (model/decode/native.py compiles every .cpp here into one library):
//   partner.*       the second thread that shares a step of a few rows
//   projection.h    one projection's weights in any of its formats, and which path a call takes
//   q4.*            4-bit weights (GGUF Q4_0 / Q4_1 runs): layout, activation quantizing, kernels
//   kquant.*        GGUF blocks as stored (Q4_K, Q5_K, Q6_K, Q8_0, Q4/5_0/1): KQuantLinear's kernels
//   int8.*          fbgemm int8 weights with each row quantized on its own; the Int8Linear class
//   attention.*     decode attention over the paged KV cache, row by row
//   prompt_attention.cpp  a prompt's rows attending as a block (torch's flash attention, or
//                   the AVX512-BF16 kernel over a bfloat16 cache)
//   llama_step.*    the Llama-architecture decoder (LlamaDecoder)
//   encdec_step.*   an encoder-decoder's decoder (EncDecDecoder: Marian and its like)
//   ops.*           the free operators (q4_linear, paged / cross decode attention)
//   register.cpp    the torch registration (TORCH_LIBRARY tserve_native)
//
// Shapes used throughout: B rows (one new token each), d model width, nh query heads, nkv key/value
// heads, hs head size, ff feed-forward width, BL positions per cache block. The cache is a pool of
// blocks (layers, nkv, blocks, BL, hs); row b's position p lies in block tables[b, p / BL] at
// offset p % BL.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

// The AVX-512 kernels are compiled whatever the build flags (function target attributes) and
// chosen at run time by what the CPU supports (cpu() below), so a portable build (the
// container's) still uses them on a CPU that has them.
#if defined(__GNUC__) && defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TSERVE_AVX512 1
#define TSERVE_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define TSERVE_TARGET_AVX512 __attribute__((target("avx512f")))
#define TSERVE_TARGET_AVX512_FMA __attribute__((target("avx512f,avx2,fma")))
#define TSERVE_TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define TSERVE_TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#endif

namespace tserve_native {

using at::Tensor;

// The vector units this CPU has, read once per process. Every kernel with a vector variant asks
// here; without TSERVE_AVX512 (not GCC/Clang on x86-64) all are false and the plain loops run.
// TSERVE_NATIVE_ISA=scalar turns them all off (the plain loops only), so a test can compare: every
// vector kernel computes the plain loops' bits (the build's own auto-vectorized loops do too, as
// it never reassociates and -ffp-contract=off fuses nothing the source does not).
// TSERVE_NATIVE_ISA=avx2 turns the AVX-512 ones off, so a CPU that has them checks the AVX2 ones too;
// TSERVE_NATIVE_ISA=avx512 turns AMX off, likewise.
struct CpuFeatures {
  bool avx2 = false;  // AVX2 and FMA: attention (attention.cpp)
  bool avx512 = false;  // AVX-512F: decode attention, the int8 row passes
  bool avx512_vnni = false;  // and AVX512-BW, VNNI: the 4-bit kernel
  bool avx512_bf16 = false;  // and AVX512-BW, BF16: prompt attention over a bfloat16 cache
  bool amx_int8 = false;  // and AMX tiles with int8 products, granted by the kernel: K-quant prompts
};

#if defined(TSERVE_AVX512)
// AMX: the CPU says it has the tiles and int8 products (CPUID 7.0 EDX bits 24, 25), the OS
// saves their state (XCR0 bits 17, 18), this process is granted it (Linux's
// ARCH_REQ_XCOMP_PERM for XTILEDATA), and a tile instruction runs: a virtual machine may
// advertise AMX and still fault on it, so one configuration load and one zeroing run under a
// SIGILL handler first (on the thread that asks first, once per process).
namespace amx_probe {
inline sigjmp_buf& jump() {
  static sigjmp_buf j;
  return j;
}
inline void on_sigill(int) { siglongjmp(jump(), 1); }
__attribute__((target("amx-tile"), noinline)) inline void touch_tiles() {
  struct alignas(64) {
    uint8_t b[64];
  } config = {};
  config.b[0] = 1;  // palette 1
  config.b[16] = 64;  // tile 0: 64 bytes a row
  config.b[48] = 1;  // tile 0: one row
  // as asm reading the whole 64 bytes: GCC 12 takes _tile_loadconfig for a read of none of
  // them and drops the stores above
  asm volatile("ldtilecfg %0" : : "m"(config));
  _tile_zero(0);
  _tile_release();
}
}  // namespace amx_probe

inline bool amx_usable() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || ((d >> 24) & 3u) != 3u) return false;
  if (!__builtin_cpu_supports("osxsave")) return false;
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if (((lo >> 17) & 3u) != 3u) return false;
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) return false;
  struct sigaction mine = {}, before = {};
  mine.sa_handler = amx_probe::on_sigill;
  sigemptyset(&mine.sa_mask);
  if (sigaction(SIGILL, &mine, &before) != 0) return false;
  bool ran = false;
  if (sigsetjmp(amx_probe::jump(), 1) == 0) {
    amx_probe::touch_tiles();
    ran = true;
  }
  sigaction(SIGILL, &before, nullptr);
  return ran;
}
#endif

// An IEEE half to float, bit by bit (exact; subnormals normalised): GGUF's block scales and q4's.
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

inline const CpuFeatures& cpu() {
  static const CpuFeatures features = [] {
    CpuFeatures f;
#if defined(TSERVE_AVX512)
    const char* isa = std::getenv("TSERVE_NATIVE_ISA");
    if (isa != nullptr && std::strcmp(isa, "scalar") == 0) return f;
    f.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (isa != nullptr && std::strcmp(isa, "avx2") == 0) return f;  // AVX-512 off (to compare)
    f.avx512 = __builtin_cpu_supports("avx512f");
    f.avx512_vnni = f.avx512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
    f.avx512_bf16 = f.avx512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16");
    if (isa != nullptr && std::strcmp(isa, "avx512") == 0) return f;  // AMX off (to compare)
    f.amx_int8 = f.avx512_vnni && amx_usable();
#endif
    return f;
  }();
  return features;
}

// The KV cache holds float32 or bfloat16 (as uint16_t bits). bfloat16 is the top half of a
// float32, rounded to nearest even as torch's own conversion rounds, so a row written here
// equals the row the Python path writes.
static inline float to_float(float x) { return x; }
static inline float to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
static inline void store(float x, float* dst) { *dst = x; }
static inline void store(float x, uint16_t* dst) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a (quiet) NaN
    *dst = 0x7fc0;
    return;
  }
  *dst = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// One cache row as float32: the row itself, or its conversion into `scratch`.
static inline const float* row_as_float(const float* row, float*, int64_t) { return row; }
static inline const float* row_as_float(const uint16_t* row, float* scratch, int64_t n) {
  for (int64_t i = 0; i < n; ++i) scratch[i] = to_float(row[i]);
  return scratch;
}

// Dot product written as 16 independent lanes, so the compiler vectorises it without
// reassociating a single sum (no -ffast-math needed).
static inline float dot(const float* a, const float* b, int64_t n) {
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
static inline float fast_exp(float x) {
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

#if defined(TSERVE_AVX512)
// 16 floats from float32, or from bfloat16 bits (the top half of float32).
TSERVE_TARGET_AVX512 static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
TSERVE_TARGET_AVX512 static inline __m512 load16(const uint16_t* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// exp(x) for x <= 0: 2^k e^r with k = round(x / ln 2), |r| <= ln(2) / 2, e^r by its Taylor
// series to r^6 (relative error ~1.2e-7), 2^k applied exactly by scalef.
TSERVE_TARGET_AVX512 static inline __m512 exp_nonpositive(__m512 x) {
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
#endif

}  // namespace tserve_native
