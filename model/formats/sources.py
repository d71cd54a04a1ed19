"""One entry point for every kind of model source this package reads.

    from model import load_model
    ckpt = load_model("weights/generate-en")            # our checkpoint directory
    ckpt = load_model("downloads/SmolLM2-135M-Instruct")  # a Hugging Face directory
    ckpt = load_model("SmolLM2-135M-Instruct.Q4_1.gguf")  # a GGUF file, converted once and cached
    ckpt = load_model("weights/smollm2-135m-instruct")   # a manifest naming a pinned package

Each returns a ``Checkpoint`` (model, config, tokenizer, chat template, stop ids), so callers
never need to know which format a model came in.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from model.formats import generation
from model.formats.checkpoint import Checkpoint, CheckpointError, is_checkpoint, load
from model.formats.gguf_header import read_header
from model.formats.gguf_import import GGUFModel, is_gguf_file, load_gguf
from model.formats.hf.importer import HFModel, is_hf_model_dir, load_hf
from model.formats.import_cache import load_converted
from model.formats.manifest import is_manifest_dir, locate, locate_mlm_head, read_manifest
from model.formats.sentence_transformers import attach_mlm_head, is_sentence_transformer_dir, load_sentence_transformer
from model.quant.kquant import stored_weights


def is_model_dir(path: str | Path) -> bool:
    """A directory ``load_model`` reads: our checkpoint, a manifest, or a Hugging Face model."""
    path = Path(path)
    return path.is_dir() and (is_checkpoint(path) or is_manifest_dir(path) or is_sentence_transformer_dir(path)
                              or is_hf_model_dir(path))


def as_checkpoint(imported: HFModel | GGUFModel, path: Path | None = None) -> Checkpoint:
    return Checkpoint(imported.model, imported.config, imported.tokenizer, path or imported.path, {},
                      imported.chat_template, list(imported.stop_token_ids))


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> Checkpoint:
    """Load any supported model source onto ``device`` (optionally casting floats to ``dtype``)."""
    path = Path(path)
    if path.is_file():
        if not is_gguf_file(path):
            raise CheckpointError(f"{path}: not a GGUF file (a model file must be .gguf; other formats are "
                                  "directories)")
        if stored_weights():  # the file's blocks read in place: nothing to convert or cache
            return as_checkpoint(load_gguf(path, device, dtype))
        # converted once, then read back from the cache on later starts (import_cache)
        return load_converted(path, lambda: as_checkpoint(load_gguf(path)), device, dtype, gguf=path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such file or directory")
    if is_manifest_dir(path):
        manifest = read_manifest(path)
        file = locate(manifest)  # format is checked by read_manifest
        if manifest.format == "sentence-transformers":
            ckpt = dataclasses.replace(load_sentence_transformer(file.parent, device, dtype), path=path)
            head = locate_mlm_head(manifest)
            if head is None:
                return ckpt
            return dataclasses.replace(attach_mlm_head(ckpt, head), fill_rescore=manifest.rescore)
        # The import is converted once and read back from the cache on later starts (import_cache).
        if stored_weights():
            ckpt = as_checkpoint(load_gguf(file, device, dtype), path)
        else:
            ckpt = load_converted(manifest, lambda: as_checkpoint(load_gguf(file), path), device, dtype, gguf=file)
        return dataclasses.replace(ckpt, tool_format=manifest.tool_format) if manifest.tool_format else ckpt
    if is_sentence_transformer_dir(path):  # before is_hf_model_dir: its config.json is a HF BertModel's
        return load_sentence_transformer(path, device, dtype)
    if is_hf_model_dir(path):  # before is_checkpoint: a HF directory also has config.json + model.safetensors
        return as_checkpoint(load_hf(path, device, dtype))
    if is_checkpoint(path):
        return load(path, device, dtype)
    raise CheckpointError(f"{path}: not a model directory (expected config.json + model.safetensors, a Hugging Face "
                          "model, or manifest.json)")


@dataclasses.dataclass(frozen=True)
class RecommendedSampling:
    """What a model source recommends for sampling (``model.formats.generation``)."""

    values: dict[str, float | int]  # temperature, top_p, top_k, repetition_penalty: those it states
    source: str | None  # where: "manifest.json (...)", "generation_config.json", "GGUF general.sampling"
    unused: tuple[str, ...] = ()  # what it states that the sampler does not implement (min_p, ...)


def recommended_sampling(path: str | Path) -> RecommendedSampling:
    """The sampling settings a model's publisher recommends, read without loading it: a
    manifest's ``generation`` block (the whole recommendation where present), else the GGUF's
    ``general.sampling.*`` keys (a ``.gguf`` file, or the file a manifest names), else a
    directory's ``generation_config.json``. Raises ``CheckpointError`` for values out of bounds."""
    path = Path(path)
    try:
        if is_manifest_dir(path):
            manifest = read_manifest(path)
            if manifest.generation is not None:
                return RecommendedSampling(dict(manifest.generation), f"manifest.json: {manifest.generation_source}")
            if manifest.format != "gguf":
                return RecommendedSampling({}, None)
            path = locate(manifest)
        if path.is_file() and is_gguf_file(path):
            fields = read_header(path).fields
            values = generation.from_gguf_fields(fields, f"{path}: GGUF")
            unused = tuple(generation.unused_gguf_keys(fields))
            return RecommendedSampling(values, "GGUF general.sampling" if values else None, unused)
        if path.is_dir():
            values = generation.from_hf_file(path / generation.HF_FILE)
            return RecommendedSampling(values, generation.HF_FILE if values else None)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    return RecommendedSampling({}, None)
