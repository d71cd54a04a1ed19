"""The decode step: one place decides how a model decodes, and the engine holds the result.

    from model.decode import DecodeOptions, prepare
    step = prepare(ckpt.model, DecodeOptions(), ckpt.tokenizer)   # what the service runs
    generate(ckpt.model, prompts, params, ckpt.tokenizer, step=step)

A model only has layers; ``prepare`` readies its weights (int8 decode copies, prepacked float
projections) and returns a ``DecodeStep``: the Python step (the model's own cached forward pass,
int8 copies inside decode steps, the Triton attention kernel where it runs) or the native C++
step. ``ModelRunner`` calls the step; ``generate`` / ``beam_search`` take the same step or the
same options, so a notebook runs exactly what the service runs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from model.config import DTYPES
from model.decode.native import (
    NativeEncDecStep,
    NativeStep,
    attach_int8_kernels,
    float_copies_dropped,
    native_attention,
    wants_native,
)
from model.decode.threads import decode_threads
from model.decode.triton_attention import DECODE_ATTENTION_MODES, attention_kernel
from model.nn.kv_cache import PagedKVCache
from model.nn.layers import DecodeAttentionKernel
from model.nn.transformer import DecoderLM, EncoderDecoder, TransformerModel
from model.quant.int8 import RowwiseInt8, decode_step_context, quantize_checkpoint_, wants_int8

log = logging.getLogger(__name__)

QUANTIZE_MODES = ("auto", "int8", "none")
NATIVE_MODES = ("auto", "on", "off")
PREFILL_MODES = ("auto", "model")
WEIGHT_MODES = ("auto", "int8")
KV_DTYPES = ("auto", *DTYPES)


class DecodeStep(Protocol):
    """One new token per row: ``step(cache, tokens (B,), slots, positions) -> logits (B, V)``."""

    name: str  # "python" | "native": what the metric tserve_decode_step_info reports
    kv_dtype: torch.dtype  # the KV cache this step reads and writes

    def __call__(self, cache: PagedKVCache, tokens: Tensor, slots: Sequence[int],
                 positions: Sequence[int]) -> Tensor: ...


@dataclass(frozen=True)
class DecodeOptions:
    """How to decode, chosen once (the service builds it from its settings; the defaults are
    the service's defaults). ``DecodeOptions.reference()`` is the plain float Python step."""

    quantize: str = "auto"  # auto: int8 decode copies for gated (Llama-style) decoders on the CPU; int8; none
    native: str = "auto"  # auto: the C++ step where it can run and decode steps are int8; on; off
    native_library: str | None = None  # a prebuilt library (python -m model.decode.native --out DIR)
    kv_dtype: str = "auto"  # decoder-only caches; auto: the model's dtype (kv_cache_dtype says why)
    # decode attention in the Python step: auto (the Triton kernel on CUDA where it runs; on the CPU
    # the native library's paged attention where it builds), sdpa, triton, native
    attention: str = "auto"
    # prompts: auto = through the decode step where it takes them (the native step: int8, row by
    # row), else the model's own forward; model = always the model's own forward (float)
    prefill: str = "auto"
    # native-step weights: auto = a model's own 4-bit weights where they are 4-bit runs (GGUF Q4_0 /
    # Q4_1; model.quant.q4), int8 elsewhere; int8 = int8 everywhere
    weights: str = "auto"

    def __post_init__(self) -> None:
        for name, allowed in (("quantize", QUANTIZE_MODES), ("native", NATIVE_MODES), ("kv_dtype", KV_DTYPES),
                              ("attention", DECODE_ATTENTION_MODES), ("prefill", PREFILL_MODES),
                              ("weights", WEIGHT_MODES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"decode option {name}={getattr(self, name)!r}; expected one of {list(allowed)}")

    @classmethod
    def reference(cls) -> DecodeOptions:
        """The model as it is: float weights, the Python step, SDPA, a cache in the model's dtype."""
        return cls(quantize="none", native="off", attention="sdpa")

    def with_attention(self, mode: str) -> DecodeOptions:
        return dataclasses.replace(self, attention=mode)


class PythonStep:
    """The model's own cached forward pass for one token per row. Inside it the int8 copies of
    ``DecodeInt8Linear`` layers run (prompts never do: their K/V stay exact) and, where given,
    an attention kernel replaces SDPA over the span."""

    name = "python"

    def __init__(self, model: DecoderLM | EncoderDecoder, kv_dtype: torch.dtype | None = None,
                 attention: DecodeAttentionKernel | None = None):
        self.model, self.attention = model, attention
        self.kv_dtype = kv_dtype or model.dtype

    def __call__(self, cache: PagedKVCache, tokens: Tensor, slots: Sequence[int], positions: Sequence[int]) -> Tensor:
        with decode_threads(len(slots)), decode_step_context():
            return self.model.decode_step(cache, tokens, slots, positions, attention=self.attention)


def prepare_weights(model: TransformerModel, options: DecodeOptions, tokenizer=None, pack: bool = True) -> bool:
    """Ready ``model``'s weights for serving as ``options`` say: int8 decode copies (smoothed on
    the calibration text through ``tokenizer``) where quantization applies, then prepacked float
    projections (``pack``). Returns whether the model decodes in int8. Idempotent: a model quantized
    before keeps its copies."""
    quantized = any(isinstance(m, RowwiseInt8) for m in model.modules())
    if not quantized and wants_int8(options.quantize, model.cfg, model.device.type):
        quantize_checkpoint_(model, tokenizer)
        quantized = True
    if pack:
        model.optimize_for_inference()
    else:
        model.eval()
    return quantized


def prepare(model: TransformerModel, options: DecodeOptions | None = None, tokenizer=None) -> DecodeStep:
    """The decode step ``options`` choose for ``model`` (a cached decoder), its weights made
    ready first (``prepare_weights``): the native step where ``options.native`` wants it and it
    can run (``on``: an error naming why not), else the Python step. Call it once the weights
    are final; the step holds the weights as they are then."""
    if not isinstance(model, (DecoderLM, EncoderDecoder)):
        raise ValueError(f"{type(model).__name__} has no decode step (an encoder-only model)")
    options = options or DecodeOptions()
    if options.prefill == "model" and float_copies_dropped(model):
        raise ValueError("prefill='model' needs the float weights, which an earlier prepare (prefill='auto' under "
                         "the native step) dropped; load the model again")
    prepare_weights(model, options, tokenizer, pack=False)
    kernel = attention_kernel(options.attention, model.device)
    native = wants_native(options.native, model, options.native_library)
    kv_dtype = kv_cache_dtype(options.kv_dtype, model, native)
    # A native step that writes the prompts drops the float copies once built (lean): packing
    # them first would only add a second float copy of every projection to the load's peak
    # (Qwen2.5-Coder 1.5B: 6 GB).
    lean = native and isinstance(model, DecoderLM) and options.prefill == "auto"
    if not lean:
        model.optimize_for_inference()
    if native:
        try:
            if isinstance(model, EncoderDecoder):
                return NativeEncDecStep(model, options.native_library)
            step = NativeStep(model, options.native_library, kv_dtype, prefills=options.prefill == "auto",
                              weights4=options.weights == "auto", lean=options.prefill == "auto")
        except Exception as exc:  # noqa: BLE001 - under auto, any failure means "not here"
            if options.native == "on":
                raise
            log.warning("the native decode step could not be set up (%s: %s); decoding with the Python step",
                        type(exc).__name__, exc)
            if lean:
                model.optimize_for_inference()
            kv_dtype = kv_cache_dtype(options.kv_dtype, model, False)
        else:
            return step
    # on the CPU, auto means the native library's kernels (None elsewhere and under sdpa/triton):
    # its decode attention, and its row-wise int8 projections (the same bits as the Python ones)
    native_kernel = native_attention(options.attention, model.device, options.native_library)
    if native_kernel is not None:
        attach_int8_kernels(model)
    return PythonStep(model, kv_dtype, native_kernel or kernel)


def kv_cache_dtype(setting: str, model: TransformerModel, native: bool) -> torch.dtype:
    """``kv_dtype`` of a decoder-only model's cache; ``auto``: the model's own dtype, under every
    step. A bfloat16 cache (``TSERVE_KV_DTYPE=bfloat16``: ~12% faster decode steps at batch 8-32,
    half the cache's memory) rounds every key and value to 8 significant bits, which turned
    SmolLM2's greedy answer to the README's question into nonsense, and its prompt kernel
    (AVX512-BF16, where the CPU has it) rounds the queries too, so the answer depended on the CPU.
    An encoder-decoder keeps its own dtype: its cross-attention reads the cache at the model's
    precision. ``native`` is kept for the callers' symmetry with the step's choice."""
    if isinstance(model, EncoderDecoder):
        return model.dtype
    if setting != "auto":
        return DTYPES[setting]
    return model.dtype
