"""The sampling a generation request gets for the fields it leaves unset: the model's recommended
values (``TSERVE_GENERATION_CONFIG=auto``, as vLLM's ``--generation-config auto``), under the
server-wide ``TSERVE_GENERATION_OVERRIDE``, over the API's own defaults. Read once per load, in a
worker thread (a GGUF header, a small JSON file); the engine applies it
(``GenerativeEngine.sampling``) and ``/v1/models`` shows it (``sampling_defaults``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.formats.sources import recommended_sampling
from service.settings import Settings

log = logging.getLogger("tserve.registry")

# What OpenAI's API (and SamplingParams) mean by an absent field: temperature 1, no limits, no penalty.
API_DEFAULTS: dict[str, float | int] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}


@dataclass(frozen=True)
class SamplingDefaults:
    values: dict[str, float | int] = field(default_factory=lambda: dict(API_DEFAULTS))
    sources: tuple[str, ...] = ()  # where the values other than the API's come from, in order of precedence
    not_applied: tuple[str, ...] = ()  # what the model's source recommends that the sampler does not implement

    def card(self) -> dict[str, Any]:
        return {**self.values, "source": list(self.sources), "not_applied": list(self.not_applied)}


def sampling_defaults(path: Path, settings: Settings, name: str = "") -> SamplingDefaults:
    values, sources, unused = dict(API_DEFAULTS), [], ()
    if settings.generation_config == "auto":
        recommended = recommended_sampling(path)
        if recommended.values:
            values.update(recommended.values)
            sources.append(recommended.source or "model")
        unused = recommended.unused
        if unused:
            log.warning("model %s recommends sampling settings this server does not implement: %s", name,
                        ", ".join(unused), extra={"model": name})
    if settings.generation_override:
        values.update(settings.generation_override)
        sources.append("TSERVE_GENERATION_OVERRIDE")
    return SamplingDefaults(values, tuple(sources), unused)
