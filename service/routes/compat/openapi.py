"""The OpenAPI contract of the drop-in APIs (TGI, TEI, ``POST /``, LibreTranslate, DeepL, Anthropic):
what each route accepts, what it answers and in which error shape, completed for this
server's settings and models (``service.http.openapi.contract`` calls ``drop_ins``).

Each API keeps its own error body: TGI and TEI ``{"error", "error_type"}``, LibreTranslate
``{"error"}``, DeepL ``{"message"}``, Anthropic ``{"type": "error", "error": {"type", "message"}}``;
a body over TSERVE_MAX_BODY_BYTES (413) or headers over the limits (431) are answered before any
route, in the OpenAI shape. Unknown fields are ignored, as those servers ignore them (Anthropic
refuses them, as Anthropic does; docs/api-errors.md); fields this server cannot honour
are accepted only at their neutral value. LibreTranslate and DeepL read JSON, a form, or the
query string (the schema states JSON and the form).
"""

from __future__ import annotations

import re
from typing import Any

from service.engines.generative import MAX_STOP_STRINGS
from service.models.lookup import placeholder_schema
from service.routes.compat.common import SSE_EVENT
from service.routes.compat.deepl import FLAG_TEXTS, FORMALITY, TARGET_VARIANTS
from service.routes.compat.hf_inference import EMBED_KEYS
from service.schemas.common import NOT_BLANK
from service.translation.translate import language_pair

OPENAI_ERROR = {"$ref": "#/components/schemas/ErrorResponse"}
ERRORS = {
    "HFError": {"type": "object", "required": ["error", "error_type"], "properties": {
        "error": {"type": "string"}, "error_type": {"type": "string"}}},
    "LibreTranslateError": {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
    "DeepLError": {"type": "object", "required": ["message"], "properties": {"message": {"type": "string"}}},
    "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
            "type": {"type": "string"}, "message": {"type": "string"}}}}},
}
ANTHROPIC = {400: "invalid_request_error: a field out of range, a prompt over the model's tokens, a model without a "
                  "chat template", 401: "authentication_error: no or a wrong x-api-key / Bearer key",
             404: "not_found_error: no loaded model has this name", 500: "api_error",
             504: "timeout_error: the request ran past TSERVE_REQUEST_TIMEOUT_S",
             529: "overloaded_error: the queue is full (Retry-After), or models are still loading"}
ANTHROPIC_EVENTS = {**SSE_EVENT, "description": (
    "named Server-Sent Events: event: message_start, ping, content_block_start, content_block_delta (text_delta or "
    "input_json_delta), content_block_stop, message_delta, message_stop; event: error with the error body if "
    "generation fails after the stream started")}
TGI = {401: "no or a wrong Bearer key", 422: "validation: a field out of range, an unknown model, a prompt too long",
       424: "generation failed (timeout)", 429: "overloaded (Retry-After)",
       503: "models still loading, or shutting down"}
TEI = {400: "an empty input", 401: "no or a wrong Bearer key", 413: "an input over the model's tokens, "
       "without truncate", 422: "validation: a field out of range, an unknown model", 424: "embedding failed",
       429: "overloaded (Retry-After)", 503: "models still loading, or shutting down"}
LT = {400: "a missing or bad parameter, a language pair no model serves", 403: "a wrong api_key",
      429: "busy (Retry-After)", 500: "translation failed (timeout)", 503: "models still loading"}
DEEPL = {400: "a missing or bad parameter, a language pair no model serves", 403: "a wrong DeepL-Auth-Key",
         429: "busy (Retry-After)", 500: "translation failed (timeout)", 503: "models still loading"}
BEFORE_ROUTES = {413: "body over TSERVE_MAX_BODY_BYTES (OpenAI error shape, before any route)",
                 431: "request headers over TSERVE_MAX_HEADER_BYTES / TSERVE_MAX_HEADERS (OpenAI error shape)"}
# path -> (error schema, statuses, streams)
ROUTES = {
    ("post", "/generate"): ("HFError", TGI, False), ("post", "/generate_stream"): ("HFError", TGI, True),
    ("post", "/"): ("HFError", TGI, None),
    ("get", "/info"): ("HFError", {401: TGI[401], 422: "no model loaded"}, False),
    **{("get", f"/v1/{task}/info"): ("HFError", {401: TGI[401], 404: "no model of this task loaded"}, False)
       for task in ("embeddings", "generate", "fill-mask", "translate")},
    ("post", "/embed"): ("HFError", TEI, False),
    ("post", "/translate"): ("LibreTranslateError", LT, False), ("post", "/detect"): ("LibreTranslateError", LT, False),
    ("get", "/languages"): ("LibreTranslateError", {}, False),
    ("get", "/frontend/settings"): ("LibreTranslateError", {}, False),
    ("post", "/v2/translate"): ("DeepLError", DEEPL, False),
    ("get", "/v2/languages"): ("DeepLError", {400: "a bad type", 403: DEEPL[403]}, False),
    ("post", "/v2/languages"): ("DeepLError", {400: "a bad type", 403: DEEPL[403]}, False),
    ("get", "/v2/usage"): ("DeepLError", {403: DEEPL[403]}, False),
    ("post", "/v2/usage"): ("DeepLError", {403: DEEPL[403]}, False),
}
TGI_EVENT = {"type": "object", "required": ["data"], "description": (
    "one `data: {json}` event per token: {index, token: {id, text, logprob, special}, top_tokens, generated_text "
    "(last event only), details (last, with details=true)}; {error, error_type} if generation fails after it "
    "started; no [DONE] (TGI sends none)"), "properties": {"data": {
        "type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [
            {"type": "object", "required": ["index", "token", "generated_text"], "properties": {
                "index": {"type": "integer"}, "generated_text": {"type": ["string", "null"]},
                "token": {"type": "object", "required": ["id", "text", "special"]}}},
            {"$ref": "#/components/schemas/HFError"}]}}}}
FILL_MASK_KEYS = ["targets", "top_k"]
NEUTRAL = "not supported: accepted only at its neutral value, as a server without the feature"


def drop_ins(schema: dict[str, Any], settings, registry) -> None:
    components = schema["components"]["schemas"]
    components.update(ERRORS)
    engines = [e for e in registry.engines.values() if e.ready]
    text = {"type": "string", "minLength": 1, "maxLength": settings.max_text_chars, "pattern": NOT_BLANK}
    texts = {"anyOf": [text, {"type": "array", "items": text, "minItems": 1, "maxItems": settings.max_texts}]}
    decoders = [e for e in engines if e.family == "decoder"]
    encoders = [e for e in engines if e.family == "encoder"]
    _tgi(components, text, decoders, MAX_STOP_STRINGS)
    _tei(components, texts, encoders)
    pairs = sorted({p for e in engines if e.family == "encoder-decoder" for p in [language_pair(e)] if p})
    paths = schema["paths"]
    paths["/"]["post"]["requestBody"] = _json_body(_hf_root(texts, pairs, encoders, settings))
    for path, body in (("/translate", _libretranslate(texts, pairs)), ("/detect", _detect(texts)),
                       ("/v2/translate", _deepl(texts, pairs)), ("/v2/languages", _deepl_type())):
        paths[path]["post"]["requestBody"] = _json_body(body, form=True)
    paths["/v2/languages"]["post"]["requestBody"]["required"] = False  # no body: type=source
    paths["/v2/languages"]["get"]["parameters"] = [{"name": "type", "in": "query", "required": False,
                                                    "schema": {"enum": ["source", "target"]}}]
    _anthropic(schema, components, [e.name for e in decoders if getattr(e, "chat", None) is not None])
    components["ResponsesRequest"]["properties"]["previous_response_id"] = {
        "type": "null", "description": "not supported: nothing is stored (400 naming it)"}
    for (method, path), (error, statuses, streams) in ROUTES.items():
        responses = paths[path][method]["responses"]
        ok = responses.setdefault("200", {"description": "Successful Response"})
        content = ok.setdefault("content", {"application/json": {"schema": {}}})
        if streams or streams is None:
            content["text/event-stream"] = {"schema": TGI_EVENT}
            if streams:
                content.pop("application/json", None)
            ok["description"] = ("one Server-Sent Event per token (TGI's stream)" if streams else
                                 "JSON, or with stream=true one Server-Sent Event per token (TGI's stream)")
        body = {"$ref": f"#/components/schemas/{error}"}
        for status, why in statuses.items():
            responses[str(status)] = {"description": why, "content": {"application/json": {"schema": body}}}
        if method == "post":
            for status, why in BEFORE_ROUTES.items():
                responses[str(status)] = {"description": why, "content": {"application/json": {"schema":
                                                                                               OPENAI_ERROR}}}


def _json_body(body: dict, form: bool = False) -> dict:
    content = {"application/json": {"schema": body}}
    if form:
        content["application/x-www-form-urlencoded"] = {"schema": _no_nulls(body)}
    return {"required": True, "content": content}


def _no_nulls(schema: Any) -> Any:
    """The form's schema: a form field has no null (leaving it out gives the default)."""
    if isinstance(schema, dict):
        out = {k: _no_nulls(v) for k, v in schema.items()}
        if isinstance(out.get("enum"), list):
            out["enum"] = [v for v in out["enum"] if v is not None]
        return out
    return [_no_nulls(v) for v in schema] if isinstance(schema, list) else schema


def _any_case(codes: list[str]) -> dict:
    """Language codes as the server reads them: in any case."""
    cased = ["".join(f"[{c.upper()}{c.lower()}]" if c.isalpha() else c for c in code) for code in codes]
    return {"type": "string", "pattern": "^(" + "|".join(cased) + ")$"}


def _neutral(prop: dict, *values: Any) -> None:
    prop.clear()
    prop.update(enum=[None, *values], description=NEUTRAL)


def _tgi(components: dict, text: dict, decoders: list, max_stop: int) -> None:
    request, params = components["TGIRequest"]["properties"], components["TGIParameters"]["properties"]
    request["inputs"] = {**text, "description": "the prompt; its tokens must leave room for one new token "
                         "(GET /info: max_total_tokens), else 422; the output ends where the context does"}
    if decoders:
        request["model"] = {"anyOf": [{"enum": [None, *(e.name for e in decoders)]}, placeholder_schema()],
                            "description": "extension: a loaded text-generation model (TGI serves one), or a "
                            "placeholder for the default; another is a 422"}
        params["max_new_tokens"] = {"anyOf": [{"type": "integer", "minimum": 1,
                                               "maximum": min(e.max_len for e in decoders) - 1}, {"type": "null"}]}
    params["stop"] = {"type": "array", "maxItems": max_stop, "items": {"type": "string", "minLength": 1}}
    for name in ("grammar", "truncate", "adapter_id"):
        _neutral(params[name])
    _neutral(params["best_of"], 1)
    _neutral(params["typical_p"], 1.0)
    _neutral(params["frequency_penalty"], 0.0)
    params["watermark"] = {"const": False, "description": NEUTRAL}


def _tei(components: dict, texts: dict, encoders: list) -> None:
    props = components["EmbedRequest"]["properties"]
    props["inputs"] = {**texts, "description": "texts to embed; each within the model's tokens unless truncate "
                       "(else 413)"}
    props["truncation_direction"] = {"enum": ["Right", "right"], "description": "Left: not supported (400)"}
    _neutral(props["prompt_name"])
    if encoders:
        props["model"] = {"anyOf": [{"enum": [None, *(e.name for e in encoders)]}, placeholder_schema()]}
        props["dimensions"] = {"anyOf": [{"enum": sorted({e.dimensions for e in encoders})}, {"type": "null"}],
                               "description": "only the model's own width (no truncation)"}


def _hf_root(texts: dict, pairs: list, encoders: list, settings) -> dict:
    """``POST /``: the task is read from the payload (``service.routes.compat.hf_inference``)."""
    ref = "#/components/schemas/"
    no_params = {"not": {"required": ["parameters"]}}
    branches = [
        {"title": "text generation (TGI): stream, a generation parameter, or the loaded models' first task",
         "allOf": [{"$ref": ref + "TGIRequest"}, {"properties": {k: False for k in sorted(EMBED_KEYS)}}, {
             "properties": {"parameters": {"not": {"minProperties": 1, "propertyNames": {"enum": FILL_MASK_KEYS}}}},
             "description": "parameters with only top_k / targets ask for fill-mask"}]},
        {"title": "embeddings (TEI /embed): one of TEI's fields", "allOf": [
            {"$ref": ref + "EmbedRequest"}, no_params, {"anyOf": [{"required": [k]} for k in sorted(EMBED_KEYS)]}]},
    ]
    if pairs:
        branches.append({"title": "translation", "type": "object", "required": ["inputs", "parameters"],
                         "properties": {"inputs": texts, "parameters": {"anyOf": [
                             {"type": "object", "required": ["src_lang", "tgt_lang"],
                              "properties": {"src_lang": {"const": s}, "tgt_lang": {"const": t}}} for s, t in pairs]}}})
    masks = [e.mask_token for e in encoders if getattr(e, "mask_token", None)]
    if masks:
        masked = {"type": "string", "maxLength": settings.max_text_chars, "pattern": re.escape(masks[0])}
        branches.append({"title": "fill-mask", "type": "object", "required": ["inputs", "parameters"], "properties": {
            "inputs": masked,
            "parameters": {"type": ["object", "null"], "additionalProperties": False,
                           "properties": {"top_k": {"type": "integer", "minimum": 1, "maximum": 100}}}},
            "not": {"anyOf": [{"required": [k]} for k in sorted(EMBED_KEYS)]}})
    return {"anyOf": branches}


def _pairs_of(pairs: list, source: str, target: str, upper: bool = False, auto: bool = False) -> list[dict]:
    def code(c: str) -> str:
        return c.upper() if upper else c

    out = []
    for s, t in pairs:
        targets = [v for v, base in TARGET_VARIANTS.items() if base == t] if upper else []
        if upper:  # DeepL reads codes in any case, and an empty source_lang as none given (detected)
            out.append({"properties": {source: _any_case(["", s]), target: _any_case(targets or [t])}})
        else:
            out.append({"properties": {source: {"enum": [code(s)] + (["auto"] if auto else [])},
                                       target: {"enum": targets or [code(t)]}}})
    return out


def _libretranslate(texts: dict, pairs: list) -> dict:
    body = {"type": "object", "required": ["q", "source", "target"], "properties": {
        "q": texts, "source": {"type": "string", "description": "a language code, or auto (detected; texts in "
                                                                "several languages, or one no model translates: 400)"},
        "target": {"type": "string"}, "format": {"enum": ["text", "html"]},
        "alternatives": {"type": "integer", "minimum": 0, "maximum": 3},
        "api_key": {"type": "string", "description": "required when the server has a key (else 403)"}}}
    if pairs:
        body["anyOf"] = _pairs_of(pairs, "source", "target", auto=True)
    return body


def _detect(texts: dict) -> dict:
    return {"type": "object", "required": ["q"], "properties": {"q": texts, "api_key": {"type": "string"}}}


def _deepl(texts: dict, pairs: list) -> dict:
    body = {"type": "object", "required": ["text", "target_lang"], "properties": {
        "text": texts, "target_lang": {"type": "string"}, "source_lang": {"type": "string"},
        "formality": {"enum": [None, "", *(f for f in FORMALITY if f not in ("more", "less"))],
                      "description": "more / less: not supported for these models (400)"},
        "glossary_id": {"enum": [None, ""], "description": "no glossaries (400)"},
        "tag_handling": {"enum": [None, "", "html"], "description": "xml: not supported (400)"},
        "show_billed_characters": {"anyOf": [{"type": "boolean"}, {"enum": list(FLAG_TEXTS)}]}}}
    if pairs:
        body["anyOf"] = _pairs_of(pairs, "source_lang", "target_lang", upper=True)
    return body


def _deepl_type() -> dict:
    return {"type": "object", "properties": {"type": {"enum": ["source", "target"]}}}


def _anthropic(schema: dict, components: dict, chat_models: list[str]) -> None:
    """``/v1/messages`` and ``/count_tokens``: Anthropic's error body and statuses, the chat models."""
    for name in ("MessagesRequest", "CountTokensRequest"):
        props = components[name]["properties"]
        if chat_models:
            props["model"] = {"enum": chat_models, "description": "a loaded model with a chat template; another "
                              "name is a 404 not_found_error"}
    # a tool choice of type tool names the tool (as branches: a generator may not apply an if/then)
    components["ToolChoiceParam"]["anyOf"] = [
        {"properties": {"type": {"enum": ["auto", "any", "none"]}}},
        {"required": ["name"], "properties": {"type": {"const": "tool"}, "name": {"type": "string", "minLength": 1}}}]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        responses = schema["paths"][path]["post"]["responses"]
        responses.pop("422", None)
        ok = responses.setdefault("200", {"description": "Successful Response"})
        ok["content"] = {"application/json": {"schema": {"type": "object"}}}
        if path == "/v1/messages":
            ok["content"]["text/event-stream"] = {"schema": ANTHROPIC_EVENTS}
            ok["description"] = "a message, or with stream=true its named events"
        body = {"$ref": "#/components/schemas/AnthropicError"}
        for status, why in ANTHROPIC.items():
            responses[str(status)] = {"description": why, "content": {"application/json": {"schema": body}}}
        for status, why in BEFORE_ROUTES.items():
            responses[str(status)] = {"description": why, "content": {"application/json": {"schema": OPENAI_ERROR}}}
