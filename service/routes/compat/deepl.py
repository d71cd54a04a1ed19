"""DeepL API v2: POST /v2/translate, GET|POST /v2/languages, GET|POST /v2/usage.

As DeepL serves them (https://developers.deepl.com/docs/api-reference): JSON or form bodies
(``text`` repeated), upper-case language codes with regional target variants (``EN-GB``,
``PT-BR``: served by the model of the base language), ``Authorization: DeepL-Auth-Key <key>``
(checked when TSERVE_API_KEY is set), errors ``{"message": ...}`` with 400, 403, 413, 429,
456, 500. Features the models lack are refused as DeepL refuses them for a language without
them (``formality`` more/less, glossaries, XML tag handling); ``prefer_*`` falls back silently,
as DeepL does.
"""

from __future__ import annotations

import threading

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from service.engines.errors import EngineError
from service.http.dependencies import RegistryDep, SettingsDep
from service.routes.compat.common import (
    CompatError,
    error_route,
    key_matches,
    language_name,
    read_params,
    translate_html,
    translate_texts,
)
from service.routes.inputs import text_list
from service.translation.translate import engine_for, reload_unloaded, translation_pairs

CHARACTER_LIMIT = 1_000_000_000_000  # DeepL Pro reports a very large limit; there is no quota here
TARGET_VARIANTS = {"EN-GB": "en", "EN-US": "en", "PT-PT": "pt", "PT-BR": "pt", "ZH-HANS": "zh", "ZH-HANT": "zh"}
FORMALITY = ("default", "more", "less", "prefer_more", "prefer_less")


def _render(exc: EngineError) -> JSONResponse:
    status = exc.status if exc.status in (400, 403, 404, 413, 429, 456, 503) else (400 if exc.status < 500 else 500)
    headers = ({"Retry-After": str(getattr(exc, "retry_after", 1))}
               if status == 429 or hasattr(exc, "retry_after") else None)
    return JSONResponse({"message": exc.message}, status_code=status, headers=headers)


router = APIRouter(tags=["DeepL"], route_class=error_route(_render))


class _Usage:
    """Characters translated since start (DeepL's usage counter; per process)."""

    def __init__(self) -> None:
        self.characters = 0
        self.lock = threading.Lock()

    def add(self, n: int) -> None:
        with self.lock:
            self.characters += n


def _usage(request: Request) -> _Usage:
    state = request.app.state
    if not hasattr(state, "deepl_usage"):
        state.deepl_usage = _Usage()
    return state.deepl_usage


def _auth(request: Request, settings) -> None:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if settings.api_key is not None and (scheme != "DeepL-Auth-Key" or not key_matches(settings, key)):
        raise CompatError(403, "Wrong endpoint or invalid authentication key (Authorization: DeepL-Auth-Key <key>)",
                          "invalid_api_key")


def _bad(message: str, param: str | None = None) -> CompatError:
    return CompatError(400, message, "invalid_value", param)


def _target(code: object) -> str:
    if not code:
        raise _bad("Parameter 'target_lang' not specified.", "target_lang")
    if not isinstance(code, str):
        raise _bad("Value for 'target_lang' not supported.", "target_lang")
    code = code.upper()
    if code in ("EN", "PT"):
        raise _bad(f"Value for 'target_lang' not supported: '{code}' is deprecated, please use "
                   f"'{code}-{'GB' if code == 'EN' else 'PT'}' or '{code}-{'US' if code == 'EN' else 'BR'}' instead.",
                   "target_lang")
    return TARGET_VARIANTS.get(code, code.lower())


FLAG_TEXTS = ("", "0", "1", "true", "false")  # a boolean as a form (or JSON text) writes it


def _flag(p: dict, name: str) -> bool:
    """A boolean parameter: JSON true/false, or a form's true/false/1/0 (absent or empty: false)."""
    value = p.get(name, False)  # JSON null is not a boolean (the schema says so)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value in FLAG_TEXTS:
        return value in ("1", "true")
    raise _bad(f"Value for '{name}' not supported: true or false.", name)


@router.post("/v2/translate", summary="DeepL: translate texts")
async def translate(request: Request, registry: RegistryDep, settings: SettingsDep):
    await reload_unloaded(registry)  # the pairs the schema lists
    _auth(request, settings)
    p = await read_params(request)
    texts = p.get("text")
    if texts is None or texts == []:
        raise _bad("Parameter 'text' not specified.", "text")
    texts = text_list(texts if isinstance(texts, list) else [texts], "text", settings)
    target = _target(p.get("target_lang"))
    source = p.get("source_lang", "")
    if not isinstance(source, str):  # null, {} or [] is no language code (falsy, but sent)
        raise _bad("Value for 'source_lang' not supported.", "source_lang")
    source = source.lower() or None
    pairs = translation_pairs(registry)
    if target not in {t for _, t in pairs}:
        raise _bad("Value for 'target_lang' not supported.", "target_lang")
    if source is not None and source not in {s for s, _ in pairs}:
        raise _bad("Value for 'source_lang' not supported.", "source_lang")
    formality = p.get("formality")
    if formality is None or formality == "":  # absent, or an empty form field
        formality = "default"
    if not isinstance(formality, str) or formality not in FORMALITY:
        raise _bad("Value for 'formality' not supported.", "formality")
    if formality in ("more", "less"):
        raise _bad("'formality' is not supported for given 'target_lang'.", "formality")
    if p.get("glossary_id") not in (None, ""):  # any other value, {} included, names a glossary
        raise _bad("This server has no glossaries ('glossary_id' is not supported).", "glossary_id")
    tag_handling = p.get("tag_handling")
    if tag_handling not in (None, "", "html"):
        raise _bad("Value for 'tag_handling' not supported: this server handles 'html' only.", "tag_handling")
    show = _flag(p, "show_billed_characters")
    found = engine_for(registry, source, target)  # without source_lang: the first model translating into target
    if found is None:
        raise _bad(f"Translation from '{source.upper() if source else 'auto'}' to '{target.upper()}' is not "
                   f"supported.", "target_lang")
    (detected, _), engine = found  # type: ignore[misc]
    if tag_handling == "html":
        translated = await translate_html(request, engine, texts, "text", settings)
    else:
        translated, _ = await translate_texts(request, engine, texts, "text", settings)
    billed = [len(t) for t in texts]
    _usage(request).add(sum(billed))
    return {"translations": [{"detected_source_language": detected.upper(), "text": t,
                              **({"billed_characters": n} if show else {})} for t, n in zip(translated, billed)]}


@router.get("/v2/languages", summary="DeepL: source or target languages", operation_id="deepl_languages_get")
@router.post("/v2/languages", summary="DeepL: source or target languages", operation_id="deepl_languages_post")
async def languages(request: Request, registry: RegistryDep, settings: SettingsDep):
    await reload_unloaded(registry)  # the pairs the schema lists
    _auth(request, settings)
    kind = (await read_params(request)).get("type", "source")
    if kind not in ("source", "target"):
        raise _bad("Value for 'type' not supported.", "type")
    pairs = translation_pairs(registry)
    if kind == "source":
        return [{"language": s.upper(), "name": language_name(s)} for s in sorted({s for s, _ in pairs})]
    codes = sorted({t for _, t in pairs})
    out = []
    for code in codes:
        variants = [v for v, base in TARGET_VARIANTS.items() if base == code] or [code.upper()]
        out += [{"language": v, "name": language_name(code) + (f" ({v.split('-')[1]})" if "-" in v else ""),
                 "supports_formality": False} for v in variants]
    return out


@router.get("/v2/usage", summary="DeepL: characters translated (this process)", operation_id="deepl_usage_get")
@router.post("/v2/usage", summary="DeepL: characters translated (this process)", operation_id="deepl_usage_post")
async def usage(request: Request, settings: SettingsDep):
    _auth(request, settings)
    return {"character_count": _usage(request).characters, "character_limit": CHARACTER_LIMIT}
