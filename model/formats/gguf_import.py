"""Import a llama.cpp GGUF file as one of our models (a Llama-architecture DecoderLM).

    from model.formats.gguf_import import load_gguf
    g = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
    g.model, g.tokenizer, g.config, g.chat_template

The GGUF metadata is the single source: the config comes from ``llama.*`` keys, the
tokenizer from ``tokenizer.ggml.*`` (model.tokenization.gguf_vocab), the chat template from
``tokenizer.chat_template``. Quantized tensors are dequantized to float32 at load time
(the supported types are in ``SUPPORTED_TYPES``; any other fails naming tensor and type).

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` for its interleaved
(GPT-J style) RoPE; they are put back into Hugging Face's rotate-half order here, which is
what our rotary layer expects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from torch import Tensor

from model.config import ConfigError, ModelConfig
from model.formats.checkpoint import CheckpointError
from model.formats.hf.format import TensorMap
from model.formats.hf.importer import build_imported
from model.formats.hf.llama import llama_model_config
from model.nn.transformer import TransformerModel
from model.tokenization.gguf_vocab import GGUFTokenizerError, byte_level_tokenizer
from model.tokenization.tokenizer import Tokenizer

Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q6_K)  # each one tested
ARCHITECTURES = ("llama",)

# llama.cpp's per-layer tensor names -> ours (the q/k/v projections are fused separately).
LAYER_TENSORS = {
    "attn_norm": "self_attn_norm",
    "attn_output": "self_attn.out_proj",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "ffn.gate",
    "ffn_up": "ffn.up",
    "ffn_down": "ffn.down",
}


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


class GGUFFile:
    """Metadata and tensors of one file, read through gguf's memory-mapped reader."""

    def __init__(self, path: Path):
        self.path = path
        if not path.is_file():
            raise GGUFImportError(f"{path}: file not found")
        try:
            self.reader = gguf.GGUFReader(str(path))
        except Exception as exc:  # noqa: BLE001 - the reader raises ValueError, struct errors, ...
            raise GGUFImportError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.used: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        found = self.reader.get_field(key)
        if found is None:
            return default
        try:
            return found.contents()
        except Exception as exc:  # noqa: BLE001
            raise GGUFImportError(f"{self.path}: metadata '{key}' cannot be read ({exc})") from None

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
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))  # a copy, off the mmap


def unpermute_rope_rows(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's q/k row order. Within each head its converter interleaves the two
    rotary halves (rows 0, d/2, 1, d/2+1, ...); rotate-half wants them back as two blocks."""
    rows, cols = w.shape
    head_dim = rows // n_heads
    # (heads, d/2, 2, in): file order -> (heads, 2, d/2, in): HF order
    return w.reshape(n_heads, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


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
    head_dim = d_model // n_heads if n_heads else 0
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        value = f.get(k(key))
        if value is not None and value != head_dim:
            raise GGUFImportError(f"{f.path}: metadata '{k(key)}' is {value}; only {head_dim} "
                                  f"(embedding_length / head_count) is supported")
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
    try:
        return llama_model_config(
            vocab_size=int(vocab), d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv,
            n_layers=f.require(k("block_count")), d_ff=f.require(k("feed_forward_length")),
            max_positions=f.require(k("context_length")), rope_theta=f.get(k("rope.freq_base"), 10000.0),
            rope_scaling=scaling, rms_eps=f.require(k("attention.layer_norm_rms_epsilon"), float),
            # llama.cpp writes the output projection only when it is not the embedding matrix.
            tie_word_embeddings="output.weight" not in f.tensors,
            bos=f.get("tokenizer.ggml.bos_token_id"), eos=f.get("tokenizer.ggml.eos_token_id"),
            pad=f.get("tokenizer.ggml.padding_token_id"),
        )
    except ConfigError as exc:
        raise GGUFImportError(f"{f.path}: {exc}") from None


def gguf_tensors(f: GGUFFile, cfg: ModelConfig) -> TensorMap:
    out = TensorMap()
    out.put("embed.tokens.weight", f.take("token_embd.weight"), "token_embd.weight")
    for i in range(cfg.n_decoder_layers):
        ours, theirs = f"decoder_layers.{i}", f"blk.{i}"
        q = unpermute_rope_rows(f.take(f"{theirs}.attn_q.weight"), cfg.n_heads)
        k = unpermute_rope_rows(f.take(f"{theirs}.attn_k.weight"), cfg.kv_heads)
        v = f.take(f"{theirs}.attn_v.weight")
        out.put(f"{ours}.self_attn.qkv_proj.weight", torch.cat([q, k, v], dim=0),
                f"{theirs}.attn_q/attn_k/attn_v.weight")
        for their_name, our_name in LAYER_TENSORS.items():
            out.put(f"{ours}.{our_name}.weight", f.take(f"{theirs}.{their_name}.weight"),
                    f"{theirs}.{their_name}.weight")
    out.put("decoder_norm.weight", f.take("output_norm.weight"), "output_norm.weight")
    if not cfg.tie_word_embeddings:
        out.put("lm_head.proj.weight", f.take("output.weight"), "output.weight")
    return out


def load_gguf(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> GGUFModel:
    """Read a GGUF file into our model (float32, or ``dtype``), tokenizer, config and chat template."""
    f = GGUFFile(Path(path))
    cfg = gguf_config(f)
    try:
        tokenizer = byte_level_tokenizer(f.get)
    except GGUFTokenizerError as exc:
        raise GGUFImportError(f"{f.path}: {exc}") from None
    if tokenizer.vocab_size > cfg.vocab_size:
        raise GGUFImportError(f"{f.path}: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary "
                              f"is {cfg.vocab_size}")
    tensors = gguf_tensors(f, cfg)
    left_over = sorted(set(f.tensors) - f.used)
    if left_over:
        raise GGUFImportError(f"{f.path}: tensor(s) {left_over[:5]}{' and more' if len(left_over) > 5 else ''} are "
                              f"not used by the {f.get('general.architecture')} import; the metadata does not "
                              "describe them")
    if dtype is not None:
        tensors.tensors = {name: t.to(dtype) for name, t in tensors.tensors.items()}
    model = build_imported(cfg, tensors, f.path, device, described_by="the GGUF metadata")
    template = f.get("tokenizer.chat_template")
    stops = [f.get(f"tokenizer.ggml.{name}_token_id") for name in ("eot", "eom")]
    stops = sorted({s for s in stops if isinstance(s, int) and s != cfg.eos_token_id})
    general = {key[len("general."):]: f.get(key) for key in f.reader.fields
               if key.startswith("general.") and isinstance(f.get(key), str)}
    types = sorted({Q(f.tensors[name].tensor_type).name for name in f.used})
    notes = [f"tensors stored as {', '.join(types)} were dequantized to {str(dtype or torch.float32)[6:]}"]
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
