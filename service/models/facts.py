"""What ``/v1/models`` says about a model beyond OpenAI's fields: its task, architecture, context
length, language pair, how its weights are quantized, and which decode step runs it.

A loaded model's facts are read from what loading produced (the model's config, the decode step
``model.decode.prepare`` chose, the source file); ``file_card`` gives the same fields before a
load, from the files alone (``model.formats.card``), with what only a load can know set to null
and named in ``until_loaded``. Nothing here changes how a model runs.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from model import ModelConfig
from model.formats.card import read_card
from model.formats.gguf_header import read_header
from model.formats.gguf_import import is_gguf_file
from model.formats.manifest import ManifestError, is_manifest_dir, locate, read_manifest
from model.quant.int8 import DecodeInt8Linear, RowwiseInt8Linear
from model.tokenization.tool_format import detect
from service.models.sampling import sampling_defaults
from service.settings import Settings

log = logging.getLogger("tserve.registry")

TASKS = {"encoder-decoder": "translation", "decoder": "text-generation", "encoder": "fill-mask"}
# What a card can only say once its model is loaded (null before, and listed in ``until_loaded``).
# (An encoder has no decode step, an encoder-decoder no prefix cache or drafts: null loaded or not.)
LOAD_ONLY = {"decoder": ("decode_step", "kv_cache", "prefix_cache", "speculative"),
             "encoder-decoder": ("decode_step", "kv_cache"), "encoder": ()}
NEVER = {"decoder": (), "encoder-decoder": ("prefix_cache", "speculative"), "encoder": ("decode_step",)}
LOAD_ONLY_QUANTIZATION = ("weights", "decode", "decode_q4")
_NAMED_PAIR = re.compile(r"(?:^|[-_])([a-z]{2,3})[-_]([a-z]{2,3})$")


def task(cfg: ModelConfig) -> str:
    """What a model of ``cfg`` serves: an encoder with a masked-LM head fills masks, one without
    only embeds (``feature-extraction``)."""
    if cfg.family == "encoder":
        return "fill-mask" if cfg.mlm_head and cfg.mask_token_id is not None else "feature-extraction"
    return TASKS[cfg.family]


def language_pair(family: str, cfg: ModelConfig, name: str) -> tuple[str, str] | None:
    """(source, target) language codes of a translation model: its config's
    ``source_language``/``target_language``, else a guess from its name (``*-en-de``,
    ``opus-mt-en-de``); None for other families or a translation model without either."""
    if family != "encoder-decoder":
        return None
    source, target = getattr(cfg, "source_language", None), getattr(cfg, "target_language", None)
    if source and target:
        return source, target
    match = _NAMED_PAIR.search(name.lower())
    return (match.group(1), match.group(2)) if match else None


def context_length(cfg: ModelConfig, settings: Settings) -> int:
    """The longest sequence a model takes: its positions, capped by TSERVE_MAX_SEQ_LEN and, for an
    encoder, its trained input length (sentence-transformers' ``max_seq_length``)."""
    limit = min(settings.max_seq_len or cfg.max_positions, cfg.max_positions)
    return min(limit, cfg.max_input_tokens or cfg.max_positions) if cfg.family == "encoder" else limit


def file_card(name: str, path: Path, settings: Settings) -> dict[str, Any]:
    """The /v1/models fields of a model that is not loaded, read from its files (no weights): the
    ones ``BaseEngine.info`` gives once it is loaded, those only a load knows null and named in
    ``until_loaded``, plus ``source_bytes``. Raises where the files do not say what it is."""
    card = read_card(path)
    cfg, template = card.config, card.chat_template
    length = context_length(cfg, settings)
    quant = {"weights": None, "decode": None, "source": card.quantization, "decode_q4": None}
    pair = language_pair(cfg.family, cfg, name)
    out: dict[str, Any] = {
        "id": name, "object": "model", "created": int(path.stat().st_mtime), "owned_by": "transformer-serve",
        "family": cfg.family, "task": task(cfg), "max_seq_len": length, "parameters": card.parameters,
        "metrics": card.metrics, "architecture": architecture(cfg, card.architecture), "context_length": length,
        "quantization": quant, "language_pair": list(pair) if pair else None, "chat": False, "tools": False,
        "source_bytes": card.source_bytes,
        **dict.fromkeys((*LOAD_ONLY[cfg.family], *NEVER[cfg.family])),
        "until_loaded": [*LOAD_ONLY[cfg.family], *(f"quantization.{k}" for k in LOAD_ONLY_QUANTIZATION)],
    }
    if cfg.has_decoder:
        chat = template is not None
        constrained = cfg.family == "decoder" and cfg.eos_token_id is not None
        out.update(chat=chat, structured_outputs=constrained, tools=constrained and chat,
                   tool_prompt=("template" if "tools" in template else "generic") if chat else None,
                   # the format's name only: the marker ids it also finds need the vocabulary
                   tool_format=detect(template, lambda _: None, card.tool_format).name if chat else None)
        if cfg.family == "decoder":
            out["sampling_defaults"] = sampling_defaults(path, settings, name).card()
    return out

def architecture(cfg: ModelConfig, named: str | None = None) -> str:
    """The lineage of a model as Hugging Face and GGUF name it: ``named`` where the source file says
    it (``source_facts``), else read back from the config, which keeps each lineage's differences
    from a Llama as data (a Phi-3 without LongRoPE reads as a Llama there)."""
    if named:
        return named
    if cfg.family == "encoder":
        return "bert"
    if cfg.family == "encoder-decoder":
        return "marian" if cfg.activation == "swish" else "transformer"
    if cfg.positional != "rope":
        return "gpt2"
    if cfg.post_sublayer_norm:
        return "gemma3"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias:
        return "qwen2"
    if cfg.rope_scaling and cfg.rope_scaling.get("type") == "longrope":
        return "phi3"
    return "mistral" if cfg.sliding_window is not None else "llama"


def source_facts(path: Path) -> tuple[str | None, str | None]:
    """(architecture, quantization) as the source file states them: a GGUF file's
    ``general.architecture`` and file type (``Q4_1``, ``Q4_K_M``, ``F16``...), a Hugging Face
    directory's ``model_type``; None where the source does not say."""
    try:
        file = locate(read_manifest(path)) if is_manifest_dir(path) else path
    except ManifestError:
        return None, None
    if file.is_dir():
        config = file / "config.json"
        try:
            data = json.loads(config.read_text()) if config.is_file() else {}
        except (OSError, ValueError):
            data = {}
        model_type = data.get("model_type") if "family" not in data else None
        return (model_type if isinstance(model_type, str) else None), None
    if not (file.is_file() and is_gguf_file(file)):
        return None, None
    try:
        import gguf

        fields = read_header(file).fields
        arch, file_type = fields.get("general.architecture"), fields.get("general.file_type")
        if not isinstance(arch, str):
            arch = None
        kind = None if file_type is None else gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
        return arch, kind
    except Exception as exc:  # an unknown file type number: say nothing rather than fail the load
        log.warning("cannot read the GGUF metadata of %s: %s", file, exc)
        return None, None


def quantization(model, source: str | None, decode_q4: int = 0) -> dict[str, str | int | None]:
    """``weights``: the dtype prompts run in; ``decode``: what decode steps multiply with (int8 where
    ``model.decode`` made int8 copies; ``q4+int8`` where the native step reads ``decode_q4`` of the
    projections in the file's own 4-bit runs, Q4_0 / Q4_1 as stored, and int8 for the rest);
    ``source``: the quantization of the file it came from. Under the native step's prefill the
    float copies are gone (``drop_float_copies``) and prompts run in int8 too."""
    weights = str(model.dtype).removeprefix("torch.")
    if any(isinstance(m, RowwiseInt8Linear) for m in model.modules()):  # an encoder-decoder's: int8 throughout
        return {"weights": "int8", "decode": "int8", "source": source, "decode_q4": 0}
    int8 = [m for m in model.modules() if isinstance(m, DecodeInt8Linear)]
    decode = ("q4" if decode_q4 >= len(int8) else "q4+int8") if decode_q4 else "int8" if int8 else weights
    if int8 and all(m.dense is None for m in int8):
        weights = "int8"
    return {"weights": weights, "decode": decode, "source": source, "decode_q4": decode_q4}
