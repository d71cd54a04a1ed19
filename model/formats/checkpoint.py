"""Checkpoint directories: config.json + model.safetensors + tokenizer.json (+ metrics.json,
chat_template.jinja and generation_config.json for chat models).

Loading builds the model on the meta device (no memory, no init work), then assigns the
tensors read with safetensors: no pickle is ever unpickled. Every way a checkpoint can be
wrong ends in a ``CheckpointError`` that names the file and, where it applies, the tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.config import ConfigError, ModelConfig
from model.nn.transformer import TransformerModel, build_model
from model.tokenization.tokenizer import Tokenizer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
METRICS_FILE = "metrics.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # the Jinja source, as transformers saves it
GENERATION_FILE = "generation_config.json"  # {"stop_token_ids": [...]}: ids that end generation besides eos
TIED_KEY = "lm_head.proj.weight"  # equals embed.tokens.weight when embeddings are tied


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be loaded; the message names file and tensor."""


@dataclass(frozen=True)
class RescoreSpec:
    """A fill-mask manifest's ``rescore`` field (``model.encoder.rescore``): a causal LM re-ranks
    the masked LM's top ``candidates`` words, ``mlm_weight`` x the masked LM's log-probability
    plus the causal LM's over the word and ``context`` tokens after it."""

    model: Path  # a decoder-only model directory: ``model`` names a sibling of the manifest's directory
    candidates: int
    mlm_weight: float
    context: int


@dataclass
class Checkpoint:
    model: TransformerModel
    config: ModelConfig
    tokenizer: Tokenizer | None
    path: Path
    metrics: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None  # rendered only by model.tokenization.chat_template's sandbox
    stop_token_ids: list[int] = field(default_factory=list)  # end generation besides config.eos_token_id
    fill_rescore: RescoreSpec | None = None  # fill-mask: a causal LM re-ranks the candidates (model.encoder.rescore)
    tool_format: str | None = None  # a manifest's override of how the model writes tool calls (tool_format.py)


def _stored_keys(model: TransformerModel) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if model.cfg.tie_word_embeddings:
        state.pop(TIED_KEY, None)
    return state


def is_checkpoint(path: str | Path) -> bool:
    path = Path(path)
    return (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file()


def save(path: str | Path, model: TransformerModel, tokenizer: Tokenizer | None = None,
         metrics: dict[str, Any] | None = None, chat_template: str | None = None,
         stop_token_ids: list[int] | None = None) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.cfg.save(path / CONFIG_FILE)
    tensors = {k: v.detach().contiguous().cpu() for k, v in _stored_keys(model).items()}
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt", "family": model.cfg.family})
    if tokenizer is not None:
        tokenizer.save(path / TOKENIZER_FILE)
    if metrics is not None:
        (path / METRICS_FILE).write_text(json.dumps(metrics, indent=2) + "\n")
    if chat_template is not None:
        (path / CHAT_TEMPLATE_FILE).write_text(chat_template, encoding="utf-8")
    if stop_token_ids:
        (path / GENERATION_FILE).write_text(json.dumps({"stop_token_ids": list(stop_token_ids)}, indent=2) + "\n")
    return path


def _read_generation(path: Path, vocab_size: int) -> list[int]:
    file = path / GENERATION_FILE
    if not file.is_file():
        return []
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: invalid JSON ({exc})") from None
    ids = data.get("stop_token_ids", []) if isinstance(data, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
        raise CheckpointError(f"{file}: 'stop_token_ids' must be a list of token ids below vocab_size {vocab_size}")
    return ids


def check_safetensors_complete(file: Path) -> str | None:
    """Why ``file`` is not a whole safetensors file, naming the first tensor it cuts off
    (None when the header and sizes agree). safetensors itself only says the file is
    "not fully covered"; a download or copy that stopped early deserves a plain answer."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{file}: truncated: {size} bytes, not even a safetensors header length"
        header_len = int.from_bytes(head, "little")
        if 8 + header_len > size:
            return f"{file}: truncated: the header needs {8 + header_len} bytes, the file has {size}"
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return f"{file}: corrupt safetensors header ({exc})"
    data = size - 8 - header_len
    spans = sorted((info["data_offsets"][1], name) for name, info in header.items()
                   if name != "__metadata__" and isinstance(info, dict) and "data_offsets" in info)
    for end, name in spans:
        if end > data:
            return (f"{file}: truncated: tensor '{name}' ends at data byte {end} but the file holds {data} "
                    f"bytes of tensor data (an incomplete download or copy?)")
    return None


def _read_tensors(file: Path, expected: dict[str, torch.Tensor], device: str | torch.device,
                  dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    problem = check_safetensors_complete(file)
    if problem:
        raise CheckpointError(problem)
    try:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            names = set(f.keys())
            missing = sorted(set(expected) - names)
            if missing:
                raise CheckpointError(f"{file}: missing tensor(s) {missing[:5]}"
                                      f"{' and more' if len(missing) > 5 else ''}")
            unexpected = sorted(names - set(expected))
            if unexpected:
                raise CheckpointError(f"{file}: unexpected tensor(s) {unexpected[:5]} not used by this config")
            tensors = {}
            for name, ref in expected.items():
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(ref.shape):
                    raise CheckpointError(f"{file}: tensor '{name}' has shape {list(shape)} but config.json "
                                          f"implies {list(ref.shape)}")
                t = f.get_tensor(name)
                tensors[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors reports truncation/corruption with its own types
        raise CheckpointError(f"{file}: cannot read safetensors data ({type(exc).__name__}: {exc})") from None
    return tensors


def load(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Checkpoint:
    """Load a checkpoint directory onto ``device`` (optionally casting floats to ``dtype``)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint directory")
    try:
        cfg = ModelConfig.load(path / CONFIG_FILE)
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from None
    with torch.device("meta"):
        model = build_model(cfg)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{weights}: file not found")
    tensors = _read_tensors(weights, _stored_keys(model), device, dtype)
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    model.reset_buffers()
    model.eval()

    tokenizer = None
    if (path / TOKENIZER_FILE).is_file():
        try:
            tokenizer = Tokenizer.from_file(path / TOKENIZER_FILE)
        except Exception as exc:
            raise CheckpointError(f"{path / TOKENIZER_FILE}: cannot read tokenizer ({exc})") from None
        if tokenizer.vocab_size > cfg.vocab_size:
            raise CheckpointError(f"{path / TOKENIZER_FILE}: {tokenizer.vocab_size} tokens but config.json "
                                  f"has vocab_size {cfg.vocab_size}")
    metrics = {}
    if (path / METRICS_FILE).is_file():
        try:
            metrics = json.loads((path / METRICS_FILE).read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path / METRICS_FILE}: invalid JSON ({exc})") from None
    template = None
    if (path / CHAT_TEMPLATE_FILE).is_file():
        template = (path / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    return Checkpoint(model, cfg, tokenizer, path, metrics, template, _read_generation(path, cfg.vocab_size))
