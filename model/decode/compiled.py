"""A compiled decode step for the Llama family on the CPU (``TSERVE_COMPILE``).

Why: an eager decode step of SmolLM2-135M at batch 1 spends most of its time between
kernels, not in them. Each of its 30 layers runs about 40 small operators (norms, RoPE, cache
index arithmetic, masking, SiLU, residual adds, smoothing scales), each paying the
interpreter and dispatcher, around five projections that together take ~130 us. Measured on
2 threads: ~23 ms per eager step against ~4 ms of projection kernels.

How:
- One layer's decode maths is one function (``_layer_step``): RMSNorm, the projections,
  RoPE, the K/V write into the slot cache, grouped-query attention over the slot's span,
  SwiGLU and the residuals. Inductor compiles it once and every layer calls the same graph:
  the layers share shapes and their weights are inputs, so the compile costs one layer
  (~10 s on 2 cores), not thirty.
- The projections stay opaque to the compiler: ``tserve::decode_linear(x, handle, n)`` is an
  operator whose CPU kernel looks the projection up by ``handle``: fbgemm's dynamic int8
  linear for a ``DecodeInt8Linear``, the prepacked oneDNN kernel for a float ``Linear``. The
  handle is a tensor, so the thirty layers do not specialise the graph thirty ways. Inductor
  fuses what lies between the projections into a few C++ loops.
- Attention reads the slots where they lie, with the same span bucket and mask as the eager
  path (``span_bucket``), so the maths is the eager step's; only float rounding differs.
- The embedding lookup, the final norm and the output head run eagerly, once per step.
- Shapes: a batch of one gets its own specialised graph; after the first other batch size or
  span the compiler makes both dimensions symbolic (automatic dynamic shapes), so the number
  of graphs stays small. ``warm_up`` compiles them before the service says it is ready.

Used by ``_CachedDecoder.decode_step`` once ``model.compile_decode()`` has attached it; a
model the class cannot run (``unsupported_reason``) keeps the eager step. If compiling fails
(no C++ compiler, a torch without inductor), the step falls back to eager for good and says
so once in the log.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.nn.host_transfer import to_device
from model.nn.kv_cache import SlotKVCache, span_bucket
from model.nn.layers import ACTIVATION_FNS, Linear, apply_rotary
from model.quant.int8 import DecodeInt8Linear
from model.quant.int8 import decode_step as int8_decode_step

log = logging.getLogger(__name__)

# --- the opaque projection operator -------------------------------------------------------

_KERNELS: dict[int, Callable[[Tensor], Tensor]] = {}
_NEXT_HANDLE = itertools.count()
_LIB = torch.library.Library("tserve", "DEF")
_LIB.define("decode_linear(Tensor x, Tensor handle, int out_features) -> Tensor")


def _decode_linear_cpu(x: Tensor, handle: Tensor, out_features: int) -> Tensor:
    return _KERNELS[int(handle)](x)


def _decode_linear_meta(x: Tensor, handle: Tensor, out_features: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


# A plain library kernel rather than torch.library.custom_op: measured ~5 us of overhead per
# call against ~45 us for custom_op's Python wrapper, with ~150 projections per step.
_LIB.impl("decode_linear", _decode_linear_cpu, "CPU")
_LIB.impl("decode_linear", _decode_linear_meta, "Meta")


def projection_kernel(layer: nn.Module) -> Callable[[Tensor], Tensor]:
    """The fastest eager kernel of one projection as the decode step uses it (bias included;
    a ``DecodeInt8Linear``'s smoothing scale is left to the caller)."""
    if isinstance(layer, DecodeInt8Linear):
        packed = layer.quantized._packed_params._packed_params
        return partial(_int8_linear, packed=packed)  # nnqd.Linear's own call, minus its Python checks
    if isinstance(layer, Linear) and layer.packed is not None:
        packed, bias = layer.packed, layer.bias
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if isinstance(layer, nn.Linear):
        weight, bias = layer.weight, layer.bias
        return lambda x: F.linear(x, weight, bias)
    raise TypeError(f"no decode kernel for {type(layer).__name__}")


def _int8_linear(x: Tensor, packed) -> Tensor:
    return torch.ops.quantized.linear_dynamic(x, packed, True)  # reduce_range, as nnqd.Linear does on x86


# --- one layer's decode step ----------------------------------------------------------

def _project(x: Tensor, proj: tuple[Tensor, Tensor | None, int]) -> Tensor:
    handle, inv_scale, n = proj
    return torch.ops.tserve.decode_linear(x if inv_scale is None else x * inv_scale, handle, n)


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _layer_step(x: Tensor, w: dict, kc: Tensor, vc: Tensor, slot_ids: Tensor, positions: Tensor, cos: Tensor,
                sin: Tensor, mask: Tensor, *, n_heads: int, n_kv: int, head_dim: int, eps: float, scale: float,
                activation: str) -> Tensor:
    """x (B, d) -> (B, d) through one pre-norm Llama layer, one token per row; writes this
    token's K/V at ``positions`` of slots ``slot_ids`` in ``kc``/``vc`` (slots, nkv, L, hs) and
    attends over the first ``mask.size(1)`` positions of each slot."""
    b = x.size(0)
    h = _rms(x, w["attn_norm"], eps)
    if "qkv" in w:
        q, k, v = _project(h, w["qkv"]).split((n_heads * head_dim, n_kv * head_dim, n_kv * head_dim), -1)
    else:
        q, k, v = _project(h, w["q"]), _project(h, w["k"]), _project(h, w["v"])
    q = apply_rotary(q.view(b, n_heads, head_dim), cos, sin)
    k = apply_rotary(k.view(b, n_kv, head_dim), cos, sin)
    kc[slot_ids, :, positions] = k.to(kc.dtype)
    vc[slot_ids, :, positions] = v.view(b, n_kv, head_dim).to(vc.dtype)
    span = mask.size(1)
    keys, values = kc[slot_ids, :, :span].to(q.dtype), vc[slot_ids, :, :span].to(q.dtype)  # (B, nkv, S, hs)
    q = q.view(b, n_kv, n_heads // n_kv, head_dim)
    scores = torch.einsum("bkgd,bksd->bkgs", q, keys) * scale
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    y = torch.einsum("bkgs,bksd->bkgd", scores.softmax(-1), values).reshape(b, n_heads * head_dim)
    x = x + _project(y, w["o"])
    h = _rms(x, w["ffn_norm"], eps)
    return x + _project(ACTIVATION_FNS[activation](_project(h, w["gate"])) * _project(h, w["up"]), w["down"])


# --- the compiled decoder -------------------------------------------------------------------

def unsupported_reason(model: nn.Module) -> str | None:
    """Why ``CompiledDecoder`` cannot run ``model`` (None: it can): it covers decoder-only
    pre-norm models with RoPE, RMSNorm and a gated feed-forward (the Llama family) on the CPU."""
    from model.nn.transformer import DecoderLM

    cfg = getattr(model, "cfg", None)
    if not isinstance(model, DecoderLM):
        return "only decoder-only models have a compiled decode step"
    checks = [
        (cfg.positional == "rope", "positions are not rotary"),
        (cfg.norm == "rmsnorm", "norms are not RMSNorm"),
        (cfg.norm_placement == "pre", "norms are not pre-norm"),
        (cfg.mlp == "gated", "the feed-forward is not gated"),
        (cfg.final_norm, "there is no final norm"),
        (not cfg.scale_embedding and not cfg.embedding_norm and not cfg.type_vocab_size,
         "the embeddings are scaled, normalised or typed"),
        (not cfg.mlm_transform, "the output head has a transform"),
        (model.device.type == "cpu", f"the model is on {model.device} (CPU only)"),
    ]
    return next((why for ok, why in checks if not ok), None)


def wants_compile(mode: str, model: nn.Module) -> bool:
    """The service's ``TSERVE_COMPILE``: ``off``; ``on`` (a model the compiled step cannot run
    is an error naming why); ``auto`` (the default): where it can run and decode steps are
    int8, the case where it was measured faster (float32 steps are bound by reading weights)."""
    return mode != "off" and decode_step_wanted(mode, "TSERVE_COMPILE", unsupported_reason(model), model)


def decode_step_wanted(mode: str, setting: str, why: str | None, model: nn.Module) -> bool:
    """A decode-step setting's ``off`` / ``on`` / ``auto`` for ``model``, given ``why`` that step
    cannot run it (None: it can): ``on`` with a reason is an error naming the setting and the
    reason; ``auto`` wants it where it can run and decode steps are int8."""
    if mode == "off":
        return False
    if mode == "on":
        if why is not None:
            raise ValueError(f"{setting}=on: {why}")
        return True
    return why is None and any(isinstance(m, DecodeInt8Linear) for m in model.modules())


class CompiledDecoder:
    """The decode step of a Llama-family ``DecoderLM`` with each layer's maths compiled (see
    the module docstring). Build it after the weights are final (quantized, prepacked):
    it holds the projection kernels as they are now.

    ``max_batch``: larger decode batches stay eager. Attention here gathers each row's span
    out of the cache, which costs more than the eager path's view of consecutive slots
    once the batch is large (SmolLM2 int8, span 256, 2 threads: compiled 56 / 255 / 278
    tok/s at batch 1 / 8 / 32, eager 46 / 227 / 437)."""

    max_batch = 8

    def __init__(self, model: nn.Module):
        why = unsupported_reason(model)
        if why is not None:
            raise ValueError(f"no compiled decode step for this model: {why}")
        self.model = model
        cfg = model.cfg
        first = model.decoder_layers[0]
        self.eps = float(first.self_attn_norm.eps if first.self_attn_norm.eps is not None else torch.finfo().eps)
        self.handles: list[int] = []
        self.layers = [self._weights(layer) for layer in model.decoder_layers]
        weakref.finalize(self, _release, list(self.handles))
        step = partial(_layer_step, n_heads=cfg.n_heads, n_kv=cfg.kv_heads, head_dim=cfg.head_dim, eps=self.eps,
                       scale=float(first.self_attn.scale), activation=cfg.activation)
        self.eager_layer = step
        # Serial C++ loops: between the projections a small batch has a few thousand values
        # per op, less than a thread wake-up is worth (the projections use torch's threads).
        self.compiled_layer = torch.compile(step, fullgraph=True, options={"cpp.threads": 1})
        self.failed: str | None = None
        self.compile_seconds = 0.0
        self._lock = threading.Lock()

    def _projection(self, layer: nn.Module) -> tuple[Tensor, Tensor | None, int]:
        handle = next(_NEXT_HANDLE)
        _KERNELS[handle] = projection_kernel(layer)
        self.handles.append(handle)
        inv_scale = layer.inv_scale if isinstance(layer, DecodeInt8Linear) else None
        out = layer.dense.out_features if isinstance(layer, DecodeInt8Linear) else layer.out_features
        return torch.tensor(handle), inv_scale, out

    def _weights(self, layer: nn.Module) -> dict:
        attn, ffn = layer.self_attn, layer.ffn
        w = {"attn_norm": layer.self_attn_norm.weight, "ffn_norm": layer.ffn_norm.weight}
        if attn.fused:
            w["qkv"] = self._projection(attn.qkv_proj)
        else:
            w.update(q=self._projection(attn.q_proj), k=self._projection(attn.k_proj), v=self._projection(attn.v_proj))
        w.update(o=self._projection(attn.out_proj), gate=self._projection(ffn.gate), up=self._projection(ffn.up),
                 down=self._projection(ffn.down))
        return w

    @property
    def active(self) -> bool:
        return self.failed is None

    @torch.inference_mode()  # as the engine runs it: the graphs guard on it
    def __call__(self, cache: SlotKVCache, tokens: Tensor, slots: Sequence[int], positions: Sequence[int]) -> Tensor:
        """``decode_step``'s contract: tokens (B,) at ``positions`` of ``slots`` -> logits (B, V)."""
        model = self.model
        if max(positions) >= cache.max_len:
            raise ValueError(f"sequence length {max(positions) + 1} exceeds the KV cache's max_len {cache.max_len}")
        batch = cache.batch(slots)
        pos = to_device(positions, torch.long, cache.device)
        x = model.embed.tokens(tokens.view(-1))  # (B, d)
        cos, sin = model.embed.rope[:, pos].to(x.dtype)[:, :, None]  # 2 x (B, 1, hs)
        mask = cache.key_positions[: span_bucket(max(positions) + 1, cache.max_len + 1)][None, :] <= pos[:, None]
        layer = self.compiled_layer if self.failed is None else self.eager_layer
        with int8_decode_step():
            for i, w in enumerate(self.layers):
                kc, vc = cache.k[i], cache.v[i]
                for t in (kc, vc):  # one graph for every cache: slots and length symbolic from the start
                    torch._dynamo.maybe_mark_dynamic(t, 0)
                    torch._dynamo.maybe_mark_dynamic(t, 2)
                try:
                    x = layer(x, w, kc, vc, batch.ids, pos, cos, sin, mask)
                except Exception as exc:  # noqa: BLE001 - compile failures come in many types
                    if layer is self.eager_layer or i:
                        raise
                    self._give_up(exc)
                    layer = self.eager_layer
                    x = layer(x, w, kc, vc, batch.ids, pos, cos, sin, mask)
            return model.lm_head(model.decoder_norm(x)).float()

    def _give_up(self, exc: Exception) -> None:
        self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        log.warning("compiled decode step unavailable, decoding eagerly: %s", self.failed)

    def warm_up(self) -> float:
        """Compile the graphs decoding will use, on a scratch cache: batch 1 at two spans, then
        two other batch sizes at two more (after which batch and span are symbolic: two graphs
        in all). Returns the seconds spent."""
        start = time.perf_counter()
        # Spans 16, 32, 64, 128 and a cache length of 161: no two sizes equal, so the compiler
        # does not guard on a coincidence. Made outside inference mode, as the engine's is.
        cache = self.model.new_cache(3, min(160, self.model.cfg.max_positions))
        for b, position in ((1, 4), (1, 20), (2, 40), (3, 100)):
            position = min(position, cache.max_len - 1)
            self(cache, torch.zeros(b, dtype=torch.long, device=cache.device), list(range(b)), [position] * b)
        self.compile_seconds = time.perf_counter() - start
        return self.compile_seconds


def _release(handles: list[int]) -> None:
    for h in handles:
        _KERNELS.pop(h, None)


# Every model compiles the same layer function; the default limit of 8 graphs per function
# would send a process serving (or testing) several models back to eager.
torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
