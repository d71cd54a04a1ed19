"""Import a llama.cpp GGUF file as one of our models (a DecoderLM of Llama's architecture or one derived from it).

    from model.formats.gguf_import import load_gguf
    g = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    g.model, g.tokenizer, g.config, g.chat_template

The GGUF metadata is the single source: the config comes from ``<arch>.*`` keys, the
tokenizer from ``tokenizer.ggml.*`` (model.tokenization.gguf_vocab), the chat template from
``tokenizer.chat_template``. The file is memory-mapped (``GGUFFile``) and read tensor by
tensor into a model built on the meta device (``gguf_model``): each tensor is dequantized to
float32 and placed before the next is read, so a load holds the model plus one tensor's float
copy, never a second model. ``projection_for`` is the one place a projection's representation
is chosen (the supported types are in ``SUPPORTED_TYPES``; any other fails naming tensor and
type).

Architectures (``general.architecture``; ``_lineage`` says what each adds to a Llama):
``llama`` (Llama, SmolLM2, Mistral), ``qwen2``, ``qwen3``, ``gemma3`` (text), ``phi3``.
llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` for its interleaved
(GPT-J style) RoPE only for ``llama``; they are put back into Hugging Face's rotate-half
order here, which is what our rotary layer expects. The other lineages use llama.cpp's NeoX
RoPE and are stored unpermuted. Gemma's ``1 + w`` norm weights are stored with the 1 added.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from torch import Tensor, nn

from model.config import ConfigError, ModelConfig
from model.formats.checkpoint import TIED_KEY, CheckpointError
from model.formats.gguf_header import read_header
from model.formats.gguf_stored import stored_embedding_, stored_rows
from model.formats.hf.llama import llama_model_config
from model.nn.transformer import TransformerModel, build_model
from model.quant.kquant import KQuantLinear, StoredEmbedding, stored_weights
from model.tokenization.gguf_vocab import GGUFTokenizerError, gguf_tokenizer
from model.tokenization.tokenizer import Tokenizer

log = logging.getLogger(__name__)
Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q6_K)  # each one tested
ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "phi3")

class GGUFImportError(CheckpointError):
    """A GGUF file that cannot be imported; the message names the file and the key or tensor."""


@dataclass
class GGUFModel:
    model: TransformerModel
    config: ModelConfig
    tokenizer: Tokenizer
    architecture: str  # general.architecture, e.g. "llama"
    path: Path
    chat_template: str | None = None
    stop_token_ids: list[int] = field(default_factory=list)  # end generation besides config.eos_token_id
    metadata: dict[str, Any] = field(default_factory=dict)  # general.* strings (name, license, ...)
    notes: list[str] = field(default_factory=list)  # what the import changed beyond a 1:1 copy


@dataclass
class GGUFTensor:
    """One tensor of the file: its data is a numpy view of the map, shaped as gguf's reader
    shapes it (outermost first; a quantized type's rows as bytes)."""

    name: str
    tensor_type: int
    shape: np.ndarray  # as stored: innermost dimension first
    n_bytes: int
    data: np.ndarray


_PLAIN = {Q.F16: np.float16, Q.F32: np.float32, Q.F64: np.float64, Q.I8: np.int8, Q.I16: np.int16,
          Q.I32: np.int32, Q.I64: np.int64}


class GGUFFile:
    """Metadata and tensors of one file: the header read by ``gguf_header`` (arrays as lists),
    the tensors' data as views of one read-only memory map. gguf's own reader made a numpy view
    per element of every metadata array, ~30 s of each start for a 151k-token vocabulary."""

    def __init__(self, path: Path):
        self.path = path
        if not path.is_file():
            raise GGUFImportError(f"{path}: file not found")
        try:
            header = read_header(path, arrays=True)
            self.map = np.memmap(path, dtype=np.uint8, mode="r")
            self.tensors = {}
            for t in header.tensors:
                if t.name in self.tensors:
                    raise ValueError(f"tensor {t.name!r} appears twice")
                qtype = Q(t.ggml_type)
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                n_bytes = t.n_elements * type_size // block
                start = header.data_start + t.offset
                if start + n_bytes > self.map.size:
                    raise ValueError(f"tensor {t.name!r} runs past the end of the file")
                dims = tuple(reversed(t.shape))
                raw = self.map[start:start + n_bytes]
                if qtype in _PLAIN:
                    data = raw.view(_PLAIN[qtype]).reshape(dims)
                else:
                    data = raw.reshape(gguf.quants.quant_shape_to_byte_shape(dims, qtype))
                self.tensors[t.name] = GGUFTensor(t.name, int(qtype), np.array(t.shape, dtype=np.uint64), n_bytes,
                                                  data)
        except Exception as exc:  # noqa: BLE001 - the header reader's errors, struct errors, unknown types
            raise GGUFImportError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
        self.fields = header.fields
        self.used: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def require(self, key: str, kind: type = int) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFImportError(f"{self.path}: metadata '{key}' is missing")
        if kind in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise GGUFImportError(f"{self.path}: metadata '{key}' is {value!r}; expected a number")
        return kind(value)

    def take(self, name: str) -> Tensor:
        """A float32 tensor in PyTorch's (out, in) order, dequantized if need be."""
        info = self.tensors.get(name)
        if info is None:
            raise GGUFImportError(f"{self.path}: missing tensor '{name}'")
        qtype = Q(info.tensor_type)
        if qtype not in SUPPORTED_TYPES:
            supported = ", ".join(t.name for t in SUPPORTED_TYPES)
            raise GGUFImportError(f"{self.path}: tensor '{name}' has type {qtype.name}, which is not supported "
                                  f"(supported: {supported})")
        shape = tuple(int(n) for n in reversed(info.shape.tolist()))  # GGUF lists the fastest dimension first
        try:
            values = gguf.quants.dequantize(info.data, qtype)
        except Exception as exc:  # noqa: BLE001
            raise GGUFImportError(f"{self.path}: tensor '{name}' ({qtype.name}) cannot be dequantized "
                                  f"({type(exc).__name__}: {exc})") from None
        self.used.add(name)
        values = np.asarray(values, dtype=np.float32).reshape(shape)
        if np.may_share_memory(values, info.data):  # F32 data is a view of the mapped file: copy it off
            values = values.copy()
        return torch.from_numpy(values)


def unpermute_rope_rows(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's q/k row order. Within each head its converter interleaves the two
    rotary halves (rows 0, d/2, 1, d/2+1, ...); rotate-half wants them back as two blocks."""
    rows, cols = w.shape
    head_dim = rows // n_heads
    # (heads, d/2, 2, in): file order -> (heads, 2, d/2, in): HF order
    return w.reshape(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


GEMMA3_SWA_PATTERN = 6  # llama.cpp and transformers: every 6th Gemma 3 layer is global, the others local
GEMMA3_LOCAL_THETA = 10_000.0  # llama.cpp's rope_freq_base_train_swa for gemma3


def _window(f: GGUFFile, arch: str, max_positions: int, layers: list[int] | None = None,
            keep: bool = False) -> dict[str, Any]:
    """sliding_window (+ layers) from ``<arch>.attention.sliding_window``; a window no shorter than
    the context is dropped unless ``keep`` (its layers have their own rotary base)."""
    window = f.get(f"{arch}.attention.sliding_window")
    if window is None or window == 0:
        return {}
    if not isinstance(window, int) or window < 0:
        raise GGUFImportError(f"{f.path}: metadata '{arch}.attention.sliding_window' is {window!r}; expected a "
                              "positive integer")
    if window >= max_positions and not keep:
        return {}
    return {"sliding_window": int(window), "sliding_window_layers": layers}


def _longrope(f: GGUFFile, arch: str, head_dim: int, max_positions: int) -> dict[str, Any]:
    """Phi-3's LongRoPE as llama.cpp stores it (rope_factors_short/long tensors, the attention factor
    and the original context under rope.scaling.*): the short factors, served up to the original
    context, as from a Hugging Face directory (model.formats.hf.phi3)."""
    if "rope_factors_short.weight" not in f.tensors:
        return {}
    short = f.take("rope_factors_short.weight")
    if "rope_factors_long.weight" in f.tensors:
        f.take("rope_factors_long.weight")  # beyond the original context, which we do not serve
    if short.numel() != head_dim // 2:
        raise GGUFImportError(f"{f.path}: tensor 'rope_factors_short.weight' has {short.numel()} values; expected "
                              f"{head_dim // 2}")
    original = f.require(f"{arch}.rope.scaling.original_context_length")
    factor = max_positions / original
    attention = f.get(f"{arch}.rope.scaling.attn_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_scaling": {"type": "longrope", "factors": [float(x) for x in short.tolist()],
                             "attention_factor": float(attention)},
            "max_positions": min(max_positions, int(original))}


def _lineage(f: GGUFFile, arch: str, head_dim: int, max_positions: int, n_layers: int) -> dict[str, Any]:
    """The ModelConfig fields by which ``arch`` differs from a Llama, as llama.cpp reads its file."""
    if arch == "llama":  # Llama, SmolLM2, Mistral (whose window, where a file gives one, is on every layer)
        return _window(f, arch, max_positions)
    if arch == "qwen2":
        return {"qkv_bias": True}
    if arch == "qwen3":
        return {"qk_norm": True}
    if arch == "phi3":
        return {**_longrope(f, arch, head_dim, max_positions), **_window(f, arch, max_positions)}
    if arch == "gemma3":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if f.get(f"{arch}.{key}") is not None:
                raise GGUFImportError(f"{f.path}: metadata '{arch}.{key}' is set; logit soft-capping is not "
                                      "implemented")
        local = [i for i in range(n_layers) if (i + 1) % GEMMA3_SWA_PATTERN]
        window = _window(f, arch, max_positions, local if len(local) < n_layers else None, keep=True)
        return {"qk_norm": True, "post_sublayer_norm": True, "scale_embedding": True, "activation": "gelu_new",
                # llama.cpp scales scores by 1/sqrt(head_dim) (query_pre_attn_scalar = head_dim but for 27B)
                "attention_scale": head_dim ** -0.5,
                "local_rope_theta": GEMMA3_LOCAL_THETA if window else None, **window}
    raise AssertionError(arch)


def gguf_config(f: GGUFFile) -> ModelConfig:
    arch = f.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFImportError(f"{f.path}: metadata 'general.architecture' is {arch!r}; "
                              f"supported: {list(ARCHITECTURES)}")
    k = lambda name: f"{arch}.{name}"
    d_model = f.require(k("embedding_length"))
    n_heads = f.require(k("attention.head_count"))
    n_kv = f.get(k("attention.head_count_kv"), n_heads)
    if not isinstance(n_kv, int):  # llama.cpp allows a per-layer list, for models that vary it
        raise GGUFImportError(f"{f.path}: metadata '{k('attention.head_count_kv')}' is {n_kv!r}; expected one "
                              "count for all layers")
    head_dim = f.get(k("attention.key_length")) or (d_model // n_heads if n_heads else 0)
    for key in ("rope.dimension_count", "attention.value_length"):
        value = f.get(k(key))
        if value is not None and value != head_dim:
            raise GGUFImportError(f"{f.path}: metadata '{k(key)}' is {value}; only {head_dim} "
                                  f"(the head size) is supported")
    if "rope_freqs.weight" in f.tensors:
        raise GGUFImportError(f"{f.path}: tensor 'rope_freqs.weight' (per-frequency RoPE factors, as llama.cpp "
                              "writes Llama 3.1 scaling) is not supported")
    scaling = None
    kind = f.get(k("rope.scaling.type"), "none")
    if kind == "linear":
        scaling = {"type": "linear", "factor": f.require(k("rope.scaling.factor"), float)}
    elif kind != "none":
        raise GGUFImportError(f"{f.path}: metadata '{k('rope.scaling.type')}' is {kind!r}; supported: 'none', "
                              "'linear'")
    tokens = f.get("tokenizer.ggml.tokens") or []
    embed = f.tensors.get("token_embd.weight")
    vocab = f.get(k("vocab_size")) or (int(embed.shape[1]) if embed is not None else len(tokens))
    max_positions = f.require(k("context_length"))
    n_layers = f.require(k("block_count"))
    lineage = _lineage(f, arch, head_dim, max_positions, n_layers)
    if d_model % n_heads or head_dim != d_model // n_heads:
        lineage["head_dim_override"] = head_dim
    if "rope_scaling" in lineage:  # Phi-3's LongRoPE: its factors, and the context it is exact over
        if scaling is not None:
            raise GGUFImportError(f"{f.path}: both '{k('rope.scaling.type')}' and LongRoPE factors are set")
        scaling = lineage.pop("rope_scaling")
        max_positions = lineage.pop("max_positions")
    try:
        return llama_model_config(
            vocab_size=int(vocab), d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv,
            n_layers=n_layers, d_ff=f.require(k("feed_forward_length")),
            max_positions=max_positions, rope_theta=f.get(k("rope.freq_base"), 10000.0),
            rope_scaling=scaling, rms_eps=f.require(k("attention.layer_norm_rms_epsilon"), float),
            # llama.cpp writes the output projection only when it is not the embedding matrix.
            tie_word_embeddings="output.weight" not in f.tensors,
            bos=f.get("tokenizer.ggml.bos_token_id"), eos=f.get("tokenizer.ggml.eos_token_id"),
            pad=f.get("tokenizer.ggml.padding_token_id"), **lineage,
        )
    except ConfigError as exc:
        raise GGUFImportError(f"{f.path}: {exc}") from None


# llama.cpp's per-layer norm names -> ours; Gemma 3 has four per block.
LLAMA_NORMS = {"attn_norm": "self_attn_norm", "ffn_norm": "ffn_norm"}
GEMMA3_NORMS = {"attn_norm": "self_attn_norm", "post_attention_norm": "self_attn_post_norm",
                "ffn_norm": "ffn_norm", "post_ffw_norm": "ffn_post_norm"}


@dataclass(frozen=True)
class Rows:
    """Rows of a GGUF matrix as one of our projections reads them: all of ``tensor``'s, in the
    file's order, or those ``select`` lists (an index tensor: Llama's q/k row order, Phi-3's
    gate/up halves). GGUF blocks run along a row, so a selection of rows is one of stored
    blocks as well as of floats."""

    tensor: str
    select: Tensor | None = None


def projection_for(f: GGUFFile, parts: list[Rows], bias: Tensor | None, like: nn.Module,
                   stored: bool = False) -> nn.Module:
    """The module that serves one projection whose weight is ``parts``' rows stacked in order
    (q, k and v fused: three parts): the one place its representation is chosen. ``stored``
    (``TSERVE_GGUF_WEIGHTS=stored``) and every part of a type the block kernels read: a
    ``KQuantLinear`` over the file's bytes (views of the map; a row selection that is not one run
    copies that tensor's bytes), no float weight ever made. Else a float ``Linear`` (``like``, the
    model's own layer on the meta device) holding the dequantized rows, built part by part: at
    most the result and one part's float copy exist at a time."""
    raws = [stored_rows(f, part.tensor, part.select) for part in parts] if stored else [None]
    if all(r is not None for r in raws):
        layer = KQuantLinear(raws, like.in_features, bias)  # type: ignore[arg-type]
        if layer.out_features != like.out_features:
            raise GGUFImportError(f"{f.path}: tensors {[p.tensor for p in parts]} have {layer.out_features} rows; "
                                  f"the metadata implies {like.out_features}")
        for part in parts:
            f.used.add(part.tensor)
        return layer
    weight = stacked_rows(f, parts, tuple(like.weight.shape))
    like.weight = nn.Parameter(weight)
    if bias is not None:
        like.bias = nn.Parameter(bias)
    return like


def stacked_rows(f: GGUFFile, parts: list[Rows], shape: tuple[int, int]) -> Tensor:
    """``parts``' rows dequantized into one float32 (out, in) matrix, one part at a time."""
    weight = torch.empty(shape, dtype=torch.float32)
    row = 0
    for part in parts:
        w = f.take(part.tensor)
        if part.select is not None:
            w = w[part.select]
        if w.shape[1] != weight.shape[1] or row + w.shape[0] > weight.shape[0]:
            raise GGUFImportError(f"{f.path}: tensor '{part.tensor}' has shape {list(w.shape)}; the metadata implies "
                                  f"{weight.shape[1]} inputs and {weight.shape[0]} outputs in all for "
                                  f"{[p.tensor for p in parts]}")
        weight[row:row + w.shape[0]] = w
        row += w.shape[0]
        del w
    if row != weight.shape[0]:
        raise GGUFImportError(f"{f.path}: tensors {[p.tensor for p in parts]} have {row} rows; the metadata implies "
                              f"{weight.shape[0]}")
    return weight


def float_tensors(f: GGUFFile, cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], Iterator[tuple[str, Tensor]]]:
    """Our state dict as float32 tensors (a tied head's key aside): every name and shape at
    once, then the tensors one at a time as they are dequantized, for a writer that never holds
    more than one (``model.formats.import_cache`` writes a converted checkpoint so)."""
    with torch.device("meta"):
        model = build_model(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()
              if not (cfg.tie_word_embeddings and k == TIED_KEY)}
    projections, tensors = gguf_layout(f, cfg)
    thunks: dict[str, Any] = {}  # in the order they are written
    for name, parts in projections.items():
        thunks[f"{name}.weight"] = lambda parts=parts, shape=shapes[f"{name}.weight"]: stacked_rows(f, parts, shape)
        if f"{name}.bias" in shapes:
            theirs = tensors.pop(f"{name}.bias", None) or [f"{name}.bias"]
            thunks[f"{name}.bias"] = lambda theirs=theirs, shape=shapes[f"{name}.bias"]: _concat(f, theirs, shape)
    for ours, theirs in tensors.items():
        shape = shapes.get(ours, ())
        thunks[ours] = lambda theirs=theirs, shape=shape: _concat(f, theirs, shape)
    if set(thunks) != set(shapes):  # an importer bug rather than a bad file, but still say what is missing
        raise GGUFImportError(f"{f.path}: no tensor for our parameter(s) {sorted(set(shapes) - set(thunks))[:5]}")
    return {k: shapes[k] for k in thunks}, ((k, make()) for k, make in thunks.items())


def _head_rows(f: GGUFFile, name: str, n_heads: int, permuted: bool) -> Rows:
    """q or k rows in rotate-half order (``unpermute_rope_rows`` where llama.cpp permuted them)."""
    if not permuted:
        return Rows(name)
    rows = int(f.tensors[name].shape[-1]) if name in f.tensors else 0
    return Rows(name, unpermute_rope_rows(torch.arange(rows).view(rows, 1), n_heads).view(-1) if rows else None)


def gguf_layout(f: GGUFFile, cfg: ModelConfig) -> tuple[dict[str, list[Rows]], dict[str, list[str]]]:
    """Where each of our tensors comes from: the projections (our module name -> the rows that
    make its weight) and every other tensor (our state-dict name -> the GGUF tensors concatenated
    into it: a fused bias has three, the rest one)."""
    arch = f.get("general.architecture")
    projections: dict[str, list[Rows]] = {}
    tensors: dict[str, list[str]] = {"embed.tokens.weight": ["token_embd.weight"]}
    for i in range(cfg.n_decoder_layers):
        ours, theirs = f"decoder_layers.{i}", f"blk.{i}"
        if arch == "phi3":  # fused already, in our q, k, v row order
            projections[f"{ours}.self_attn.qkv_proj"] = [Rows(f"{theirs}.attn_qkv.weight")]
        else:
            permuted = arch == "llama"
            projections[f"{ours}.self_attn.qkv_proj"] = [
                _head_rows(f, f"{theirs}.attn_q.weight", cfg.n_heads, permuted),
                _head_rows(f, f"{theirs}.attn_k.weight", cfg.kv_heads, permuted), Rows(f"{theirs}.attn_v.weight")]
        if cfg.qkv_bias:
            tensors[f"{ours}.self_attn.qkv_proj.bias"] = [f"{theirs}.attn_{x}.bias" for x in "qkv"]
        if cfg.qk_norm:
            tensors[f"{ours}.self_attn.q_norm.weight"] = [f"{theirs}.attn_q_norm.weight"]
            tensors[f"{ours}.self_attn.k_norm.weight"] = [f"{theirs}.attn_k_norm.weight"]
        projections[f"{ours}.self_attn.out_proj"] = [Rows(f"{theirs}.attn_output.weight")]
        for their_name, our_name in (GEMMA3_NORMS if cfg.post_sublayer_norm else LLAMA_NORMS).items():
            tensors[f"{ours}.{our_name}.weight"] = [f"{theirs}.{their_name}.weight"]
        if arch != "phi3":
            projections[f"{ours}.ffn.gate"] = [Rows(f"{theirs}.ffn_gate.weight")]
            projections[f"{ours}.ffn.up"] = [Rows(f"{theirs}.ffn_up.weight")]
        else:  # ffn_up holds the gate rows, then the up rows
            d_ff = cfg.d_ff
            projections[f"{ours}.ffn.gate"] = [Rows(f"{theirs}.ffn_up.weight", torch.arange(d_ff))]
            projections[f"{ours}.ffn.up"] = [Rows(f"{theirs}.ffn_up.weight", torch.arange(d_ff, 2 * d_ff))]
        projections[f"{ours}.ffn.down"] = [Rows(f"{theirs}.ffn_down.weight")]
    tensors["decoder_norm.weight"] = ["output_norm.weight"]
    if not cfg.tie_word_embeddings:
        projections["lm_head.proj"] = [Rows("output.weight")]
    return projections, tensors


def gguf_model(f: GGUFFile, cfg: ModelConfig, stored: bool = False) -> TransformerModel:
    """Our model from the file, tensor by tensor: each is dequantized (or taken as
    ``projection_for`` chooses) and placed before the next is read, so the float copies of a
    load never exceed one tensor beyond what the model keeps. ``stored``: the projections and the
    token embeddings of types the block kernels read stay the file's blocks (``StoredEmbedding``;
    a tied head is a ``KQuantLinear`` over the same blocks); norms and biases are float."""
    with torch.device("meta"):
        model = build_model(cfg)
    projections, tensors = gguf_layout(f, cfg)
    embedding = stored_rows(f, "token_embd.weight") if stored else None
    if embedding is not None:  # the token table (and a tied head) as the file's blocks
        if embedding[0].shape[0] != cfg.vocab_size:
            raise GGUFImportError(f"{f.path}: tensor 'token_embd.weight' has {embedding[0].shape[0]} rows; the "
                                  f"metadata implies {cfg.vocab_size}")
        stored_embedding_(model, embedding, cfg)
        del tensors["embed.tokens.weight"]
        f.used.add("token_embd.weight")
    for name, parts in projections.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        like = getattr(parent, attr)
        bias = None
        if like.bias is not None:  # a fused bias is one of `tensors`; the layer takes it with its weight
            bias = _concat(f, tensors.pop(f"{name}.bias", None) or [f"{name}.bias"], tuple(like.bias.shape))
        setattr(parent, attr, projection_for(f, parts, bias, like, stored))
    state = {}
    for ours, theirs in tensors.items():
        ref = model.get_parameter(ours)
        state[ours] = _concat(f, theirs, tuple(ref.shape))
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:  # an importer bug rather than a bad file, but still say what is missing
        raise GGUFImportError(f"{f.path}: no tensor for our parameter(s) {missing[:5]}")
    model.reset_buffers()
    return model.eval()


def _concat(f: GGUFFile, names: list[str], shape: tuple[int, ...]) -> Tensor:
    t = f.take(names[0]) if len(names) == 1 else torch.cat([f.take(n) for n in names])
    if tuple(t.shape) != shape:
        raise GGUFImportError(f"{f.path}: tensor '{' + '.join(names)}' has shape {list(t.shape)} but the metadata "
                              f"implies {list(shape)}")
    return t


def open_gguf(path: str | Path) -> tuple[GGUFFile, ModelConfig, Tokenizer]:
    """The file mapped, its config and tokenizer (checked against each other); no tensor read."""
    f = GGUFFile(Path(path))
    cfg = gguf_config(f)
    try:
        tokenizer = gguf_tokenizer(f.get)
    except GGUFTokenizerError as exc:
        raise GGUFImportError(f"{f.path}: {exc}") from None
    if tokenizer.vocab_size > cfg.vocab_size:
        raise GGUFImportError(f"{f.path}: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary "
                              f"is {cfg.vocab_size}")
    return f, cfg, tokenizer


def check_all_used(f: GGUFFile) -> None:
    left_over = sorted(set(f.tensors) - f.used)
    if left_over:
        raise GGUFImportError(f"{f.path}: tensor(s) {left_over[:5]}{' and more' if len(left_over) > 5 else ''} are "
                              f"not used by the {f.get('general.architecture')} import; the metadata does not "
                              "describe them")


def chat_and_stops(f: GGUFFile, cfg: ModelConfig) -> tuple[str | None, list[int]]:
    """The chat template and the stop ids besides ``cfg.eos_token_id`` (end of turn, of message)."""
    stops = [f.get(f"tokenizer.ggml.{name}_token_id") for name in ("eot", "eom")]
    return f.get("tokenizer.chat_template"), sorted({s for s in stops if isinstance(s, int) and s != cfg.eos_token_id})


def load_gguf(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> GGUFModel:
    """Read a GGUF file into our model (float32, or ``dtype``), tokenizer, config and chat template."""
    f, cfg, tokenizer = open_gguf(path)
    stored = stored_weights() and torch.device(device).type == "cpu"  # the file's blocks read in place
    model = gguf_model(f, cfg, stored)
    check_all_used(f)
    if dtype is not None and dtype != torch.float32 or torch.device(device).type != "cpu":
        model.to(device=device, dtype=dtype)
    if stored and any(isinstance(m, (KQuantLinear, StoredEmbedding)) for m in model.modules()):
        from model.decode import native

        try:
            native.build()  # the block kernels; without them each call dequantizes its weights
        except RuntimeError as exc:
            log.warning("%s; the stored GGUF blocks are dequantized on each call", exc)
    template, stops = chat_and_stops(f, cfg)
    general = {key[len("general."):]: f.get(key) for key in f.fields
               if key.startswith("general.") and isinstance(f.get(key), str)}
    types = sorted({Q(f.tensors[name].tensor_type).name for name in f.used})
    kept = sorted({p.qtype.name for m in model.modules() if isinstance(m, KQuantLinear) for p in m.parts}
                  | {m.qtype.name for m in model.modules() if isinstance(m, StoredEmbedding)})
    notes = [f"tensors stored as {', '.join(types)} were dequantized to {str(dtype or torch.float32)[6:]}"
             + (f", but for the {', '.join(kept)} blocks, read as stored" if kept else "")]
    return GGUFModel(model, cfg, tokenizer, str(f.get("general.architecture")), f.path, template, stops, general,
                     notes)


def is_gguf_file(path: str | Path) -> bool:
    """A file that starts with the GGUF magic."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False
