"""Import a local Hugging Face model directory as one of our models.

    from model.formats.hf.importer import load_hf
    hf = load_hf("downloads/opus-mt-en-de")  # config.json + model.safetensors + tokenizer files
    hf.model, hf.tokenizer, hf.config        # EncoderDecoder, Tokenizer, ModelConfig

Supported: GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM,
Phi3ForCausalLM and Gemma3ForCausalLM -> DecoderLM, BertForMaskedLM -> MaskedLM, BertModel -> MaskedLM without
head, MarianMTModel -> EncoderDecoder (one file per architecture in model/formats/hf/ holds the mapping).
Nothing is downloaded and no pickle is loaded; transformers is not needed.
Every unsupported setting, missing or left-over tensor is an ``HFImportError`` naming it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from model.config import ConfigError, ModelConfig
from model.formats.checkpoint import TIED_KEY
from model.formats.hf.bert import BERT, BERT_MODEL
from model.formats.hf.format import (
    HF_CONFIG_FILE,
    HFConfig,
    HFImportError,
    HFWeights,
    Importer,
    TensorMap,
    eos_token_ids,
    read_chat_template,
    read_json,
)
from model.formats.hf.gemma3 import GEMMA3
from model.formats.hf.gpt2 import GPT2
from model.formats.hf.llama import LLAMA
from model.formats.hf.marian import MARIAN
from model.formats.hf.mistral import MISTRAL
from model.formats.hf.phi3 import PHI3
from model.formats.hf.qwen2 import QWEN2
from model.formats.hf.qwen3 import QWEN3
from model.nn.transformer import TransformerModel, build_model
from model.tokenization.tokenizer import Tokenizer

IMPORTERS: dict[str, Importer] = {imp.architecture: imp for imp in (
    GPT2, LLAMA, QWEN2, QWEN3, MISTRAL, PHI3, GEMMA3, BERT, BERT_MODEL, MARIAN)}

__all__ = ["IMPORTERS", "HFImportError", "HFModel", "build_imported", "is_hf_model_dir", "load_hf"]


@dataclass
class HFModel:
    model: TransformerModel
    config: ModelConfig
    tokenizer: Tokenizer
    architecture: str  # the HF class it came from, e.g. "GPT2LMHeadModel"
    path: Path
    notes: list[str] = field(default_factory=list)  # what the import changed beyond a 1:1 copy
    chat_template: str | None = None  # Jinja source, rendered only by model.tokenization.chat_template's sandbox
    stop_token_ids: list[int] = field(default_factory=list)  # end generation besides config.eos_token_id


def is_hf_model_dir(path: str | Path) -> bool:
    """A directory whose config.json is in the HF layout (ours has a "family" field instead)."""
    config = Path(path) / HF_CONFIG_FILE
    if not config.is_file():
        return False
    try:
        data = read_json(config)
    except HFImportError:
        return False
    return "family" not in data and ("architectures" in data or "model_type" in data)


def find_importer(path: Path, data: dict[str, Any]) -> Importer:
    architectures = data.get("architectures") or []
    for name in architectures:
        if name in IMPORTERS:
            return IMPORTERS[name]
    supported = sorted(IMPORTERS)
    if architectures:
        raise HFImportError(f"{path}: architecture {architectures} is not supported; supported: {supported}")
    for importer in IMPORTERS.values():
        if data.get("model_type") == importer.model_type:
            return importer
    raise HFImportError(f"{path}: model_type {data.get('model_type')!r} (no 'architectures' listed) is not "
                        f"supported; supported architectures: {supported}")


def banned_tokens(directory: Path, config: dict[str, Any]) -> list[int]:
    """Single-token ``bad_words_ids`` of the generation settings (Marian bans its pad token)."""
    gen_path = directory / "generation_config.json"
    settings = read_json(gen_path) if gen_path.is_file() else config
    bad = settings.get("bad_words_ids") or []
    return sorted({seq[0] for seq in bad if isinstance(seq, list) and len(seq) == 1 and isinstance(seq[0], int)})


def _fold_bans(cfg: ModelConfig, tensors: TensorMap, bans: list[int], like: torch.Tensor) -> ModelConfig:
    """Make banned tokens impossible in every decoding path (greedy, sampling, beam) by giving
    them a -inf output bias; transformers applies the same ban as a logits processor."""
    bias = tensors.tensors.get("lm_head.proj.bias")
    if bias is None:
        bias = torch.zeros(cfg.vocab_size, dtype=like.dtype)
        cfg = dataclasses.replace(cfg, lm_head_bias=True)
    bias = bias.clone()
    bias[[b for b in bans if 0 <= b < cfg.vocab_size]] = float("-inf")
    tensors.put("lm_head.proj.bias", bias, "generation bad_words_ids")
    return cfg


def build_imported(cfg: ModelConfig, tensors: TensorMap, directory: Path, device: str | torch.device,
                   described_by: str = "config.json") -> TransformerModel:
    """Our model on ``device`` from imported tensors named as our state dict; a missing tensor
    or a shape other than ``cfg`` implies is an error naming the source tensor."""
    with torch.device("meta"):
        model = build_model(cfg)
    expected = {k: v for k, v in model.state_dict().items() if not (cfg.tie_word_embeddings and k == TIED_KEY)}
    not_mapped = sorted(set(expected) - set(tensors.tensors))
    if not_mapped:  # an importer bug rather than a bad file, but still say what is missing
        raise HFImportError(f"{directory}: no tensor for our parameter(s) {not_mapped[:5]}")
    dtype = tensors.tensors["embed.tokens.weight"].dtype  # one dtype for all, even if the file mixes them
    state = {}
    for name, ref in expected.items():
        t = tensors.tensors[name]
        if tuple(t.shape) != tuple(ref.shape):
            raise HFImportError(f"{directory}: tensor '{tensors.sources[name]}' has shape {list(t.shape)} (as our "
                                f"'{name}') but {described_by} implies {list(ref.shape)}")
        state[name] = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.reset_buffers()
    return model.eval()


def load_hf(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> HFModel:
    """Read a local HF model directory into our model, tokenizer and config.

    ``dtype`` casts floating-point weights (default: as stored)."""
    directory = Path(path)
    if not directory.is_dir():
        raise HFImportError(f"{directory}: not a local directory (nothing is downloaded; fetch the model first)")
    data = read_json(directory / HF_CONFIG_FILE)
    if "family" in data:
        raise HFImportError(f"{directory}: already in our checkpoint format; load it with "
                            "model.formats.checkpoint.load")
    importer = find_importer(directory / HF_CONFIG_FILE, data)
    hf = HFConfig(directory / HF_CONFIG_FILE, data, importer.architecture)
    tokenizer = importer.tokenizer(directory)
    try:
        cfg = importer.config(hf, tokenizer, directory)
    except ConfigError as exc:
        raise HFImportError(f"{hf.path}: {exc}") from None
    if tokenizer.vocab_size > cfg.vocab_size:
        raise HFImportError(f"{directory}: the tokenizer has {tokenizer.vocab_size} tokens but config.json has "
                            f"vocab_size {cfg.vocab_size}")
    weights = HFWeights(directory, dtype)
    tensors = importer.tensors(weights, cfg)
    left_over = weights.unused(importer.ignored)
    if left_over:
        raise HFImportError(f"{directory}: tensor(s) {left_over[:5]}{' and more' if len(left_over) > 5 else ''} "
                            f"are not used by the {importer.architecture} import; config.json does not match them")
    notes = []
    bans = banned_tokens(directory, data) if cfg.has_decoder else []
    if bans:
        cfg = _fold_bans(cfg, tensors, bans, tensors.tensors["embed.tokens.weight"])
        notes.append(f"generation bans token id(s) {bans} (bad_words_ids): folded into the output bias as -inf")
    stops = [i for i in eos_token_ids(data, directory) if i != cfg.eos_token_id] if cfg.has_decoder else []
    return HFModel(build_imported(cfg, tensors, directory, device), cfg, tokenizer, importer.architecture, directory,
                   notes, read_chat_template(directory), stops)
