"""Building blocks: attention, feed-forward, positions, embeddings, one transformer layer.

Built bottom-up. Nothing here stores activations or attention weights on a module,
so one model can serve many concurrent sequences.

Masks are boolean with True = "may attend", broadcastable to (B, n_heads, T_q, T_k).
Every layer of one forward pass shares an ``AttentionContext``: the mask, the rotary
angles of the new tokens' positions, and (when serving) the KV cache view that each
attention layer updates in place (``k, v = ctx.cache.update(layer, k, v)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import ModelConfig

# --- linear layers that can be prepacked for CPU inference ----------------------------

_CAN_PACK = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class Linear(nn.Linear):
    """``nn.Linear`` whose weight can be prepacked into oneDNN's blocked layout for CPU inference.

    MKL's GEMM is slow for the skinny products of decoding (a few rows times a wide
    matrix); the prepacked oneDNN kernel (what Inductor uses on CPU) is 1.4-2.7x faster
    for 1-32 rows. The packed copy is only used in eval mode and is dropped by ``train()``.
    """

    packed: Tensor | None = None

    def pack(self) -> bool:
        if not _CAN_PACK or self.weight.device.type != "cpu" or self.weight.dtype != torch.float32:
            return False
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        return True

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is not None and not self.training and x.device.type == "cpu":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


# --- attention maths ----------------------------------------------------------------

def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None,
    causal: bool = False,
) -> tuple[Tensor, Tensor]:
    """Explicit softmax(Q Kᵀ · scale) V, returning (output, weights).

    Kept deliberately plain: it is the reference the fused path is tested against.
    Masked positions get exactly zero weight; a row with nothing to attend to is all zero.
    """
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (..., T_q, T_k)
    allowed = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device)
    if causal:
        t_q, t_k = scores.shape[-2:]
        allowed = torch.tril(allowed, diagonal=t_k - t_q)  # query i sees keys <= i (aligned at the end)
    if mask is not None:
        allowed = allowed & mask
    allowed = allowed.expand_as(scores)
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).masked_fill(~allowed, 0.0)  # exact zeros, no NaN rows
    return weights @ v, weights


def attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, scale: float | None = None,
    causal: bool = False, dropout_p: float = 0.0,
) -> Tensor:
    """Fused attention through SDPA (flash / memory-efficient kernels on CUDA, fused on CPU)."""
    if causal and mask is not None:
        t_q, t_k = q.size(-2), k.size(-2)
        tri = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril(diagonal=t_k - t_q)
        mask, causal = mask & tri, False
    # Grouped-query attention: k/v carry fewer heads; SDPA pairs each with its query group
    # without materialising repeated copies of the cache.
    gqa = k.dim() > 2 and k.size(-3) != q.size(-3)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=scale, enable_gqa=gqa
    )


# --- what one forward pass shares across layers ---------------------------------------

class KVCacheView(Protocol):
    """A KV cache as one forward pass sees it (``model.nn.kv_cache.CacheView``)."""

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new tokens' k, v (B, nkv, T, hs); return the keys/values to attend over."""
        ...

    def update_in_place(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Store one new token per row; return the layer's block pool k, v, the rows' block
        tables and lengths, for the decode-attention kernel."""
        ...

    def cross(self, layer: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """Cross-attention memory k, v (B, nkv, S, hs) and its mask."""
        ...

    def cross_in_place(self, layer: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The layer's whole cross-attention memory k, v (slots, nkv, S, hs), the rows' slots
        (B,) and their sources' lengths (B,), for a kernel that reads it where it lies."""
        ...


class DecodeAttentionKernel(Protocol):
    """An attention core for decode steps that reads each row's blocks in place (the Triton
    kernel, ``model.decode.triton_attention``; on the CPU the native library's,
    ``model.decode.native.NativeDecodeAttention``); chosen by the decode step, never by the
    layer. A kernel may also read an encoder-decoder's cross-attention memory in place: a
    ``cross(q (B, nh, hs), k_mem, v_mem (slots, nh, S, hs), slots (B,), lengths (B,), scale)``
    method; without one, cross-attention stays SDPA."""

    def applies(self, q: Tensor) -> bool:
        """Whether it runs for queries ``q`` (B, nh, 1, hs) (their device, its mode)."""
        ...

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, lengths: Tensor,
                 scale: float, window: int = 0) -> Tensor | None:
        """q (B, nh, hs) over the layer's block pool -> (B, nh, hs), each row over the last
        ``window`` of its ``lengths`` positions (0: all); None: it failed, use SDPA."""
        ...


@dataclass
class AttentionContext:
    """Per-forward-pass inputs of every attention layer."""

    mask: Tensor | None = None  # (B, 1, T, S) bool, True = may attend
    causal: bool = False  # causal within the new tokens (used when ``mask`` is None)
    rope: tuple[Tensor, Tensor] | None = None  # cos, sin (B, 1, T, hs) for rotary positions
    rope_local: tuple[Tensor, Tensor] | None = None  # the same for sliding-window layers with their own base
    # Sliding-window layers (ModelConfig.sliding_window): the mask of the positions inside each row's window,
    # (B, 1, T, S) like ``mask``, and never None when the model has such layers.
    window_mask: Tensor | None = None
    cache: KVCacheView | None = None  # None: attend over the new tokens only
    memory: Tensor | None = None  # encoder output (B, S, d) for teacher-forced cross-attention
    memory_mask: Tensor | None = None  # (B, 1, 1, S)
    decode_kernel: DecodeAttentionKernel | None = None  # decode steps: attention over the cache in place


# --- attention module ---------------------------------------------------------------

class MultiHeadAttention(nn.Module):
    """Multi-head (or grouped-query) attention with fused or separate Q/K/V projections.

    Self-attention projects q, k, v from one input; cross-attention projects q from the
    decoder and k, v from the encoder memory (computed once per request when serving).
    ``layer`` is this module's index in its stack: the KV cache row it owns.

    A decode step may hand it an attention kernel (``AttentionContext.decode_kernel``) that
    reads each row's cache in place instead of the padded span and its mask.
    """

    def __init__(self, cfg: ModelConfig, layer: int = 0, cross: bool = False):
        super().__init__()
        d, self.n_heads, self.head_dim = cfg.d_model, cfg.n_heads, cfg.head_dim
        self.n_kv_heads = cfg.kv_heads
        self.layer, self.scale, self.dropout_p, self.cross = layer, cfg.scale, cfg.attention_dropout, cross
        self.fused = cfg.fused_qkv
        q_out, kv_out = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.splits = (q_out, kv_out, kv_out)
        qkv_bias = cfg.bias or cfg.qkv_bias
        if self.fused and not cross:
            self.qkv_proj = Linear(d, q_out + 2 * kv_out, bias=qkv_bias)
        elif self.fused:
            self.q_proj = Linear(d, q_out, bias=qkv_bias)
            self.kv_proj = Linear(d, 2 * kv_out, bias=qkv_bias)
        else:
            self.q_proj = Linear(d, q_out, bias=qkv_bias)
            self.k_proj = Linear(d, kv_out, bias=qkv_bias)
            self.v_proj = Linear(d, kv_out, bias=qkv_bias)
        self.out_proj = Linear(q_out, d, bias=cfg.bias)
        # Per-head RMSNorms of q and k before the rotary positions (Qwen3, Gemma 3).
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.layer_norm_eps) if cfg.qk_norm and not cross else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.layer_norm_eps) if cfg.qk_norm and not cross else None
        # A sliding-window layer reads the window mask, and its own rotary table where the config gives one.
        self.window = not cross and cfg.is_window_layer(layer)
        self.window_size = cfg.sliding_window or 0
        self.local_rope = self.window and cfg.local_rope_theta is not None

    def _heads(self, x: Tensor) -> Tensor:
        b, t, width = x.shape
        return x.view(b, t, width // self.head_dim, self.head_dim).transpose(1, 2)  # (B, heads, T, hs)

    def project_kv(self, source: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of a cross-attention source: 2 x (B, nkv, S, hs)."""
        if self.fused:
            k, v = self.kv_proj(source).chunk(2, dim=-1)  # 2 x (B, S, nkv * hs)
        else:
            k, v = self.k_proj(source), self.v_proj(source)
        return self._heads(k), self._heads(v)

    def project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.fused:
            q, k, v = self.qkv_proj(x).split(self.splits, dim=-1)  # (B, T, nh * hs), 2 x (B, T, nkv * hs)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self._heads(q), self._heads(k), self._heads(v)

    def merge(self, y: Tensor) -> Tensor:
        b, _, t, _ = y.shape
        y = y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)  # (B, T, nh * hs)
        return self.out_proj(y)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool) -> Tensor:
        p = self.dropout_p if self.training else 0.0
        return self.merge(attention(q, k, v, mask, self.scale, causal, p))

    def self_attention(self, x: Tensor, ctx: AttentionContext) -> Tensor:
        q, k, v = self.project_qkv(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rope = ctx.rope_local if self.local_rope else ctx.rope
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        mask, causal = ctx.mask, ctx.causal
        if self.window:
            if ctx.window_mask is None:
                raise ValueError(f"layer {self.layer} attends inside a sliding window but the forward pass built "
                                 "no window mask")
            mask, causal = ctx.window_mask, False
        kernel = ctx.decode_kernel
        if kernel is not None and ctx.cache is not None and q.size(2) == 1 and not self.training and kernel.applies(q):
            # The kernel reads each row's blocks in place up to its own length (inside its
            # window): exactly the positions the span's mask would allow. None: it failed; SDPA takes over.
            k_all, v_all, tables, lengths = ctx.cache.update_in_place(self.layer, k, v)
            y = kernel(q[:, :, 0], k_all, v_all, tables, lengths, self.scale,
                       self.window_size if self.window else 0)  # (B, nh, hs)
            if y is not None:
                return self.merge(y[:, :, None])  # (B, nh, 1, hs) -> (B, 1, d)
        if ctx.cache is not None:
            k, v = ctx.cache.update(self.layer, k, v)  # written in place; the span to attend over
        return self.attend(q, k, v, mask, causal)

    def cross_attention(self, x: Tensor, ctx: AttentionContext) -> Tensor:
        q = self._heads(self.q_proj(x))
        kernel = ctx.decode_kernel
        cross = getattr(kernel, "cross", None)  # only kernels that read the memory in place have it
        if cross is not None and ctx.cache is not None and q.size(2) == 1 and not self.training and kernel.applies(q):
            k_all, v_all, slots, lengths = ctx.cache.cross_in_place(self.layer)
            if k_all.size(1) == q.size(1):
                return self.merge(cross(q[:, :, 0], k_all, v_all, slots, lengths, self.scale)[:, :, None])
        if ctx.cache is not None:
            k, v, mask = ctx.cache.cross(self.layer)
        else:
            (k, v), mask = self.project_kv(ctx.memory), ctx.memory_mask
        return self.attend(q, k, v, mask, causal=False)


# --- feed-forward, positions, embeddings --------------------------------------------

ACTIVATION_FNS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact erf form (BERT)
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's tanh approximation
    "silu": F.silu,
    "swish": F.silu,
}


class FeedForward(nn.Module):
    """Position-wise FFN: Linear -> activation -> Linear (the paper's FFN(x)); with
    ``mlp="gated"`` a second input projection gates the first (SwiGLU in Llama)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias) if cfg.mlp == "gated" else None
        self.up = Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.down = Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.act = ACTIVATION_FNS[cfg.activation]
        self.drop = nn.Dropout(cfg.activation_dropout)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate is not None:
            return self.down(self.drop(self.act(self.gate(x)) * self.up(x)))
        return self.down(self.drop(self.act(self.up(x))))


def make_norm(cfg: ModelConfig) -> nn.Module:
    """LayerNorm, or RMSNorm (scale only, no centring, no bias) for the Llama architecture."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.layer_norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)


# --- rotary position embeddings (RoPE) --------------------------------------------------

def _cos_sin(angles: Tensor) -> tuple[Tensor, Tensor]:
    """cos and sin of float64 angles, through numpy: torch's go through MKL's vector library,
    whose result for an element can move by an ulp with the array's alignment and how the
    threads split it, so a table built in two processes differed in a few entries after float32
    rounding (and a row's keys with them). numpy computes every element the same way."""
    if angles.device.type != "cpu":  # meta tensors (shapes only) stay torch's
        return angles.cos(), angles.sin()
    a = angles.contiguous().numpy()
    return torch.from_numpy(np.cos(a)), torch.from_numpy(np.sin(a))


def _powers(base: float, exponents: Tensor) -> Tensor:
    """base ** exponents in float64, element by element through numpy (as _cos_sin)."""
    if exponents.device.type != "cpu":
        return base ** exponents
    return torch.from_numpy(np.power(np.float64(base), exponents.contiguous().numpy()))


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> Tensor:
    """The rotation frequency of each pair of head dimensions (hs/2,), float64, scaled as
    the config says: ``linear`` divides every frequency (stretches positions) by ``factor``;
    ``llama3`` divides only the low frequencies, keeps the high ones, and blends in between;
    ``longrope`` divides each frequency by its own factor. ``local``: the unscaled frequencies
    of ``local_rope_theta`` (sliding-window layers)."""
    hs = cfg.head_dim
    theta = cfg.local_rope_theta if local else cfg.rope_theta
    inv_freq = _powers(theta, -torch.arange(0, hs, 2, dtype=torch.float64) / hs)
    scaling = {} if local else (cfg.rope_scaling or {})
    factor = float(scaling.get("factor", 1.0))
    if scaling.get("type") == "linear":
        return inv_freq / factor
    if scaling.get("type") == "longrope":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float64)
    if scaling.get("type") == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        original = float(scaling["original_max_position_embeddings"])
        wavelength = 2 * math.pi / inv_freq
        # 0 where the wavelength exceeds original/low (slow: scaled), 1 below original/high (fast: kept)
        keep = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)
        return keep * inv_freq + (1 - keep) * inv_freq / factor
    return inv_freq


def rope_table(cfg: ModelConfig, local: bool = False) -> Tensor:
    """cos and sin of every position's angles, stacked: (2, max_positions, hs). The angles of
    a pair (i, i + hs/2) are equal: the rotate-half layout of Llama in Hugging Face. LongRoPE's
    ``attention_factor`` multiplies both (so q and k), as Phi-3 does."""
    angles = torch.arange(cfg.max_positions, dtype=torch.float64)[:, None] * rope_inv_freq(cfg, local)[None, :]
    angles = torch.cat([angles, angles], dim=-1)  # (P, hs)
    table = torch.stack(_cos_sin(angles))
    scaling = cfg.rope_scaling or {}
    if not local and scaling.get("type") == "longrope":
        table = table * float(scaling["attention_factor"])
    return table.float()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each (x_i, x_{i+hs/2}) pair of x (B, heads, T, hs) by its position's angle."""
    half = x.size(-1) // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def sinusoidal_table(max_positions: int, d_model: int, layout: str) -> Tensor:
    """The paper's PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...).

    ``interleaved`` puts sin/cos on even/odd dims as in the paper; ``split`` puts all sines
    in the first half and all cosines in the second (Marian / fairseq layout).
    """
    pos = torch.arange(max_positions, dtype=torch.float64)[:, None]  # (P, 1)
    inv_freq = _powers(10000.0, -torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (d/2,)
    angles = pos * inv_freq[None, :]  # (P, d/2)
    cos, sin = _cos_sin(angles)
    if layout == "interleaved":
        table = torch.stack([sin, cos], dim=-1).reshape(max_positions, d_model)
    else:
        table = torch.cat([sin, cos], dim=-1)
    return table.float()


class Embeddings(nn.Module):
    """Token (+ position, + token type) embeddings, optionally scaled and normalised.

    With rotary positions the position enters in attention instead: ``rotary(positions)``
    gives the cos/sin every layer applies to its queries and keys.

    ``compute_dtype``: set where the token table is kept narrower than the model computes
    (``model.decode.native.halve_embeddings``: bfloat16 rows of a float32 model), so rows are
    widened as they are read; None: the table's own dtype."""

    compute_dtype: torch.dtype | None = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.positional == "learned":
            self.positions = nn.Embedding(cfg.max_positions, cfg.d_model)
        elif cfg.positional == "sinusoidal":
            self.register_buffer("sinusoid", torch.empty(cfg.max_positions, cfg.d_model), persistent=False)
        else:
            self.register_buffer("rope", torch.empty(2, cfg.max_positions, cfg.head_dim), persistent=False)
            if cfg.local_rope_theta is not None:
                self.register_buffer("rope_local", torch.empty(2, cfg.max_positions, cfg.head_dim),
                                     persistent=False)
        self.token_types = nn.Embedding(cfg.type_vocab_size, cfg.d_model) if cfg.type_vocab_size else None
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if cfg.embedding_norm else None
        self.scale = math.sqrt(cfg.d_model) if cfg.scale_embedding else 1.0
        self.drop = nn.Dropout(cfg.dropout)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute non-persistent buffers, e.g. after building on the meta device."""
        # a table kept as GGUF blocks (model.quant.kquant.StoredEmbedding) has no float weight
        device = self.tokens.weight.device if isinstance(self.tokens, nn.Embedding) else self.tokens.device
        if self.cfg.positional == "sinusoidal":
            self.sinusoid = sinusoidal_table(self.cfg.max_positions, self.cfg.d_model,
                                             self.cfg.sinusoidal_layout).to(device)
        elif self.cfg.positional == "rope":
            self.rope = rope_table(self.cfg).to(device)
            if self.cfg.local_rope_theta is not None:
                self.rope_local = rope_table(self.cfg, local=True).to(device)

    def rotary(self, positions: Tensor, dtype: torch.dtype, local: bool = False) -> tuple[Tensor, Tensor] | None:
        """cos, sin (B, 1, T, hs) for positions (B, T) or (T,); None without rotary positions.
        ``local``: from the sliding-window layers' own table (None where the config has none)."""
        if self.cfg.positional != "rope" or (local and self.cfg.local_rope_theta is None):
            return None
        table = self.rope_local if local else self.rope
        cos, sin = table[:, positions.view(-1, positions.size(-1))].to(dtype)  # 2 x (B, T, hs)
        return cos[:, None], sin[:, None]

    def forward(self, ids: Tensor, positions: Tensor, token_types: Tensor | None = None) -> Tensor:
        """ids (B, T), positions (B, T) or (T,) -> (B, T, d)."""
        x = self.tokens(ids)
        if self.compute_dtype is not None:
            x = x.to(self.compute_dtype)
        if self.scale != 1.0:
            x = x * self.scale
        if self.cfg.positional == "learned":
            x = x + self.positions(positions)
        elif self.cfg.positional == "sinusoidal":
            x = x + self.sinusoid[positions].to(x.dtype)
        if self.token_types is not None:
            types = token_types if token_types is not None else torch.zeros_like(ids)
            x = x + self.token_types(types)
        if self.norm is not None:
            x = self.norm(x)
        return self.drop(x)


# --- one transformer layer ------------------------------------------------------------

class TransformerLayer(nn.Module):
    """Self-attention (-> cross-attention) -> FFN, each wrapped in residual + norm.

    One class serves the encoder layer (no cross), the encoder-decoder's decoder layer
    (cross) and the decoder-only block (no cross, causal). ``index`` is its place in its stack.
    """

    def __init__(self, cfg: ModelConfig, index: int = 0, cross: bool = False):
        super().__init__()
        self.pre_norm = cfg.norm_placement == "pre"
        self.self_attn = MultiHeadAttention(cfg, index)
        self.self_attn_norm = make_norm(cfg)
        self.cross_attn = MultiHeadAttention(cfg, index, cross=True) if cross else None
        self.cross_attn_norm = make_norm(cfg) if cross else None
        self.ffn = FeedForward(cfg)
        self.ffn_norm = make_norm(cfg)
        # Gemma 3: a second norm on each sublayer's output, before the residual add.
        self.self_attn_post_norm = make_norm(cfg) if cfg.post_sublayer_norm else None
        self.ffn_post_norm = make_norm(cfg) if cfg.post_sublayer_norm else None
        self.drop = nn.Dropout(cfg.dropout)

    def _residual(self, x: Tensor, norm: nn.Module, fn: Callable[[Tensor], Tensor],
                  post: nn.Module | None = None) -> Tensor:
        if self.pre_norm:
            y = fn(norm(x))
            return x + self.drop(y if post is None else post(y))  # GPT-2 / Llama: x + f(N(x)); Gemma: x + P(f(N(x)))
        return norm(x + self.drop(fn(x)))  # paper: N(x + f(x))

    def forward(self, x: Tensor, ctx: AttentionContext) -> Tensor:
        x = self._residual(x, self.self_attn_norm, lambda h: self.self_attn.self_attention(h, ctx),
                           self.self_attn_post_norm)
        if self.cross_attn is not None:
            x = self._residual(x, self.cross_attn_norm, lambda h: self.cross_attn.cross_attention(h, ctx))
        return self._residual(x, self.ffn_norm, self.ffn, self.ffn_post_norm)
