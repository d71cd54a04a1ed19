"""Which loaded model answers a request: family checks, placeholders, and each task's default model.

Pure functions over engines and settings; ``EngineRegistry.get`` and ``EngineRegistry.default``
(``service.models.registry``) call them with the engines loaded now.

Threads: the event loop (route handlers, through the registry).
"""

from __future__ import annotations

from service.engines.errors import InvalidRequestError
from service.engines.generative import BaseEngine
from service.settings import Settings

FAMILY_NAMES = {"encoder-decoder": "translation (encoder-decoder)", "decoder": "text generation (decoder)",
                "encoder": "fill-mask/embedding (encoder)"}
# the setting that names each task's default model (``EngineRegistry.default``)
DEFAULT_SETTINGS = {"text-generation": "default_generation_model", "feature-extraction": "default_embedding_model",
                    "fill-mask": "default_fill_mask_model", "translation": "default_translation_model"}
# what drop-in clients send when they have no model to name: TGI's and TEI's own names, test
# placeholders, an empty string, or the server's URL (huggingface_hub with a base_url)
PLACEHOLDER_MODELS = {"", "tgi", "tei", "dummy", "default", "unused", "none"}


def placeholder_schema() -> dict:
    """The placeholders as a JSON Schema string, for the routes that take them: any case, blanks
    around (a subset of what ``is_placeholder`` strips), or a URL."""
    words = "|".join("".join(f"[{c.upper()}{c.lower()}]" for c in word) for word in sorted(PLACEHOLDER_MODELS) if word)
    return {"type": "string", "pattern": f"^[ \\t\\n\\r\\f\\v]*({words})?[ \\t\\n\\r\\f\\v]*$|^https?://",
            "description": "a placeholder (what a client with no model to name sends): the default model"}


def is_placeholder(name: str | None) -> bool:
    return name is None or name.strip().lower() in PLACEHOLDER_MODELS or name.startswith(("http://", "https://"))


def check_family(name: str, actual: str, family: str, endpoint: str) -> None:
    """Raise (400) when model ``name``, of family ``actual``, cannot answer ``endpoint``."""
    if actual != family:
        raise InvalidRequestError(f"model '{name}' is a {FAMILY_NAMES[actual]} model; {endpoint} "
                                  f"needs a {FAMILY_NAMES[family]} model", "model")


def pick_default(candidates: list[BaseEngine], task: str, settings: Settings) -> BaseEngine:
    """Among ``candidates`` (loaded, of ``task``, at least one), the one a request without a
    model goes to: ``TSERVE_DEFAULT_<TASK>_MODEL`` when set, else for text generation the first
    model with a chat template (then any), else the first."""
    setting = DEFAULT_SETTINGS.get(task)
    wanted = getattr(settings, setting) if setting else ""
    if wanted:
        found = next((e for e in candidates if e.name == wanted), None)
        if found is None:
            raise InvalidRequestError(f"TSERVE_{setting.upper()} names '{wanted}', which is not a loaded {task} "
                                      f"model (loaded: {sorted(e.name for e in candidates)})", "model")
        return found
    if task == "text-generation":
        return next((e for e in candidates if getattr(e, "chat", None) is not None), candidates[0])
    return candidates[0]
