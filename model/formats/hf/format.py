"""Reading a local Hugging Face model directory: config.json, safetensors weights, errors.

The per-architecture importers (hf_gpt2, hf_bert, hf_marian) describe *what* to read;
this module knows *how*: it checks config values and hands out tensors by name, keeping
track of which ones were used so that anything left over can be reported instead of
silently dropped. Only safetensors are read; pickle-based files are refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from model.config import ModelConfig
from model.formats.checkpoint import CheckpointError, check_safetensors_complete
from model.tokenization.tokenizer import Tokenizer

HF_CONFIG_FILE = "config.json"
HF_WEIGHTS_FILE = "model.safetensors"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "tf_model.h5", "flax_model.msgpack")


class HFImportError(CheckpointError):
    """A Hugging Face directory that cannot be imported; names the file, field or tensor."""


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HFImportError(f"{path}: file not found") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HFImportError(f"{path}: cannot read JSON ({exc})") from None
    if not isinstance(data, dict):
        raise HFImportError(f"{path}: expected a JSON object")
    return data


class HFConfig:
    """config.json of a HF model, with errors that name the field and the architecture."""

    def __init__(self, path: Path, data: dict[str, Any], architecture: str):
        self.path, self.data, self.architecture = path, data, architecture

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def require(self, key: str, kind: type = int) -> Any:
        value = self.data.get(key)
        if value is None:
            raise HFImportError(f"{self.path}: field '{key}' is missing (needed for {self.architecture})")
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise HFImportError(f"{self.path}: field '{key}' is {value!r}; expected {kind.__name__}")
        return value

    def unsupported(self, key: str, value: Any, allowed: str) -> HFImportError:
        return HFImportError(f"{self.path}: {self.architecture} with {key}={value!r} is not supported "
                             f"(supported: {allowed})")

    def expect(self, key: str, *allowed: Any) -> None:
        """Fail if ``key`` is set to something other than ``allowed`` (absent counts as the default)."""
        value = self.data.get(key)
        if value is not None and value not in allowed:
            raise self.unsupported(key, value, " or ".join(repr(a) for a in allowed))

    def token_id(self, key: str) -> int | None:
        """A special-token id; a one-element list (as some configs store eos) is unwrapped."""
        value = self.data.get(key)
        if isinstance(value, list):
            if len(value) != 1:
                raise self.unsupported(key, value, "a single token id")
            value = value[0]
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise HFImportError(f"{self.path}: field '{key}' is {value!r}; expected a token id")
        return value


class HFWeights:
    """The tensors of ``model.safetensors`` (or a sharded index), read on demand by name."""

    def __init__(self, directory: Path, dtype: torch.dtype | None = None):
        self.directory, self.dtype = directory, dtype
        single, index = directory / HF_WEIGHTS_FILE, directory / HF_WEIGHTS_INDEX
        if single.is_file():
            self.files = {name: single for name in self._keys(single)}
        elif index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise HFImportError(f"{index}: no 'weight_map' object")
            outside = sorted({str(f) for f in weight_map.values() if not isinstance(f, str) or Path(f).name != f})
            if outside:  # shards live beside the index; never follow a path elsewhere
                raise HFImportError(f"{index}: shard file names {outside[:3]} are not plain file names")
            self.files = {name: directory / file for name, file in weight_map.items()}
        else:
            pickled = [p for p in PICKLED_WEIGHTS if (directory / p).exists()]
            if pickled:
                raise HFImportError(
                    f"{directory}: only {pickled[0]} found; pickle-based weights are never loaded. Re-save the model "
                    f"as safetensors first (in transformers: model.save_pretrained(dir), which writes "
                    f"{HF_WEIGHTS_FILE})")
            raise HFImportError(f"{single}: file not found (and no {HF_WEIGHTS_INDEX})")
        self.used: set[str] = set()

    @staticmethod
    def _keys(file: Path) -> list[str]:
        problem = check_safetensors_complete(file)
        if problem:
            raise HFImportError(problem)
        try:
            with safe_open(str(file), framework="pt") as f:
                return list(f.keys())
        except Exception as exc:  # noqa: BLE001 - safetensors reports corruption with its own types
            raise HFImportError(f"{file}: cannot read safetensors header ({type(exc).__name__}: {exc})") from None

    def has(self, name: str) -> bool:
        return name in self.files

    def prefix(self, probe: str, candidates: tuple[str, ...]) -> str:
        """Which of ``candidates`` the names start with, found by looking for ``prefix + probe``."""
        for candidate in candidates:
            if self.has(candidate + probe):
                return candidate
        tried = [c + probe for c in candidates]
        raise HFImportError(f"{self.directory}: missing tensor {tried[0]!r} (also tried {tried[1:]})")

    def take(self, name: str) -> Tensor:
        file = self.files.get(name)
        if file is None:
            raise HFImportError(f"{self.directory}: missing tensor '{name}'")
        try:
            with safe_open(str(file), framework="pt") as f:
                tensor = f.get_tensor(name)
        except Exception as exc:  # noqa: BLE001 - as above
            raise HFImportError(f"{file}: cannot read tensor '{name}' ({type(exc).__name__}: {exc})") from None
        self.used.add(name)
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(self.dtype)
        return tensor

    def take_first(self, *names: str) -> tuple[Tensor, str]:
        """The first of several equivalent names that exists (e.g. LayerNorm ``weight`` / older ``gamma``)."""
        for name in names:
            if self.has(name):
                return self.take(name), name
        raise HFImportError(f"{self.directory}: missing tensor '{names[0]}'"
                            + (f" (also tried {list(names[1:])})" if len(names) > 1 else ""))

    def unused(self, ignored: tuple[str, ...]) -> list[str]:
        skip = [re.compile(p) for p in ignored]
        return sorted(n for n in self.files if n not in self.used and not any(p.fullmatch(n) for p in skip))


@dataclass
class TensorMap:
    """Our state-dict names -> tensors, remembering which HF tensor each came from (for errors)."""

    tensors: dict[str, Tensor] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def put(self, ours: str, tensor: Tensor, source: str) -> None:
        self.tensors[ours] = tensor
        self.sources[ours] = source

    def linear(self, ours: str, weights: HFWeights, theirs: str, transpose: bool = False) -> None:
        """A Linear layer (``.weight`` and ``.bias``); ``transpose`` for GPT-2's Conv1D (in, out) layout."""
        w = weights.take(f"{theirs}.weight")
        self.put(f"{ours}.weight", w.t().contiguous() if transpose else w, f"{theirs}.weight")
        self.put(f"{ours}.bias", weights.take(f"{theirs}.bias"), f"{theirs}.bias")

    def fused_linear(self, ours: str, weights: HFWeights, *theirs: str) -> None:
        """Separate projections (e.g. query, key, value) stacked along the output dimension into
        our fused one: the same maths in one matmul."""
        parts = [(weights.take(f"{t}.weight"), weights.take(f"{t}.bias")) for t in theirs]
        shapes = {tuple(w.shape) for w, _ in parts}
        if len(shapes) != 1:
            raise HFImportError(f"{weights.directory}: tensors {[f'{t}.weight' for t in theirs]} differ in shape "
                                f"({sorted(shapes)})")
        names = " + ".join(theirs)
        self.put(f"{ours}.weight", torch.cat([w for w, _ in parts]), f"{names} (.weight)")
        self.put(f"{ours}.bias", torch.cat([b for _, b in parts]), f"{names} (.bias)")

    def layer_norm(self, ours: str, weights: HFWeights, theirs: str) -> None:
        # Checkpoints from the TensorFlow era name LayerNorm parameters gamma/beta.
        w, w_name = weights.take_first(f"{theirs}.weight", f"{theirs}.gamma")
        b, b_name = weights.take_first(f"{theirs}.bias", f"{theirs}.beta")
        self.put(f"{ours}.weight", w, w_name)
        self.put(f"{ours}.bias", b, b_name)


@dataclass(frozen=True)
class Importer:
    """How one HF architecture maps onto our model families."""

    architecture: str  # the HF class name in config.json "architectures"
    model_type: str  # the HF "model_type", used when "architectures" is absent
    tokenizer: Callable[[Path], Tokenizer]
    config: Callable[[HFConfig, Tokenizer, Path], ModelConfig]
    tensors: Callable[[HFWeights, ModelConfig], TensorMap]
    ignored: tuple[str, ...] = ()  # regexes of stored tensors that the model does not use


# HF activation names -> ours. gelu_pytorch_tanh and gelu_fast are the same tanh formula as gelu_new.
HF_ACTIVATIONS = {
    "gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "gelu_fast": "gelu_new",
    "relu": "relu", "silu": "silu", "swish": "swish",
}


def activation(cfg: HFConfig, key: str) -> str:
    name = cfg.require(key, str)
    if name not in HF_ACTIVATIONS:
        raise cfg.unsupported(key, name, ", ".join(sorted(HF_ACTIVATIONS)))
    return HF_ACTIVATIONS[name]


def special_token(directory: Path, name: str) -> str | None:
    """A special token's text from tokenizer_config.json (stored as a string or an AddedToken dict)."""
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return None
    value = read_json(path).get(name)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def fast_tokenizer(directory: Path) -> Tokenizer:
    """The ``tokenizers`` file that HF fast tokenizers save; used as-is."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise HFImportError(f"{path}: file not found; save the tokenizer with a fast (tokenizers-backed) HF "
                            "tokenizer so that tokenizer.json is written")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception on bad files
        raise HFImportError(f"{path}: cannot read tokenizer ({exc})") from None
    # Some files save padding/truncation settings (all-MiniLM-L6-v2: pad and cut to 128); we pad
    # batches ourselves and check lengths against the model's limit, so both are switched off.
    tokenizer.tk.no_padding()
    tokenizer.tk.no_truncation()
    return tokenizer


def eos_token_ids(config: dict[str, Any], directory: Path) -> list[int]:
    """Every end-of-sequence id: generation_config.json's when present (Llama 3 lists several),
    else config.json's."""
    gen = directory / "generation_config.json"
    value = read_json(gen).get("eos_token_id") if gen.is_file() else None
    if value is None:
        value = config.get("eos_token_id")
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


CHAT_TEMPLATE_FILE = "chat_template.jinja"


def read_chat_template(directory: Path) -> str | None:
    """The chat template saved beside the tokenizer: ``chat_template.jinja`` (transformers 5)
    or ``tokenizer_config.json``'s ``chat_template`` (a string, or named templates of which
    the one called "default" is used)."""
    file = directory / CHAT_TEMPLATE_FILE
    if file.is_file():
        return file.read_text(encoding="utf-8")
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return None
    value = read_json(path).get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if value is not None and not isinstance(value, str):
        raise HFImportError(f"{path}: field 'chat_template' is {type(value).__name__}; expected a string")
    return value
