"""How fast one core streams weights while it computes on them (in-process, a component).

The floor share of ``served_vs_llama_server --floor`` divides a batch-1 step's weight bytes by
torch's plain read bandwidth (a float32 sum: one load a value, nothing else). A decode step does
more than read: each 64-byte line it loads feeds some vector work (unpacking, products, scales)
before the next lines are needed. This study measures what that costs the stream on this CPU, with
no model in the way: a small C++ loop (compiled here with the system's ``c++``) reads a buffer far
larger than the caches and spends ``work`` dependent-free ``vpdpbusd`` on each line (AVX-512 VNNI;
on a CPU without it, ``vpmaddubsw`` + ``vpaddd`` pairs on 256-bit vectors), with no software
prefetch, or with ``prefetcht0`` / ``prefetcht1`` a fixed distance ahead. Each figure is the best
of a few passes, one thread; the same loop over a buffer that fits in L1 gives the work's own rate.

    python -m benchmarks.studies.stream_ceiling [--mib 512] [--work 0 4 8 16] [--json PATH]

What it showed on the 2-core Sapphire Rapids VM (2026-11-30; docs/benchmarks.md, "Tiles from 9
rows, and what one core streams while it computes"): 12.3-14.7 GB/s with no work, 9.1-11.1 with 4
products a line, 4.6-5.5 with 16, where 16 is also the work's own rate in L1: the stream and the
work overlap only in part, so a step that does any work on its bytes reads below torch's sum.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define UNIT "avx512-vnni"
typedef __m512i V;
static inline V vzero() { return _mm512_setzero_si512(); }
static inline V vload(const uint8_t* p) { return _mm512_loadu_si512(p); }
static inline V vwork(V acc, V v, V b) { return _mm512_dpbusd_epi32(acc, v, b); }
static inline V vadd(V a, V b) { return _mm512_add_epi32(a, b); }
static inline V vset(int x) { return _mm512_set1_epi8(static_cast<char>(x)); }
static inline long long vsum(V v) { return _mm512_reduce_add_epi32(v); }
static const int STEP = 64;
#else
#define UNIT "avx2"
typedef __m256i V;
static inline V vzero() { return _mm256_setzero_si256(); }
static inline V vload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
static inline V vwork(V acc, V v, V b) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(v, b), _mm256_set1_epi16(1)));
}
static inline V vadd(V a, V b) { return _mm256_add_epi32(a, b); }
static inline V vset(int x) { return _mm256_set1_epi8(static_cast<char>(x)); }
static inline long long vsum(V v) {
  alignas(32) int32_t t[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t), v);
  long long s = 0;
  for (int i = 0; i < 8; ++i) s += t[i];
  return s;
}
static const int STEP = 32;
#endif

// mode 0: no software prefetch; 1: prefetcht0 `dist` bytes ahead; 2: prefetcht1
static double pass(const uint8_t* buf, size_t n, int work, int mode, int dist, int reps, long long* sink) {
  V acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = vzero();
  const V b = vset(3);
  auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r)
    for (size_t off = 0; off < n; off += 256) {
      for (int l = 0; l < 256; l += 64) {
        if (mode == 1) _mm_prefetch(reinterpret_cast<const char*>(buf + off + dist + l), _MM_HINT_T0);
        if (mode == 2) _mm_prefetch(reinterpret_cast<const char*>(buf + off + dist + l), _MM_HINT_T1);
      }
      for (int l = 0; l < 256; l += STEP) {
        const V v = vload(buf + off + l);
        if (work == 0) acc[(l / STEP) & 7] = vadd(acc[(l / STEP) & 7], v);
        for (int w = 0; w < work * STEP / 64; ++w) acc[w & 7] = vwork(acc[w & 7], v, b);
      }
    }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  V t = acc[0];
  for (int i = 1; i < 8; ++i) t = vadd(t, acc[i]);
  *sink += vsum(t);
  return double(n) * reps / s / 1e9;
}

int main(int argc, char** argv) {
  const size_t n = size_t(atol(argv[1])) << 20;
  const int passes = atoi(argv[2]);
  uint8_t* buf = static_cast<uint8_t*>(aligned_alloc(4096, n + (1 << 20)));
  memset(buf, 1, n + (1 << 20));
  const size_t small = 32 << 10;
  long long sink = 0;
  printf("{\"unit\": \"%s\", \"rows\": [", UNIT);
  bool first = true;
  for (int a = 3; a < argc; ++a) {
    const int work = atoi(argv[a]);
    const int modes[][2] = {{0, 0}, {1, 2048}, {2, 2048}};
    for (const auto& m : modes) {
      double best = 0;
      for (int p = 0; p < passes; ++p) {
        const double g = pass(buf, n, work, m[0], m[1], 1, &sink);
        if (g > best) best = g;
      }
      printf("%s{\"work\": %d, \"prefetch\": \"%s\", \"gb_s\": %.3f}", first ? "" : ", ", work,
             m[0] == 0 ? "none" : m[0] == 1 ? "t0 2 KB" : "t1 2 KB", best);
      first = false;
    }
    const double hot = pass(buf, small, work, 0, 0, int((size_t(256) << 20) / small), &sink);
    printf(", {\"work\": %d, \"prefetch\": \"in L1\", \"gb_s\": %.3f}", work, hot);
  }
  printf("], \"sink\": %lld}\n", sink & 1);
  return 0;
}
"""


def build(directory: Path) -> Path:
    """The loop compiled for this CPU (``-march=native``) into ``directory``."""
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise SystemExit("no C++ compiler (c++ or g++) on PATH")
    source, binary = directory / "stream_ceiling.cpp", directory / "stream_ceiling"
    source.write_text(SOURCE)
    subprocess.run([compiler, "-O2", "-march=native", "-o", str(binary), str(source)], check=True)
    return binary


def measure(mib: int = 512, work: tuple[int, ...] = (0, 4, 8, 16), passes: int = 3) -> dict:
    """GB/s one thread streams at each amount of work a line and each prefetch, and in L1."""
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(Path(tmp))
        done = subprocess.run([str(binary), str(mib), str(passes), *map(str, work)], check=True,
                              capture_output=True, text=True)
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.stream_ceiling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="the streamed buffer's size (far above the caches)")
    parser.add_argument("--work", type=int, nargs="+", default=[0, 4, 8, 16],
                        help="vpdpbusd (or the AVX2 pair) per 64-byte line")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from benchmarks.harness.machine import read_bandwidth

    report = measure(args.mib, tuple(args.work), args.passes)
    report["torch_read_1_thread_gb_s"] = read_bandwidth(1) / 1e9
    print(f"vector unit: {report['unit']}; torch's read at one thread: {report['torch_read_1_thread_gb_s']:.2f} GB/s")
    print("| work a line | prefetch | GB/s | share of torch's read |")
    print("|---|---|---|---|")
    for row in report["rows"]:
        print(f"| {row['work']} | {row['prefetch']} | {row['gb_s']:.2f} | "
              f"{row['gb_s'] / report['torch_read_1_thread_gb_s']:.0%} |")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
