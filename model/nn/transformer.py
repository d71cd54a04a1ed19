"""The three model families: EncoderDecoder, DecoderLM, MaskedLM.

Two ways to run a decoder:
- ``forward`` recomputes everything (training, tests, the reference for the cache);
- ``prefill`` / ``decode_step`` run over a ``PagedKVCache``: a batch of rows ("slots"), each
  at its own position with its own block table, so a scheduler can step many requests at
  different stages at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from model.config import ModelConfig
from model.nn.host_transfer import to_device
from model.nn.kv_cache import BLOCK_LEN, BlockRefs, CacheView, PagedKVCache, blocks_for
from model.nn.layers import (
    ACTIVATION_FNS,
    AttentionContext,
    DecodeAttentionKernel,
    Embeddings,
    Linear,
    TransformerLayer,
    make_norm,
)


def _padded(seqs: Sequence[Sequence[int]], pad: int, device: torch.device) -> tuple[Tensor, list[int]]:
    lengths = [len(s) for s in seqs]
    if min(lengths) < 1:
        raise ValueError("every sequence needs at least one token")
    ids = torch.full((len(seqs), max(lengths)), pad, dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
    return ids.to(device), lengths


def length_groups(lengths: Sequence[int], max_padding: float = 0.25) -> list[list[int]]:
    """Indices of ``lengths`` in groups, longest first, each padded to its first (longest) row
    with at most ``max_padding`` x its real tokens added as padding."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    total = 0
    for i in order:
        if groups and lengths[groups[-1][0]] * (len(groups[-1]) + 1) <= (1 + max_padding) * (total + lengths[i]):
            groups[-1].append(i)
            total += lengths[i]
        else:
            groups.append([i])
            total = lengths[i]
    return groups


class LMHead(nn.Module):
    """Hidden states -> vocabulary logits (optionally through BERT's dense/act/LayerNorm)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.mlm_transform:
            self.dense = Linear(cfg.d_model, cfg.d_model)
            self.act = ACTIVATION_FNS[cfg.activation]
            self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.transform = cfg.mlm_transform
        self.proj = Linear(cfg.d_model, cfg.vocab_size, bias=cfg.lm_head_bias)

    def forward(self, h: Tensor) -> Tensor:
        if self.transform:
            h = self.norm(self.act(self.dense(h)))
        return self.proj(h)


def _quantized_shape(module: nn.Module) -> tuple[int, int, bool] | None:
    """(out, in, has bias) of a projection held as quantized weights outside ``parameters()``;
    None for any other module."""
    if hasattr(module, "float_weights"):
        return module.float_weights()
    if isinstance(module, torch.ao.nn.quantized.dynamic.Linear):
        return module.out_features, module.in_features, module.bias() is not None
    return None


class TransformerModel(nn.Module):
    """What the three families share: embeddings, output head, init, tying, buffers."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embeddings(cfg)
        # An embedding-only encoder (sentence-transformers' BertModel) has no output head.
        self.lm_head = LMHead(cfg) if cfg.family != "encoder" or cfg.mlm_head else None
        self.tie_weights()

    def tie_weights(self) -> None:
        # (a table kept as GGUF blocks has its head over the same blocks already: gguf_import)
        if self.cfg.tie_word_embeddings and self.lm_head is not None and isinstance(self.embed.tokens, nn.Embedding):
            self.lm_head.proj.weight = self.embed.tokens.weight

    def reset_buffers(self) -> None:
        self.embed.reset_buffers()

    def optimize_for_inference(self) -> int:
        """Eval mode plus prepacked projection weights (CPU float32); returns how many were
        packed. Costs a second copy of each projection's weights; ``train()`` undoes it."""
        self.eval()
        return sum(m.pack() for m in self.modules() if isinstance(m, Linear))

    def train(self, mode: bool = True) -> TransformerModel:
        if mode:
            for m in self.modules():
                if isinstance(m, Linear):
                    m.packed = None  # weights are about to change
        return super().train(mode)

    def init_weights(self, seed: int | None = None) -> TransformerModel:
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        emb_std = self.cfg.d_model ** -0.5 if self.cfg.scale_embedding else 0.02
        for module in self.modules():
            if isinstance(module, nn.Linear):  # includes our packable Linear
                with torch.no_grad():
                    module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                with torch.no_grad():
                    module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * emb_std)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        self.tie_weights()
        return self

    @property
    def device(self) -> torch.device:
        tokens = self.embed.tokens
        return tokens.weight.device if isinstance(tokens, nn.Embedding) else tokens.device

    @property
    def dtype(self) -> torch.dtype:
        tokens = self.embed.tokens
        return self.embed.compute_dtype or (tokens.weight.dtype if isinstance(tokens, nn.Embedding) else tokens.dtype)

    def num_parameters(self) -> int:
        """The model's weights, however they are held now: a projection whose float weights a
        quantized copy replaced (``model.quant``'s int8 layers, which say what they stand for
        through ``float_weights()``, or torch's dynamic int8 ``Linear``) counts as the float layer it
        replaced, so quantizing or dropping float copies changes no count. Tied tensors count
        once (a tied output head's int8 copy is the embedding table's, already counted)."""
        seen: set[int] = set()
        tied_head = self.lm_head.proj if self.cfg.tie_word_embeddings and self.lm_head is not None else None

        def count(module: nn.Module) -> int:
            shape = _quantized_shape(module)
            if shape is not None:
                dense = getattr(module, "dense", None)
                if dense is not None:  # the float layer is still there: count it (and see ties)
                    return count(dense)
                out_features, in_features, bias = shape
                return (0 if module is tied_head else out_features * in_features) + (out_features if bias else 0)
            own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
            seen.update(id(p) for p in own)
            return sum(p.numel() for p in own) + sum(count(child) for child in module.children())

        return count(self)

    def _final_norm(self) -> nn.Module:
        return make_norm(self.cfg) if self.cfg.final_norm else nn.Identity()

    def _stack(self, n: int, cross: bool = False) -> nn.ModuleList:
        return nn.ModuleList(TransformerLayer(self.cfg, i, cross) for i in range(n))

    def _run_stack(self, layers: nn.ModuleList, x: Tensor, ctx: AttentionContext) -> Tensor:
        for layer in layers:
            x = layer(x, ctx)
        return x


class _CachedDecoder(TransformerModel):
    """The cached decode path shared by DecoderLM and EncoderDecoder."""

    decoder_layers: nn.ModuleList
    decoder_norm: nn.Module

    def new_cache(self, n_slots: int, max_len: int, max_src_len: int = 0,
                  dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                  n_blocks: int | None = None, block_len: int = BLOCK_LEN,
                  pool: BlockRefs | None = None) -> PagedKVCache:
        """A paged cache of ``n_slots`` rows of up to ``max_len`` positions each, in a pool of
        ``n_blocks`` blocks (default: enough for every row at ``max_len``). ``pool``: the
        blocks' bookkeeping (the engine's ``BlockPool``; default plain reference counts)."""
        if max_len > self.cfg.max_positions:
            raise ValueError(f"max_len {max_len} exceeds the model's max_positions {self.cfg.max_positions}")
        return PagedKVCache(
            len(self.decoder_layers), n_slots, self.cfg.kv_heads, self.cfg.head_dim, max_len,
            max_src_len, dtype or self.dtype, device or self.device, n_blocks, block_len, pool,
        )

    def forward_cached(
        self, cache: PagedKVCache, ids: Tensor, slots: Sequence[int], starts: Sequence[int],
        lengths: Sequence[int], decode_kernel: DecodeAttentionKernel | None = None,
    ) -> Tensor:
        """Run ids (B, T) for slots whose history ends at ``starts``; each row has ``lengths``
        real tokens (right padded). Writes their K/V and returns the last real token's
        logits (B, V). ``decode_kernel``: an attention core for one-token rows (a decode step's)."""
        b, t = ids.shape
        ends = [s + n for s, n in zip(starts, lengths)]
        if max(ends) > cache.max_len:
            raise ValueError(f"sequence length {max(ends)} exceeds the KV cache's max_len {cache.max_len}")
        for slot, end in zip(slots, ends):  # the engine gave every row its blocks; a bare cache fills here
            if not cache.ensure(slot, end):
                raise RuntimeError(f"the KV cache's pool of {cache.n_blocks} blocks is exhausted")
        dev = ids.device
        offsets = torch.arange(t, device=dev)
        pos = to_device(starts, torch.long, dev)[:, None] + offsets[None, :]  # (B, T)
        lengths_t = to_device(lengths, torch.long, dev)
        view = self._cache_view(cache, cache.batch(slots), pos, lengths_t, ragged=min(lengths) < t,
                                fresh=all(s == 0 for s in starts),
                                span=min(blocks_for(max(ends), cache.block_len) * cache.block_len, cache.max_len))
        # Nothing cached yet: attend causally over the new tokens alone. Otherwise every row
        # reads the same fixed span and a mask hides what lies beyond its own position.
        mask = None if view.span is None else (cache.key_positions[:view.span][None, None, :] <= pos[:, :, None])
        window = self._window_mask(pos, None if view.span is None else cache.key_positions[:view.span])
        pos = pos.clamp(max=self.cfg.max_positions - 1)  # pad rows past the table (never read)
        x = self.embed(ids, pos)  # (B, T, d)
        ctx = AttentionContext(mask=None if mask is None else mask[:, None], causal=mask is None,
                               rope=self.embed.rotary(pos, x.dtype), cache=view, decode_kernel=decode_kernel,
                               rope_local=self.embed.rotary(pos, x.dtype, local=True), window_mask=window)
        x = self._run_stack(self.decoder_layers, x, ctx)
        last = x[torch.arange(b, device=dev), lengths_t - 1]  # (B, d)
        return self.lm_head(self.decoder_norm(last)).float()

    def _window_mask(self, pos: Tensor, keys: Tensor | None) -> Tensor | None:
        """(B, 1, T, S): the keys each new token at ``pos`` (B, T) sees inside the sliding window:
        key positions in (pos - window, pos]. ``keys``: the positions of the span read from the
        cache, or None when the new tokens attend over themselves alone (keys = ``pos``).
        None when no layer has a window."""
        window = self.cfg.sliding_window
        if window is None:
            return None
        key_pos = pos[:, None, :] if keys is None else keys[None, None, :]  # (B or 1, 1, S)
        query_pos = pos[:, :, None]  # (B, T, 1)
        return ((key_pos <= query_pos) & (key_pos > query_pos - window))[:, None]

    @staticmethod
    def _cache_view(cache: PagedKVCache, batch, pos: Tensor, lengths: Tensor, ragged: bool, fresh: bool,
                    span: int) -> CacheView:
        real = torch.arange(pos.size(1), device=pos.device)[None, :] < lengths[:, None] if ragged else None
        tables = cache.block_tables(batch, span)  # covers every position a real token writes
        view = CacheView(cache, batch, pos.clamp(max=cache.max_len - 1), real, tables, None if fresh else span)
        if cache.max_src_len:
            src_lens = [cache.src_lengths_host[s] for s in batch.slots]
            view.cross_len = max(src_lens)
            if min(src_lens) < view.cross_len:
                view.cross_mask = cache.cross_mask(batch, view.cross_len)
        return view

    def decode_step(self, cache: PagedKVCache, tokens: Tensor, slots: Sequence[int], positions: Sequence[int],
                    attention: DecodeAttentionKernel | None = None) -> Tensor:
        """One new token per slot: tokens (B,) at ``positions`` -> next-token logits (B, V), in
        the weights' own precision. This is the reference the decode steps of ``model.decode``
        are held to (they run it, or replace it); a served model decodes through one of those.

        ``tokens`` may stay on the device (fed straight from the sampler, no host sync).
        """
        return self.forward_cached(cache, tokens.view(-1, 1), slots, positions, [1] * len(slots), attention)


class DecoderLM(_CachedDecoder):
    """Decoder-only language model (GPT style)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.decoder_layers = self._stack(cfg.n_decoder_layers)
        self.decoder_norm = self._final_norm()

    def hidden_states(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Full causal recomputation: ids (B, T), optional (B, T) real-token mask -> (B, T, d)."""
        t = ids.size(1)
        if attention_mask is None:
            positions, mask = torch.arange(t, device=ids.device), None
        else:
            real = attention_mask.bool()
            # Left padding shifts positions; each row also sees itself so a pad row is never empty.
            positions = (real.long().cumsum(-1) - 1).clamp(min=0)
            causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
            mask = (real[:, None, None, :] | torch.eye(t, dtype=torch.bool, device=ids.device)) & causal
        x = self.embed(ids, positions)
        window = None
        if self.cfg.sliding_window is not None:  # by token index: left padding shifts positions, not distances
            index = torch.arange(t, device=ids.device)
            inside = (index[None, :] <= index[:, None]) & (index[None, :] > index[:, None] - self.cfg.sliding_window)
            window = inside[None, None] if mask is None else mask & inside
        ctx = AttentionContext(mask=mask, causal=mask is None, rope=self.embed.rotary(positions, x.dtype),
                               rope_local=self.embed.rotary(positions, x.dtype, local=True), window_mask=window)
        return self.decoder_norm(self._run_stack(self.decoder_layers, x, ctx))

    def forward(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.lm_head(self.hidden_states(ids, attention_mask))  # (B, T, V)

    def prefill(self, cache: PagedKVCache, prompts: Sequence[Sequence[int]], slots: Sequence[int],
                starts: Sequence[int] | None = None) -> Tensor:
        """Write the prompts (or prompt chunks continuing at ``starts``) into their slots;
        returns the logits after each prompt's last token (B, V).

        Prompts of mixed lengths run in length groups (``length_groups``: at most a quarter of
        a group's tokens are padding), not padded to the longest: a burst of new chat requests
        mixes 20-token and 300-token prompts, and padding every row to the longest doubled
        the work of such a step."""
        starts = list(starts or [0] * len(prompts))
        groups = length_groups([len(p) for p in prompts])
        if len(groups) == 1:
            ids, lengths = _padded(prompts, self.cfg.pad_token_id, self.device)
            return self.forward_cached(cache, ids, slots, starts, lengths)
        out: Tensor | None = None
        for group in groups:
            ids, lengths = _padded([prompts[i] for i in group], self.cfg.pad_token_id, self.device)
            logits = self.forward_cached(cache, ids, [slots[i] for i in group], [starts[i] for i in group], lengths)
            if out is None:
                out = logits.new_empty((len(prompts), logits.size(-1)))
            out[to_device(group, torch.long, self.device)] = logits
        return out


class EncoderDecoder(_CachedDecoder):
    """Encoder-decoder (the 2017 paper's translation model); one shared vocabulary."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.encoder_layers = self._stack(cfg.n_encoder_layers)
        self.encoder_norm = self._final_norm()
        self.decoder_layers = self._stack(cfg.n_decoder_layers, cross=True)
        self.decoder_norm = self._final_norm()

    def encode(self, src: Tensor, src_mask: Tensor | None = None) -> Tensor:
        """src (B, S), optional (B, S) real-token mask -> memory (B, S, d)."""
        mask = None if src_mask is None else src_mask.bool()[:, None, None, :]
        positions = torch.arange(src.size(1), device=src.device)
        x = self.embed(src, positions)
        ctx = AttentionContext(mask=mask, rope=self.embed.rotary(positions, x.dtype))
        return self.encoder_norm(self._run_stack(self.encoder_layers, x, ctx))

    def decode(self, memory: Tensor, src_mask: Tensor | None, tgt: Tensor) -> Tensor:
        """Teacher-forced decoder pass: tgt (B, T) -> hidden (B, T, d). Causal; pads in the
        target only affect their own (ignored) rows."""
        cross_mask = None if src_mask is None else src_mask.bool()[:, None, None, :]
        positions = torch.arange(tgt.size(1), device=tgt.device)
        x = self.embed(tgt, positions)
        ctx = AttentionContext(causal=True, rope=self.embed.rotary(positions, x.dtype), memory=memory,
                               memory_mask=cross_mask)
        return self.decoder_norm(self._run_stack(self.decoder_layers, x, ctx))

    def forward(self, src: Tensor, tgt: Tensor, src_mask: Tensor | None = None) -> Tensor:
        return self.lm_head(self.decode(self.encode(src, src_mask), src_mask, tgt))  # (B, T, V)

    def prefill(self, cache: PagedKVCache, sources: Sequence[Sequence[int]], slots: Sequence[int],
                group_sizes: Sequence[int] | None = None, step=None) -> Tensor:
        """Encode the sources once, keep their cross-attention K/V in the slots and feed the
        decoder start token. Source i fills ``group_sizes[i]`` consecutive entries of ``slots``
        (its beams; default: an even split). Returns the first-step logits (len(slots), V).
        ``step``: a decode step (``model.decode``) that feeds the start token, one token per row at
        position 0 as every later token; None: this model's cached forward."""
        if group_sizes is None:
            group, rest = divmod(len(slots), len(sources))
            if rest or group < 1:
                raise ValueError(f"{len(slots)} slots cannot be split evenly over {len(sources)} sources")
            group_sizes = [group] * len(sources)
        if len(group_sizes) != len(sources) or sum(group_sizes) != len(slots) or min(group_sizes) < 1:
            raise ValueError(f"group_sizes {list(group_sizes)} do not cover {len(slots)} slots")
        src, lengths = _padded(sources, self.cfg.pad_token_id, self.device)
        if src.size(1) > cache.max_src_len:
            raise ValueError(f"source length {src.size(1)} exceeds the cache's max_src_len {cache.max_src_len}")
        src_lengths = to_device(lengths, torch.long, self.device)
        src_mask = torch.arange(src.size(1), device=self.device)[None, :] < src_lengths[:, None]  # (B, S)
        memory = self.encode(src, src_mask)  # (B, S, d)
        batch = cache.batch(slots)
        firsts = [0, *itertools.accumulate(group_sizes)][:-1]
        owners = [slots[f] for f in firsts]  # each source's memory, once, in its first row
        owner_batch = cache.batch(owners)
        for i, layer in enumerate(self.decoder_layers):
            k, v = layer.cross_attn.project_kv(memory)  # (B, nh, S, hs) each
            cache.write_cross(i, owner_batch, k, v)
        cache.set_src_lengths(batch, [n for n, g in zip(lengths, group_sizes) for _ in range(g)])
        cache.set_cross_rows(batch, [o for o, g in zip(owners, group_sizes) for _ in range(g)])
        start = torch.full((len(slots), 1), self.cfg.decoder_start_token_id, dtype=torch.long, device=self.device)
        if step is not None:
            return step(cache, start.view(-1), slots, [0] * len(slots))
        return self.forward_cached(cache, start, slots, [0] * len(slots), [1] * len(slots))


class MaskedLM(TransformerModel):
    """Encoder with a masked-LM head (BERT style); also gives contextual embeddings."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.encoder_layers = self._stack(cfg.n_encoder_layers)
        self.encoder_norm = self._final_norm()

    def hidden_states(self, ids: Tensor, attention_mask: Tensor | None = None,
                      token_type_ids: Tensor | None = None) -> Tensor:
        """ids (B, T) -> contextual token embeddings (B, T, d)."""
        mask = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        positions = torch.arange(ids.size(1), device=ids.device)
        x = self.embed(ids, positions, token_type_ids)
        ctx = AttentionContext(mask=mask, rope=self.embed.rotary(positions, x.dtype))
        return self.encoder_norm(self._run_stack(self.encoder_layers, x, ctx))

    def forward(self, ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor:
        if self.lm_head is None:
            raise ValueError("this encoder has no masked-LM head (an embedding model, mlm_head=false); "
                             "use hidden_states() / embed()")
        return self.lm_head(self.hidden_states(ids, attention_mask, token_type_ids))  # (B, T, V)

    def pool(self, hidden: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Sentence embedding (B, d): mean or max over real tokens, or the first ([CLS]) token."""
        if self.cfg.pooling == "cls":
            return hidden[:, 0]
        if attention_mask is None:
            return hidden.amax(dim=1) if self.cfg.pooling == "max" else hidden.mean(dim=1)
        real = attention_mask.bool()[:, :, None]  # (B, T, 1)
        if self.cfg.pooling == "max":  # sentence-transformers sets padding to -1e9 before the max
            return hidden.masked_fill(~real, -1e9).amax(dim=1)
        w = real.to(hidden.dtype)
        return (hidden * w).sum(1) / w.sum(1).clamp(min=1e-9)

    def encode_rows(self, rows: Sequence[Sequence[int]], max_padding: float = 0.25) -> tuple[list[Tensor], Tensor]:
        """Token-id rows of mixed lengths -> (each row's hidden states (T_i, d), pooled (B, d) float32,
        not normalised). Rows run longest first in groups whose padding stays under ``max_padding``
        of their real tokens: one padded batch of mixed lengths spends most of its time on padding."""
        hidden: list[Tensor] = [None] * len(rows)  # type: ignore[list-item]
        pooled = torch.empty(len(rows), self.cfg.d_model, dtype=torch.float32, device=self.device)
        for group in length_groups([len(r) for r in rows], max_padding):
            ids, lengths = _padded([rows[i] for i in group], self.cfg.pad_token_id, self.device)
            real = torch.arange(ids.size(1), device=self.device)[None, :] < to_device(lengths, torch.long,
                                                                                     self.device)[:, None]
            h = self.hidden_states(ids, real if min(lengths) < ids.size(1) else None)  # (b, T, d)
            pooled[group] = self.pool(h, real).float()
            for j, i in enumerate(group):
                hidden[i] = h[j, : lengths[j]]
        return hidden, pooled

    def embed_sentences(self, ids: Tensor, attention_mask: Tensor | None = None,
                        normalize: bool | None = None) -> Tensor:
        """ids (B, T) -> sentence embeddings (B, d) in float32: pooled, then L2-normalised when
        ``normalize`` (default: the config's ``normalize_embeddings``)."""
        pooled = self.pool(self.hidden_states(ids, attention_mask), attention_mask).float()
        normalize = self.cfg.normalize_embeddings if normalize is None else normalize
        return torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled


MODEL_CLASSES: dict[str, type[TransformerModel]] = {
    "encoder-decoder": EncoderDecoder,
    "decoder": DecoderLM,
    "encoder": MaskedLM,
}


def build_model(cfg: ModelConfig) -> TransformerModel:
    """Instantiate the right family for ``cfg`` (weights uninitialised; call init_weights)."""
    return MODEL_CLASSES[cfg.family](cfg)

