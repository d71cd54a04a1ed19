"""What ``/v1/models`` says about a loaded model beyond OpenAI's fields: its architecture, its
context length, how its weights are quantized, and which decode step runs it.

Read from what loading produced (the model's config, the decode step ``model.decode.prepare``
chose, the source file); nothing here changes how a model runs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from model import ModelConfig
from model.formats.gguf_header import read_header
from model.formats.gguf_import import is_gguf_file
from model.formats.manifest import ManifestError, is_manifest_dir, locate, read_manifest
from model.quant.int8 import DecodeInt8Linear, RowwiseInt8Linear

log = logging.getLogger("tserve.registry")


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
