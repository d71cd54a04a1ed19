"""What one benchmark run measures: sizes, repetitions, threads (full and --quick presets).

Every size is a field here so a run can be reshaped from the command line
(``--set gpt2_layers=12 --set gpt2_d_model=768``) without editing code; the JSON output
records the values used.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class BenchConfig:
    quick: bool = False
    repetitions: int = 3  # timings are medians over this many runs (1 in --quick)
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)  # torch / ct2 / service, all alike
    seed: int = 1234

    # 1. decode + 3. KV cache + 6. GPU: a randomly initialised GPT-2 (GPT2LMHeadModel).
    gpt2_layers: int = 6
    gpt2_d_model: int = 512
    gpt2_heads: int = 8
    gpt2_vocab: int = 50257
    gpt2_positions: int = 1024
    decode_batches: tuple[int, ...] = (1, 8)
    decode_prompt_len: int = 128
    decode_new_tokens: int = 128
    # 7. chat model (SmolLM2-135M-Instruct)
    chat_prompt_len: int = 32
    chat_new_tokens: int = 64
    chat_prefill_len: int = 256
    chat_streams: int = 32
    chat_service_duration_s: float = 40.0  # section 12: chat clients send requests for this long
    chat_quality_tokens: int = 256  # held-out tokens scored one decode step at a time, per mode
    # 9. prefix cache (same model): a burst of chat requests sharing a system prompt.
    prefix_system_len: int = 300
    prefix_streams: int = 32

    # 2. translation: a randomly initialised MarianMTModel with a SentencePiece vocabulary.
    marian_layers: int = 6  # encoder and decoder each
    marian_d_model: int = 512
    marian_heads: int = 8
    marian_ffn: int = 2048
    marian_vocab: int = 8000  # SentencePiece target size (the trained model may come out slightly smaller)
    translate_batches: tuple[int, ...] = (1, 32)
    translate_beams: tuple[int, ...] = (1, 4)
    translate_new_tokens: int = 48
    translate_single_sentences: int = 2  # batch-1 rows translate this many sentences one after another

    # 3. KV cache vs recomputation (same model as 1).
    kv_lengths: tuple[int, ...] = (128, 512, 1024)
    kv_cached_new_tokens: int = 16  # cached decoding: tokens generated to time a step
    kv_recompute_new_tokens: int = 3  # recomputation: full forwards timed (each is as long as a whole prefill)
    slot_layout_history: int = 384  # decode step with contiguous slots vs slots with holes

    # 4. attention: one (B, nh, T, hs) causal self-attention call.
    attention_lengths: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096)
    attention_heads: int = 8
    attention_head_dim: int = 64

    # 5. service under load.
    service_weights: Path = Path("weights/generate-en")  # a checkpoint dir; synthetic stand-in if absent
    service_concurrency: tuple[int, ...] = (1, 8, 32, 64)
    service_duration_s: float = 20.0  # each concurrency level runs for this long
    service_max_tokens: int = 64
    service_prompt_lengths: tuple[int, ...] = (16, 64, 128, 256)  # prompt tokens, drawn per request
    service_startup_timeout_s: float = 180.0

    # 6. GPU (only when CUDA is present).
    gpu_dtype: str = "bfloat16"

    # 9. decode attention on the GPU: the Triton kernel vs SDPA (only when CUDA is present).
    decode_attention_batches: tuple[int, ...] = (1, 8, 32)
    decode_attention_histories: tuple[int, ...] = (128, 512, 2048)
    decode_attention_calls: int = 100  # back-to-back calls per timed sample

    # 7. sentence embeddings: all-MiniLM-L6-v2 (manifest of the pinned package) vs sentence-transformers.
    embed_manifest: Path = Path("weights/all-minilm-l6-v2")
    embed_batches: tuple[int, ...] = (1, 32)
    embed_lengths: tuple[int, ...] = (4, 8, 16, 32, 48)  # made-up words per text (48 words: ~200 tokens)
    embed_concurrency: int = 32  # concurrent /v1/embeddings clients, against one at a time
    embed_requests: int = 192  # one-text requests per service measurement (each workload)

    # Peak-memory probe of the attention section (CPU): one fresh subprocess per measurement.
    attention_probe_timeout_s: float = 300.0

    @classmethod
    def quick_preset(cls) -> BenchConfig:
        """Small sizes and one repetition: the whole run in about a minute or two on 2 cores."""
        return cls(
            quick=True, repetitions=1,
            gpt2_layers=2, gpt2_d_model=128, gpt2_heads=4, gpt2_vocab=8192, gpt2_positions=512,
            decode_prompt_len=32, decode_new_tokens=16,
            marian_layers=2, marian_d_model=128, marian_heads=4, marian_ffn=512, marian_vocab=1000,
            translate_batches=(1, 8), translate_new_tokens=12, translate_single_sentences=1,
            kv_lengths=(64, 256), kv_cached_new_tokens=8, kv_recompute_new_tokens=2,
            attention_lengths=(128, 512),
            service_concurrency=(1, 8), service_duration_s=3.0, service_max_tokens=16,
            service_prompt_lengths=(8, 32),
            chat_prompt_len=16, chat_new_tokens=8, chat_prefill_len=64, chat_streams=4, chat_quality_tokens=32,
            chat_service_duration_s=5.0,
            prefix_system_len=64, prefix_streams=4,
            embed_requests=64,
        )

    def with_overrides(self, assignments: list[str]) -> BenchConfig:
        """Apply ``name=value`` strings; tuples are comma-separated (``kv_lengths=128,512``)."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        changes = {}
        for item in assignments:
            name, sep, raw = item.partition("=")
            if not sep or name not in fields:
                raise ValueError(f"--set {item!r}: expected NAME=VALUE with NAME one of {sorted(fields)}")
            current = getattr(self, name)
            try:
                if isinstance(current, bool):
                    if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                        raise ValueError(raw)
                    value = raw.lower() in ("1", "true", "yes")
                elif isinstance(current, tuple):
                    value = tuple(int(v) for v in raw.split(",") if v)
                elif isinstance(current, Path):
                    value = Path(raw)
                else:
                    value = type(current)(raw)
            except ValueError:
                raise ValueError(f"--set {item!r}: {name} needs a {type(current).__name__}") from None
            changes[name] = value
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(self).items()}
