"""Benchmarks against peers (issue 7): ``python -m benchmarks`` or ``make bench``.

Sections (each comparison runs in one process, on the same weights and inputs):
1. decode: decoder-only tokens/s and step latency vs transformers, and the memory-bandwidth floor;
2. translation: Marian-architecture tokens/s vs CTranslate2 (float32, int8) and transformers;
3. KV cache: cached decoding vs full recomputation;
4. attention: SDPA vs the explicit reference, time and peak memory;
5. service: the HTTP service under 1..64 concurrent streaming clients;
6. GPU: the same on CUDA in bf16 (skipped without CUDA).
"""
