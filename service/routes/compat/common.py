"""What the drop-in APIs share: their own error shapes, bodies in any encoding, language names,
and the few engine calls (translate, generate, embed, fill) each API shapes differently.

Every compatibility router uses a route class from ``error_route(render)``: an error raised
anywhere below it (the engines' ``EngineError`` table, a body that does not parse, a refused
field) leaves in that API's own shape and status, never in the OpenAI one.
"""

from __future__ import annotations

import hmac
import html
from collections.abc import Callable, Sequence
from html.parser import HTMLParser
from json import JSONDecodeError
from typing import Any
from urllib.parse import parse_qsl

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from service.engines.errors import EngineError, InvalidRequestError
from service.engines.generative import GenerativeEngine, SamplingParams
from service.http.errors import UNION_BRANCH
from service.routes.inputs import text_list
from service.routes.streaming import client_gone, mark
from service.settings import Settings
from service.translation import translate as translation

# a named Server-Sent Event, as a schema-driven client reads one off the stream
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"event": {"type": "string"},
                                                                   "data": {"type": "string"}}}

Render = Callable[[EngineError], Response]


class CompatError(EngineError):
    """An error an API defines itself (its own status and message), e.g. DeepL's 456 or
    LibreTranslate's 403; ``code`` still names the row of the error table for the logs."""

    def __init__(self, status: int, message: str, code: str = "invalid_value", param: str | None = None):
        super().__init__(message, param, code)
        self.status = status


def error_route(render: Render) -> type[APIRoute]:
    """A route class whose errors are rendered by ``render`` (the API's own error shape)."""

    class Route(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()

            async def wrapped(request: Request) -> Response:
                try:
                    return await handler(request)
                except EngineError as exc:
                    return render(exc)
                except (RequestValidationError, ValidationError) as exc:  # a body a route validates itself
                    err = exc.errors()[0]
                    where = ".".join(str(p) for p in err.get("loc", ()) if p != "body" and not (
                        isinstance(p, str) and UNION_BRANCH.match(p)))  # pydantic's union branch names
                    msg = "request body required (a JSON object)" if not where and err["type"] == "missing" \
                        else f"{where}: {err['msg']}" if where else err["msg"]
                    return render(InvalidRequestError(msg, where or None))
                except HTTPException as exc:
                    return render(CompatError(exc.status_code, str(exc.detail)))

            return wrapped

    return Route


async def read_params(request: Request) -> dict[str, Any]:
    """Query parameters, then a urlencoded form or JSON object body on top:
    LibreTranslate and DeepL accept all three (Flask's ``request.values`` plus JSON)."""
    params: dict[str, Any] = {}
    for key in request.query_params:
        values = request.query_params.getlist(key)
        params[key] = values if len(values) > 1 else values[0]
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media == "multipart/form-data":
        raise InvalidRequestError("multipart bodies are not supported; send JSON or application/x-www-form-urlencoded")
    if media == "application/x-www-form-urlencoded" or (not media and request.method == "GET"):
        form: dict[str, list[str]] = {}
        for key, value in parse_qsl((await request.body()).decode("utf-8", "replace"), keep_blank_values=True):
            form.setdefault(key, []).append(value)
        params.update({key: values if len(values) > 1 else values[0] for key, values in form.items()})
    elif await request.body():
        try:
            body = await request.json()
        except (JSONDecodeError, UnicodeDecodeError):
            raise InvalidRequestError("the request body is neither JSON nor a form") from None
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        params.update(body)
    return params


def key_matches(settings: Settings, given: str | None) -> bool:
    """True without TSERVE_API_KEY; otherwise a constant-time comparison with ``given``."""
    if settings.api_key is None:
        return True
    return hmac.compare_digest((given or "").strip().encode(), settings.api_key.get_secret_value().encode())


# --- languages --------------------------------------------------------------------------------

LANGUAGE_NAMES = {
    "ar": "Arabic", "bg": "Bulgarian", "cs": "Czech", "da": "Danish", "de": "German", "el": "Greek",
    "en": "English", "es": "Spanish", "et": "Estonian", "fi": "Finnish", "fr": "French", "hu": "Hungarian",
    "id": "Indonesian", "it": "Italian", "ja": "Japanese", "ko": "Korean", "lt": "Lithuanian", "lv": "Latvian",
    "nb": "Norwegian", "nl": "Dutch", "pl": "Polish", "pt": "Portuguese", "ro": "Romanian", "ru": "Russian",
    "sk": "Slovak", "sl": "Slovenian", "sv": "Swedish", "tr": "Turkish", "uk": "Ukrainian", "zh": "Chinese",
}
def language_name(code: str) -> str:
    return LANGUAGE_NAMES.get(code, code)


# --- engine calls the APIs share ---------------------------------------------------------------

async def translate_texts(request: Request, engine: GenerativeEngine, texts: list[str], field: str,
                          settings: Settings, beam_size: int = 4, temperature: float = 0.0,
                          seed: int | None = None) -> tuple[list[str], int]:
    """Translations of ``texts`` (one engine request each, batched together), and the tokens
    generated. Placeholders go through ``service.translation.translate`` as for /v1/translate: masked
    for a checkpoint trained on sentinels, with its n-best / beam-retry fallback; the APIs'
    response shapes have no ``placeholders_ok``, so only the text is returned."""
    mark(request, engine.name)
    items = translation.sources(engine, text_list(texts, field, settings))
    ids = translation.source_ids(engine, items, field)
    params = SamplingParams(max_new_tokens=min(256, engine.max_len - 1), beam_size=beam_size,
                            temperature=temperature, seed=seed)
    fields = [f"{field}[{i}]" for i in range(len(items))]
    results, usage = await translation.translate(client_gone(request), engine, items, ids, params, fields, field)
    mark(request, usage=usage)
    return [r.text for r in results], usage.completion_tokens


class _Segments(HTMLParser):
    """HTML split into markup (kept as written) and text runs (to translate)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[tuple[bool, str]] = []  # (is text, content)

    def handle_starttag(self, tag, attrs) -> None:
        self.parts.append((False, self.get_starttag_text() or f"<{tag}>"))

    def handle_startendtag(self, tag, attrs) -> None:
        self.parts.append((False, self.get_starttag_text() or f"<{tag}/>"))

    def handle_endtag(self, tag) -> None:
        self.parts.append((False, f"</{tag}>"))

    def handle_data(self, data) -> None:
        self.parts.append((True, data))

    def handle_comment(self, data) -> None:
        self.parts.append((False, f"<!--{data}-->"))


def html_segments(markup: str) -> list[tuple[bool, str]]:
    parser = _Segments()
    parser.feed(markup)
    parser.close()
    return parser.parts


async def translate_html(request: Request, engine: GenerativeEngine, documents: Sequence[str], field: str,
                         settings: Settings, beam_size: int = 4) -> list[str]:
    """Translate the text between tags; tags, attributes and surrounding whitespace stay as sent."""
    split = [html_segments(doc) for doc in documents]
    runs = [text for parts in split for is_text, text in parts if is_text and text.strip()]
    done: list[str] = []
    for start in range(0, len(runs), settings.max_texts):  # runs, not documents: TSERVE_MAX_TEXTS limits documents
        done += (await translate_texts(request, engine, runs[start:start + settings.max_texts], field, settings,
                                       beam_size))[0]
    translated = iter(done)
    out = []
    for parts in split:
        pieces = []
        for is_text, text in parts:
            if is_text and text.strip():
                lead, trail = text[: len(text) - len(text.lstrip())], text[len(text.rstrip()):]
                pieces.append(lead + html.escape(next(translated), quote=False) + trail)
            else:
                pieces.append(html.escape(text, quote=False) if is_text else text)
        out.append("".join(pieces))
    return out
