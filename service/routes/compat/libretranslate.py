"""LibreTranslate: POST /translate, GET /languages, POST /detect, GET /frontend/settings.

As LibreTranslate serves them (https://libretranslate.com/docs): parameters as JSON, form or
query string; ``q`` a string or a list; ``source`` may be ``auto``; errors are
``{"error": message}`` with 400 (bad request), 403 (API key), 429 (busy), 500.
A language pair is served by the model ``service.translation.translate.engine_for`` picks (the pair in
its config.json; for a checkpoint without one, a name ``*-<source>-<target>``), as for DeepL.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from service.engines.errors import EngineError, InvalidRequestError
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
from service.routes.streaming import mark
from service.translation.language_id import detect as identify
from service.translation.translate import engine_for, reload_unloaded, translation_pairs


def _render(exc: EngineError) -> JSONResponse:
    status = exc.status if exc.status in (400, 403, 429, 500, 503) else (400 if exc.status < 500 else 500)
    headers = ({"Retry-After": str(getattr(exc, "retry_after", 1))}
               if status == 429 or hasattr(exc, "retry_after") else None)
    return JSONResponse({"error": exc.message}, status_code=status, headers=headers)


router = APIRouter(tags=["LibreTranslate"], route_class=error_route(_render))


def _check_key(settings, params: dict) -> None:
    if not isinstance(params.get("api_key", ""), str):
        raise InvalidRequestError("Invalid request: api_key must be a string", "api_key")
    if not key_matches(settings, params.get("api_key")):
        raise CompatError(403, "Invalid API key", "invalid_api_key")


def _need(params: dict, name: str):
    value = params.get(name)
    if value is None or value == "" or value == []:
        raise InvalidRequestError(f"Invalid request: missing {name} parameter", name)
    if name != "q" and not isinstance(value, str):  # a language code (q: a text or a list, checked later)
        raise InvalidRequestError(f"Invalid request: {name} must be a language code (a string)", name)
    return value


def _detect_all(texts: list[str], among: set[str]) -> list[dict]:
    out = []
    for text in texts:
        code, p = identify(text, among, top=1)[0]
        out.append({"confidence": round(p * 100, 1), "language": code})
    return out


@router.post("/translate", summary="LibreTranslate: translate text (JSON, form or query parameters)")
async def translate(request: Request, registry: RegistryDep, settings: SettingsDep):
    await reload_unloaded(registry)  # the pairs the schema lists
    params = await read_params(request)
    _check_key(settings, params)
    q, source, target = _need(params, "q"), _need(params, "source"), _need(params, "target")
    fmt = params.get("format", "text")
    fmt = "text" if fmt == "" else fmt  # an empty form field
    if fmt not in ("text", "html"):
        raise InvalidRequestError(f"{fmt} format is not supported", "format")
    alternatives = params.get("alternatives", 0)  # JSON null is not an integer (the schema says so)
    alternatives = 0 if alternatives == "" else alternatives  # a form's value is text: "2", or empty
    if isinstance(alternatives, str) and alternatives.strip().isdecimal():
        alternatives = int(alternatives)
    if isinstance(alternatives, float) and alternatives.is_integer():  # JSON Schema's integer takes 2.0
        alternatives = int(alternatives)
    if isinstance(alternatives, bool) or not isinstance(alternatives, int):
        raise InvalidRequestError("Invalid request: alternatives must be an integer", "alternatives")
    if not 0 <= alternatives <= 3:
        raise InvalidRequestError("Invalid request: alternatives must be between 0 and 3", "alternatives")
    texts = text_list(q, "q", settings)
    pairs = translation_pairs(registry)
    sources = {s for s, _ in pairs}
    targets = {t for _, t in pairs}
    detected = None
    if source == "auto":
        detected = await asyncio.to_thread(_detect_all, texts, sources | targets)
        langs = {d["language"] for d in detected}
        if len(langs) > 1:
            raise InvalidRequestError("Texts in more than one language cannot be translated in one request "
                                      f"(detected {sorted(langs)})", "q")
        source = detected[0]["language"]
    if source not in sources and source not in targets:
        raise InvalidRequestError(f"{source} is not supported", "source")
    if target not in targets and target not in sources:
        raise InvalidRequestError(f"{target} is not supported", "target")
    found = engine_for(registry, source, target)
    if found is None:
        raise InvalidRequestError(f"{language_name(target)} ({target}) is not available as a target language from "
                                  f"{language_name(source)} ({source}{', detected' if detected else ''})", "target")
    engine = found[1]
    if fmt == "html":
        translated = await translate_html(request, engine, texts, "q", settings)
    else:
        translated, _ = await translate_texts(request, engine, texts, "q", settings)
    single = isinstance(q, str)
    body: dict = {"translatedText": translated[0] if single else translated}
    if alternatives and fmt == "text":
        # Sampled translations that differ from the best one (the model gives one beam result).
        options = await asyncio.gather(*(translate_texts(request, engine, texts, "q", settings, beam_size=1,
                                                         temperature=0.8, seed=seed) for seed in range(alternatives)))
        alts = [list(dict.fromkeys(o[0][i] for o in options if o[0][i] != translated[i]))[:alternatives]
                for i in range(len(texts))]
        body["alternatives"] = alts[0] if single else alts
    elif alternatives:
        body["alternatives"] = [] if single else [[] for _ in texts]
    if detected is not None:
        body["detectedLanguage"] = detected[0] if single else detected
    return body


@router.get("/languages", summary="LibreTranslate: languages and the targets each can be translated to")
async def languages(registry: RegistryDep):
    await reload_unloaded(registry)  # the pairs the schema lists
    pairs = translation_pairs(registry)
    codes = sorted({c for pair in pairs for c in pair})
    return [{"code": c, "name": language_name(c), "targets": sorted(t for s, t in pairs if s == c)} for c in codes]


@router.post("/detect", summary="LibreTranslate: identify the language of a text (langid)")
async def detect(request: Request, registry: RegistryDep, settings: SettingsDep):
    await reload_unloaded(registry)  # the pairs the schema lists
    params = await read_params(request)
    _check_key(settings, params)
    q = _need(params, "q")
    texts = text_list(q, "q", settings)
    among = {c for pair in translation_pairs(registry) for c in pair}
    mark(request, "langid")

    def run() -> list[list[dict]]:
        return [[{"confidence": round(p * 100, 1), "language": code} for code, p in identify(t, among, top=3)]
                for t in texts]

    ranked = await asyncio.to_thread(run)
    return ranked[0] if isinstance(q, str) else ranked


@router.get("/frontend/settings", summary="LibreTranslate: the settings its web front end reads")
async def frontend_settings(registry: RegistryDep, settings: SettingsDep):
    await reload_unloaded(registry)  # the pairs the schema lists
    pairs = translation_pairs(registry)
    source, target = next(iter(pairs), ("en", "en"))
    return {"charLimit": settings.max_text_chars, "frontendTimeout": 500, "apiKeys": settings.api_key is not None,
            "keyRequired": settings.api_key is not None, "suggestions": False, "filesTranslation": False,
            "supportedFilesFormat": [],
            "language": {"source": {"code": "auto", "name": "Auto Detect"},
                         "target": {"code": target, "name": language_name(target)}},
            "defaultSource": source}
