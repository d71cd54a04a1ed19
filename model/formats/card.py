"""What a model is, read from its files without reading its weights: the card a server shows
for a model before it loads (``read_card``).

The config comes from the functions the loader itself uses, fed only metadata: ``gguf_config``
over the GGUF header (``gguf_header``: keys and tensor shapes, no data), an importer's ``config``
over a Hugging Face ``config.json`` and tokenizer, ``ModelConfig.load`` for our checkpoints, the
sentence-transformers pipeline's settings, a manifest's masked-LM head. The parameter count is
that config's model built on the meta device (shapes, no storage): every loader checks each
tensor of the file against exactly those shapes, so it is the file's count.

A manifest's file is found without the sha256 check a load makes (hashing is reading the
weights); a split GGUF's header is read from its joined file where one is cached, else from its
first chunk, which holds the whole header.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from model.config import ModelConfig
from model.formats.checkpoint import CHAT_TEMPLATE_FILE, CONFIG_FILE, METRICS_FILE, CheckpointError, is_checkpoint
from model.formats.gguf_header import ArrayInfo, GGUFHeader, read_header
from model.formats.gguf_import import GGUFFile, gguf_config, is_gguf_file
from model.formats.hf.format import HF_CONFIG_FILE, HFConfig, read_chat_template, read_json
from model.formats.hf.importer import banned_tokens, find_importer, is_hf_model_dir
from model.formats.manifest import Manifest, ManifestError, cache_dir, is_manifest_dir, read_manifest
from model.formats.sentence_transformers import (
    is_sentence_transformer_dir,
    pipeline_config,
    transformer_dir,
    with_mlm_head,
)
from model.nn.transformer import build_model


@dataclass(frozen=True)
class SourceCard:
    """One model as its files describe it."""

    config: ModelConfig  # what the loader will build
    parameters: int  # the built model's ``num_parameters()``
    chat_template: str | None
    tool_format: str | None  # a manifest's ``tool_format`` (else the template and vocabulary decide)
    architecture: str | None  # as the source names it: GGUF general.architecture, HF model_type
    quantization: str | None  # a GGUF file's type (Q4_K_M, F16, ...); None for other sources
    source_bytes: int  # the weight files' size on disk
    metrics: dict[str, Any]  # our checkpoints' metrics.json


def read_card(path: str | Path) -> SourceCard:
    """The card of the model ``load_model(path)`` loads; raises ``CheckpointError`` (or OSError)
    where the files do not say what it is."""
    path = Path(path)
    if path.is_file():
        if not is_gguf_file(path):
            raise CheckpointError(f"{path}: not a GGUF file")
        return _gguf_card(path, path.stat().st_size)
    if is_manifest_dir(path):
        manifest = read_manifest(path)
        if manifest.format == "sentence-transformers":
            weights = _package_file(manifest, manifest.package, manifest.version, manifest.file)
            card = _directory_card(weights.parent, named=False)
            if manifest.mlm_head is None:
                return card
            head = path / manifest.mlm_head
            return _with_config(card, with_mlm_head(card.config),
                                source_bytes=card.source_bytes + (head.stat().st_size if head.is_file() else 0))
        header_file, size = _gguf_source(manifest)
        card = _gguf_card(header_file, size)
        return dataclasses.replace(card, tool_format=manifest.tool_format) if manifest.tool_format else card
    if path.is_dir():
        return _directory_card(path)
    raise CheckpointError(f"{path}: no such file or directory")


def _parameters(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        return build_model(cfg).num_parameters()


def _with_config(card: SourceCard, cfg: ModelConfig, **changes: Any) -> SourceCard:
    return dataclasses.replace(card, config=cfg, parameters=_parameters(cfg), **changes)


# --- GGUF ---------------------------------------------------------------------------------------

class _HeaderFile(GGUFFile):
    """``gguf_config``'s view of a file (``get``, ``require``, ``tensors``) over the header alone."""

    def __init__(self, path: Path, header: GGUFHeader):  # not GGUFFile's: gguf's reader maps every array
        self.path, self.header, self.used = path, header, set()
        self.tensors = {t.name: t for t in header.tensors}  # shapes innermost first, as gguf's reader has them

    def get(self, key: str, default: Any = None) -> Any:
        value = self.header.fields.get(key, default)
        return range(value.count) if isinstance(value, ArrayInfo) else value  # an array: only its length is read

    def take(self, name: str) -> torch.Tensor:
        """A tensor's values: Phi-3's LongRoPE factors (a few floats) are config, not weights."""
        return GGUFFile(self.path).take(name)


def _gguf_card(file: Path, size: int) -> SourceCard:
    header = read_header(file)
    cfg = gguf_config(_HeaderFile(file, header))
    template = header.fields.get("tokenizer.chat_template")
    arch, kind = header.fields.get("general.architecture"), header.fields.get("general.file_type")
    return SourceCard(cfg, _parameters(cfg), template if isinstance(template, str) else None, None,
                      arch if isinstance(arch, str) else None, _file_type(kind), size, {})


def _file_type(number: object) -> str | None:
    """GGUF's ``general.file_type`` by name (``Q4_K_M``), as llama.cpp names it."""
    if not isinstance(number, int):
        return None
    import gguf

    try:
        return gguf.LlamaFileType(number).name.removeprefix("MOSTLY_")
    except ValueError:
        return None


def _package_file(manifest: Manifest, package: str, version: str, inner: str) -> Path:
    """A file of an installed package at the pinned version, unhashed (the load checks it)."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise ManifestError(f"{manifest.path}: needs {package}=={version}, which is not installed; "
                            f"{manifest.install_hint}") from None
    if dist.version != version:
        raise ManifestError(f"{manifest.path}: needs {package}=={version} but version {dist.version} is installed")
    file = Path(str(dist.locate_file(inner)))
    if not file.is_file():
        raise ManifestError(f"{manifest.path}: {package} has no file {inner!r}")
    return file


def _gguf_source(manifest: Manifest) -> tuple[Path, int]:
    """(a file that starts with the GGUF's header, the GGUF's size) for a manifest."""
    if not manifest.parts:
        file = _package_file(manifest, manifest.package, manifest.version, manifest.file)
        return file, file.stat().st_size
    joined = cache_dir() / manifest.sha256[:16] / manifest.file  # where ``locate`` joins the parts
    if joined.is_file():
        return joined, joined.stat().st_size
    chunks = [_package_file(manifest, p.package, p.version, p.file) for p in manifest.parts]
    return chunks[0], sum(c.stat().st_size for c in chunks)


# --- directories ----------------------------------------------------------------------------------

def _hf_config(directory: Path) -> ModelConfig:
    """The config ``load_hf`` builds, without its tensors (bans fold into an output bias there)."""
    data = read_json(directory / HF_CONFIG_FILE)
    importer = find_importer(directory / HF_CONFIG_FILE, data)
    cfg = importer.config(HFConfig(directory / HF_CONFIG_FILE, data, importer.architecture),
                          importer.tokenizer(directory), directory)
    if cfg.has_decoder and banned_tokens(directory, data) and not cfg.lm_head_bias:
        cfg = dataclasses.replace(cfg, lm_head_bias=True)
    return cfg


def _directory_card(directory: Path, named: bool = True) -> SourceCard:
    """Our checkpoint, a Hugging Face directory or a sentence-transformers one. ``named``: the
    source's ``model_type`` counts as its architecture (not for a manifest's package, whose
    architecture the server reads back from the config)."""
    template, metrics = None, {}
    if is_sentence_transformer_dir(directory):
        cfg = pipeline_config(directory, _hf_config(transformer_dir(directory)))
    elif is_hf_model_dir(directory):
        cfg, template = _hf_config(directory), read_chat_template(directory)
    elif is_checkpoint(directory):
        cfg = ModelConfig.load(directory / CONFIG_FILE)
        chat = directory / CHAT_TEMPLATE_FILE
        template = chat.read_text(encoding="utf-8") if chat.is_file() else None
        if (directory / METRICS_FILE).is_file():
            metrics = json.loads((directory / METRICS_FILE).read_text())
    else:
        raise CheckpointError(f"{directory}: not a model directory")
    if not cfg.has_decoder:
        template = None
    arch = None
    config = directory / "config.json"
    if named and config.is_file():
        data = read_json(config)
        arch = data.get("model_type") if "family" not in data and isinstance(data.get("model_type"), str) else None
    size = sum(p.stat().st_size for p in directory.rglob("*.safetensors"))
    return SourceCard(cfg, _parameters(cfg), template, None, arch, None, size, metrics)
