"""The OpenAPI schema as the contract: what FastAPI derives from the models, completed with
what the server enforces at run time, so a schema-driven client (or schemathesis) and the
server agree.

Added to FastAPI's schema:
- text inputs: ``minLength`` 1 and ``pattern`` ``NOT_BLANK`` (blank text is refused), ``maxLength``
  TSERVE_MAX_TEXT_CHARS; lists: ``minItems`` 1 and ``maxItems`` TSERVE_MAX_TEXTS; token ids
  within the vocabulary;
- ``model``: the loaded models of the family the endpoint serves (another family's model is a
  400, an unknown one a 404, both documented);
- ``text/event-stream`` for the endpoints that stream (``stream: true``);
- the error responses of the probes and of ``/v1/models/{model_id}`` (404); FastAPI's 422
  is dropped (validation errors are 400s here).
Limits that depend on tokenization (prompt + max_tokens, tokens per input) cannot be stated
in JSON Schema: they are described on the fields and answered with a 400 naming them.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI

from service.engines.generative import MAX_STOP_STRINGS
from service.models.lookup import FAMILY_NAMES
from service.routes.compat.openapi import drop_ins
from service.schemas import contract_rules
from service.schemas.common import NOT_BLANK

# request schema -> (the family its endpoint serves, its text-input fields)
REQUESTS = {
    "GenerateRequest": ("decoder", ["prompt"]),
    "CompletionRequest": ("decoder", ["prompt"]),
    "TranslateRequest": ("encoder-decoder", ["text"]),
    "FillMaskRequest": ("encoder", ["text"]),
    "EmbeddingRequest": ("encoder", ["input"]),
}
STREAMING = {"/v1/generate": "GenerateChunk", "/v1/completions": "CompletionChunk",
             "/v1/translate": "TranslateChunk", "/v1/chat/completions": "ChatCompletionChunk"}
TOKEN_LIMIT = (" Tokens are checked too: a prompt (a translation source, an encoder input) must fit the model's "
               "max_seq_len (GET /v1/models), a prompt with room for one generated token, else 400. A generation "
               "ends where the context does (finish_reason length), before max_tokens if the prompt leaves less.")
ERROR = {"$ref": "#/components/schemas/ErrorResponse"}


def contract(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema (cached by FastAPI) completed for this server's settings and models."""
    schema = copy.deepcopy(app.openapi())
    settings, registry = app.state.settings, app.state.registry
    components = schema["components"]["schemas"]
    components.update(CHUNKS)
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    for name, (family, fields) in REQUESTS.items():
        props = components[name]["properties"]
        engines = [e for e in registry.engines.values() if e.family == family]
        vocab = min((e.cfg.vocab_size for e in engines), default=None)
        max_ids = min((e.max_len - (family == "decoder") for e in engines), default=None)
        for field in fields:
            _text_input(props[field], settings.max_text_chars, settings.max_texts, vocab, max_ids)
            props[field]["description"] = (props[field].get("description", "") + TOKEN_LIMIT).strip()
        _model_field(props["model"], family, [e.name for e in engines])
        if engines:  # the model's own bounds, where one number states them
            max_len = min(e.max_len for e in engines)
            cap = max_len - 1 if family != "encoder" else None  # at least one prompt token
            if "max_tokens" in props and cap:
                _set(props["max_tokens"], maximum=min(cap, _get(props["max_tokens"], "maximum", cap)))
                if isinstance(props["max_tokens"].get("default"), int):  # a default past the cap shrinks to it
                    props["max_tokens"]["default"] = min(cap, props["max_tokens"]["default"])
            if "beam_size" in props:
                _set(props["beam_size"], maximum=min(settings.max_batch, _get(props["beam_size"], "maximum", 16)))
            if "dimensions" in props:
                widths = sorted({e.cfg.d_model for e in engines})
                _set(props["dimensions"], enum=widths)
    decoders = [e for e in registry.engines.values() if e.family == "decoder"]
    if decoders:  # the chat doors' output limits: at most what the smallest context leaves after one token
        cap = min(e.max_len for e in decoders) - 1
        for name, field in (("ChatCompletionRequest", "max_tokens"), ("ChatCompletionRequest", "max_completion_tokens"),
                            ("MessagesRequest", "max_tokens"), ("ResponsesRequest", "max_output_tokens")):
            prop = components.get(name, {}).get("properties", {}).get(field)
            if prop:
                _set(prop, maximum=min(cap, _get(prop, "maximum", cap)))
    for name, request in components.items():  # stop strings: non-empty, at most MAX_STOP_STRINGS
        stop = request.get("properties", {}).get("stop") if name.endswith("Request") else None
        for branch in (stop or {}).get("anyOf", []):
            if branch.get("type") == "string":
                branch["minLength"] = 1
            elif branch.get("type") == "array":
                branch.update(maxItems=MAX_STOP_STRINGS, items={"type": "string", "minLength": 1})
    # OpenAI fields accepted only at their neutral value (anything else: 400 "not supported")
    neutral = {"type": "null"}, "not supported: only null or an empty value"
    cmpl = components["CompletionRequest"]["properties"]
    cmpl["logit_bias"] = {"anyOf": [{"type": "object", "maxProperties": 0}, neutral[0]], "description": neutral[1]}
    cmpl["suffix"] = {"anyOf": [{"type": "string", "maxLength": 0}, neutral[0]], "description": neutral[1]}
    chat = components.get("ChatCompletionRequest", {}).get("properties", {})
    if chat:
        chat_models = [e.name for e in registry.engines.values() if e.family == "decoder" and e.chat is not None]
        _model_field(chat["model"], "decoder", chat_models)
        chat["model"]["description"] += "; only a model with a chat template (GET /v1/models: chat), else 400"
        chat["logit_bias"] = {"anyOf": [{"type": "object", "maxProperties": 0}, neutral[0]],
                              "description": neutral[1]}
        for name in ("tools", "functions"):
            chat[name] = {"anyOf": [{"type": "array", "maxItems": 0}, neutral[0]], "description": neutral[1]}
        chat["audio"] = {"type": "null", "description": neutral[1]}
        chat["tool_choice"] = chat["function_call"] = {"enum": [None, "none"], "description": neutral[1]}
        message = components["ChatMessage"]
        message["required"] = sorted({*message.get("required", []), "content"})
        message["properties"]["content"]["anyOf"] = [
            b for b in message["properties"]["content"]["anyOf"] if b.get("type") != "null"]
        for name in ("tool_calls", "function_call", "audio", "refusal"):
            message["properties"][name] = {"type": "null", "description": neutral[1]}
        # blank content is refused, except in an assistant turn
        not_blank = {"anyOf": [{"type": "string", "pattern": NOT_BLANK}, {"type": "array", "contains": {
            "type": "object", "required": ["text"], "properties": {"text": {"type": "string", "pattern": NOT_BLANK}}}}]}
        message["if"] = {"required": ["role"], "properties": {"role": {"const": "assistant"}}}
        message["else"] = {"properties": {"content": not_blank}}
        part = components["TextPart"]
        part["properties"]["type"] = {"const": "text"}
        part["properties"]["text"] = {"type": "string"}
        part["required"] = ["type", "text"]
        components["ResponseFormat"]["properties"]["type"] = {"const": "text"}
        chat["modalities"] = {"anyOf": [{"type": "array", "items": {"const": "text"}, "minItems": 1,
                                         "maxItems": 1}, neutral[0]], "description": "only [\"text\"]"}
    for path, item in schema["paths"].items():
        for op in item.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            if path in STREAMING:
                responses["200"]["content"]["text/event-stream"] = {"schema": _sse_event(STREAMING[path])}
    _po_query(schema["paths"].get("/v1/translate/po", {}).get("post"), registry, settings)
    drop_ins(schema, settings, registry)
    contract_rules.apply(components, registry)
    models = schema["paths"]["/v1/models/{model_id}"]["get"]["responses"]
    models["404"] = {"description": "no loaded model has this id", "content": {"application/json": {"schema": ERROR}}}
    for probe in ("/health", "/ready"):
        schema["paths"][probe]["get"]["responses"]["503"] = {
            "description": "not live (loading failed)" if probe == "/health" else "not ready (loading, or failed)",
            "content": {"application/json": {"schema": {"type": "object"}}}}
    return schema


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _chunk(obj: str, **props: Any) -> dict:
    common = {"id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
              "model": {"type": "string"}}
    optional = ("usage", "logprobs", "placeholders_ok")  # on the last chunk only, or only when asked for
    return {"type": "object", "required": [*common, *(k for k in props if k not in optional)],
            "properties": common | props}


FINISH = {"enum": ["stop", "length", "eos", None]}
CHUNKS = {
    "GenerateChunk": _chunk("text_generation.chunk", text={"type": "string"},
                            token_ids={"type": "array", "items": {"type": "integer"}}, finish_reason=FINISH,
                            logprobs={"type": "array", "items": _ref("TokenLogprob")}, usage=_ref("Usage")),
    "TranslateChunk": _chunk("translation.chunk", text={"type": "string"}, finish_reason=FINISH,
                             usage=_ref("Usage"), placeholders_ok={"type": "boolean"}),
    "CompletionChunk": _chunk("text_completion", usage=_ref("Usage"), choices={"type": "array", "items": {
        "type": "object", "required": ["index", "text", "logprobs", "finish_reason"], "properties": {
            "index": {"type": "integer"}, "text": {"type": "string"},
            "logprobs": {"anyOf": [_ref("CompletionLogprobs"), {"type": "null"}]},
            "finish_reason": {"enum": ["stop", "length", None]}}}}),
    "ChatCompletionChunk": _chunk("chat.completion.chunk", usage=_ref("Usage"), choices={"type": "array", "items": {
        "type": "object", "required": ["index", "delta", "finish_reason"], "properties": {
            "index": {"type": "integer"}, "finish_reason": {"enum": ["stop", "length", None]},
            "delta": {"type": "object", "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}},
            "logprobs": {"anyOf": [_ref("ChoiceLogprobs"), {"type": "null"}]}}}}),
}


def _sse_event(chunk: str) -> dict:
    """One Server-Sent Event: ``data`` is a chunk, or an error (the request failed after it
    started: timeout, shutdown), or the final ``[DONE]``."""
    return {"type": "object", "required": ["data"], "description": (
        f"stream=true: one `data: {{json}}` event per {chunk}; an ErrorResponse event if the request fails "
        f"after it started (timeout, shutdown); then `data: [DONE]`"),
        "properties": {"data": {"type": "string", "if": {"const": "[DONE]"}, "else": {
            "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [_ref(chunk), _ref("ErrorResponse")]}}}}}


def _text_input(prop: dict, max_chars: int, max_items: int, vocab: int | None, max_ids: int | None) -> None:
    """``max_ids``: the most token ids one input may have (the model's limit, one token left for
    the output where the model generates)."""
    text = {"type": "string", "minLength": 1, "maxLength": max_chars, "pattern": NOT_BLANK}
    ids = {"type": "integer", "minimum": 0, **({"maximum": vocab - 1} if vocab else {})}
    bound = {"maxItems": max_ids} if max_ids else {}
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") == "string":
            branch.update(text)
        elif branch.get("type") == "array":
            items = branch["items"]
            if items.get("type") == "string":
                branch.update(minItems=1, maxItems=max_items, items=text)
            elif items.get("type") == "integer":
                branch.update(minItems=1, items=ids, **bound)
            elif items.get("type") == "array":
                branch.update(minItems=1, maxItems=max_items, items={"type": "array", "minItems": 1, "items": ids,
                                                                     **bound})


def _po_query(op: dict | None, registry, settings) -> None:
    """/v1/translate/po's options (query or form fields): a translation model, max_tokens and beam_size
    within its bounds."""
    engines = [e for e in registry.engines.values() if e.family == "encoder-decoder"]
    if not op or not engines:
        return
    query = {p["name"]: p for p in op.get("parameters", [])}
    form = op.get("requestBody", {}).get("content", {}).get("multipart/form-data", {}).get("schema", {})
    for options in (query, form.get("properties", {})):  # the same options, as query parameters or form fields
        if not options:
            continue
        model = options["model"].get("schema", options["model"])
        _model_field(model, "encoder-decoder", [e.name for e in engines])
        options["model"]["description"] = model["description"]
        max_tokens = options["max_tokens"].get("schema", options["max_tokens"])
        max_tokens["maximum"] = min(max_tokens["maximum"], min(e.max_len for e in engines) - 1)
        max_tokens["default"] = min(max_tokens["default"], max_tokens["maximum"])
        beam = options["beam_size"].get("schema", options["beam_size"])
        beam["maximum"] = min(beam["maximum"], settings.max_batch)
        beam["default"] = min(beam["default"], beam["maximum"])


def _model_field(prop: dict, family: str, names: list[str]) -> None:
    kind = FAMILY_NAMES[family]
    prop["description"] = (f"a loaded {kind} model (GET /v1/models); a model of another family is refused "
                           f"with 400, an unknown one with 404")
    if not names:
        return
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") == "string":
            branch["enum"] = names


def _branches(prop: dict) -> list[dict]:
    return [b for b in prop.get("anyOf", [prop]) if b.get("type") != "null"]


def _get(prop: dict, key: str, default: Any) -> Any:
    return next((b[key] for b in _branches(prop) if key in b), default)


def _set(prop: dict, **values: Any) -> None:
    for branch in _branches(prop):
        branch.update(values)
