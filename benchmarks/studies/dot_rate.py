"""How many integer dot-product instructions this CPU retires a second, and what that makes the
compute floor of a GGUF model's step: the bound that batches and prompts meet once the weight bytes
stop being the limit.

    python -m benchmarks.studies.dot_rate [--gguf FILE.gguf] [--batches 1 8 32 512] [--threads 2]

A small C loop (compiled here with gcc) issues independent 512-bit ``vpdpwssd`` (32 int16 products:
our 14-bit activations against int16 weights), ``vpdpbusd`` (64 byte products: 8-bit activations,
llama.cpp's Q8_K path, or one byte half of ours) and 256-bit ``vpdpbusd`` on ``--threads`` threads,
where the CPU has AVX512-VNNI; elsewhere AVX2's ``pmaddwd`` and ``pmaddubsw``. With ``--gguf`` it
counts the file's multiply-adds per token (every 2-D weight but the token embeddings; the tied
head counted once) and prints, per batch, the milliseconds a step cannot go under at that rate:
14-bit activations take two byte products or one int16 product per multiply-add, so their floor
is the int16 rate's; 8-bit activations' is the byte rate's. A floor, not a prediction: loads,
the rest of the step and memory come on top.
"""
from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define N 100000000L
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

#if defined(__AVX512VNNI__)
#define V __m512i
#define ZERO _mm512_setzero_si512()
#define WIDE(acc) asm volatile("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x))
#define BYTE(acc) asm volatile("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x))
#define HALF(acc) asm volatile("vpdpbusd %2, %1, %0" : "+v"(acc##y) : "v"(wy), "v"(xy))
#define NAMES "zmm vpdpwssd (32 int16 products)", "zmm vpdpbusd (64 byte products)", "ymm vpdpbusd (32 byte products)"
static const int PRODUCTS[3] = {32, 64, 32};
#else
#define V __m256i
#define ZERO _mm256_setzero_si256()
#define WIDE(acc) asm volatile("vpmaddwd %2, %1, %0" : "=v"(acc) : "v"(w), "v"(x))
#define BYTE(acc) asm volatile("vpmaddubsw %2, %1, %0" : "=v"(acc) : "v"(w), "v"(x))
#define HALF(acc) BYTE(acc)
#define NAMES "ymm pmaddwd (16 int16 products)", "ymm pmaddubsw (32 byte products)", "ymm pmaddubsw (32 byte products)"
static const int PRODUCTS[3] = {16, 32, 32};
#endif

static int kind;
static void* spin(void* unused) {
  (void)unused;
  V w = ZERO, x = ZERO, a0 = ZERO, a1 = ZERO, a2 = ZERO, a3 = ZERO, a4 = ZERO, a5 = ZERO, a6 = ZERO, a7 = ZERO,
    a8 = ZERO, a9 = ZERO, a10 = ZERO, a11 = ZERO;
  __m256i wy = _mm256_setzero_si256(), xy = wy, a0y = wy, a1y = wy, a2y = wy, a3y = wy, a4y = wy, a5y = wy,
    a6y = wy, a7y = wy, a8y = wy, a9y = wy, a10y = wy, a11y = wy;
  (void)xy; (void)a0y; (void)a1y; (void)a2y; (void)a3y; (void)a4y; (void)a5y; (void)a6y; (void)a7y; (void)a8y;
  (void)a9y; (void)a10y; (void)a11y;
#define TWELVE(OP) OP(a0); OP(a1); OP(a2); OP(a3); OP(a4); OP(a5); OP(a6); OP(a7); OP(a8); OP(a9); OP(a10); OP(a11);
  for (long i = 0; i < N; ++i) {
    if (kind == 0) { TWELVE(WIDE) } else if (kind == 1) { TWELVE(BYTE) } else { TWELVE(HALF) }
  }
  return NULL;
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? atoi(argv[1]) : 1;
  const char* names[3] = {NAMES};
  for (kind = 0; kind < 3; ++kind) {
    pthread_t t[64];
    const double t0 = now();
    for (int i = 0; i < threads; ++i) pthread_create(&t[i], NULL, spin, NULL);
    for (int i = 0; i < threads; ++i) pthread_join(t[i], NULL);
    const double s = now() - t0;
    const double per_s = 12.0 * N * threads / s;
    printf("%s\t%.3f\t%.1f\n", names[kind], per_s / 1e9, per_s * PRODUCTS[kind] / 1e9);
  }
  return 0;
}
"""


def has_vnni() -> bool:
    flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split()
    return "avx512_vnni" in flags and "avx512vl" in flags


def rates(threads: int) -> list[tuple[str, float, float]]:
    """(instruction, G instructions/s, G products/s) over ``threads`` threads."""
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "rate.c", Path(tmp) / "rate"
        src.write_text(SOURCE)
        isa = ["-mavx512f", "-mavx512vl", "-mavx512vnni"] if has_vnni() else ["-mavx2"]
        subprocess.run(["gcc", "-O2", *isa, str(src), "-o", str(exe), "-lpthread"], check=True)
        out = subprocess.run([str(exe), str(threads)], check=True, capture_output=True, text=True).stdout
    rows = []
    for line in out.strip().splitlines():
        name, per_s, products = line.split("\t")
        rows.append((name, float(per_s), float(products)))
    return rows


def multiply_adds(path: str) -> int:
    """Multiply-adds per token: every 2-D weight but the token embeddings (the head once)."""
    from gguf import GGUFReader

    tensors = GGUFReader(path).tensors
    names = {t.name for t in tensors}
    total = 0
    for t in tensors:
        if len(t.shape) != 2:
            continue
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue  # an untied head is output.weight; the embeddings are a lookup
        total += int(t.shape[0]) * int(t.shape[1])
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 512])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    measured = rates(args.threads)
    print(f"{args.threads} thread(s):")
    for name, per_s, products in measured:
        print(f"  {name}: {per_s:.2f} G instructions/s, {products:.1f} G products/s")
    if args.gguf:
        macs = multiply_adds(args.gguf)
        wide, byte = measured[0][2], measured[1][2] / 2  # 14-bit: one int16 product or two byte ones
        eight = measured[1][2]
        print(f"{Path(args.gguf).name}: {macs / 1e9:.3f} G multiply-adds a token")
        for b in args.batches:
            print(f"  {b} rows: floor {macs * b / max(wide, byte) / 1e6:.1f} ms (14-bit activations), "
                  f"{macs * b / eight / 1e6:.1f} ms (8-bit)")


if __name__ == "__main__":
    main()
