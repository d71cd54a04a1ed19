"""A model's recommended sampling settings, as its publisher states them: what a request that
sends none gets (the service's ``TSERVE_GENERATION_CONFIG``, as vLLM's ``--generation-config auto``).

Three places state them, read by ``model.formats.sources.recommended_sampling``:
- a manifest's ``generation`` block (``weights/<name>/manifest.json``), for weights whose file
  says nothing (a GGUF converted without them), with a ``source`` naming where they come from;
- a Hugging Face directory's ``generation_config.json`` (``temperature``, ``top_p``, ``top_k``,
  ``repetition_penalty``; ``do_sample`` is not read, as vLLM reads none of it: a file that names a
  temperature means it);
- a GGUF file's ``general.sampling.*`` keys (llama.cpp's ``temp``, ``top_p``, ``top_k``,
  ``penalty_repeat``).

Only the fields the sampler implements are read; the others a source may state (``min_p``,
mirostat, XTC) are reported by ``unused`` so the caller can say they are not applied.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# field -> (type, check, rule) as SamplingParams validates it
SAMPLING_FIELDS: dict[str, tuple[type, Any, str]] = {
    "temperature": (float, lambda v: 0.0 <= v <= 100.0, "in [0, 100]"),
    "top_p": (float, lambda v: 0.0 < v <= 1.0, "in (0, 1]"),
    "top_k": (int, lambda v: 0 <= v <= 100_000, "an integer in [0, 100000] (0 = no limit)"),
    "repetition_penalty": (float, lambda v: 0.0 < v <= 10.0, "in (0, 10]"),
}
# the gguf package's names (gguf.constants.Keys.General.SAMPLING_*), written out: reading a header
# needs no gguf import
GGUF_KEYS = {"temperature": "general.sampling.temp", "top_p": "general.sampling.top_p",
             "top_k": "general.sampling.top_k", "repetition_penalty": "general.sampling.penalty_repeat"}
GGUF_PREFIX = "general.sampling."
HF_FILE = "generation_config.json"


def check_sampling(values: Any, where: str, extra: tuple[str, ...] = ()) -> dict[str, float | int]:
    """``values`` as sampling defaults: an object of ``SAMPLING_FIELDS`` (plus ``extra`` keys,
    returned as they are), each a number within the sampler's bounds. Raises ValueError naming
    ``where`` and the field."""
    if not isinstance(values, dict):
        raise ValueError(f"{where} must be an object of {sorted(SAMPLING_FIELDS)}")
    unknown = sorted(set(values) - set(SAMPLING_FIELDS) - set(extra))
    if unknown:
        raise ValueError(f"{where} has unknown field(s) {unknown}; known: {sorted(SAMPLING_FIELDS)}")
    out: dict[str, Any] = {}
    for name, value in values.items():
        if name in extra:
            out[name] = value
            continue
        kind, ok, rule = SAMPLING_FIELDS[name]
        if kind is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if not number or (kind is int and not isinstance(value, int)) or not math.isfinite(value) or not ok(value):
            raise ValueError(f"{where}.{name} must be {rule}, got {value!r}")
        out[name] = kind(value)
    return out


def from_hf_file(file: Path) -> dict[str, float | int]:
    """The sampling fields a ``generation_config.json`` states (none when it has none, or no
    file). A value out of bounds is an error naming the file: a typo should not pass silently."""
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        return {}
    found = {k: data[k] for k in SAMPLING_FIELDS if data.get(k) is not None}
    return check_sampling(found, str(file))


def from_gguf_fields(fields: dict[str, object], where: str) -> dict[str, float | int]:
    """The sampling fields a GGUF header states (``general.sampling.*``)."""
    found = {name: fields[key] for name, key in GGUF_KEYS.items() if key in fields}
    # float32 in the file: 0.2 is stored as 0.20000000298...; six digits say what was meant
    found = {k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in found.items()}
    return check_sampling(found, where)


def unused_gguf_keys(fields: dict[str, object]) -> list[str]:
    """``general.sampling.*`` keys of a header that the sampler does not implement (min_p, ...)."""
    return sorted(k for k in fields if k.startswith(GGUF_PREFIX) and k not in GGUF_KEYS.values())
