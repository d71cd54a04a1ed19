"""Rules the validators enforce across fields or on what a text holds, stated in the OpenAPI
schema too (``service.http.openapi.contract`` applies them; pure dicts, no HTTP), so that data valid against the
schema is data the server accepts, and a schema-driven fuzzer (schemathesis) agrees with it:

- a user turn's text is not blank (Anthropic's messages, the Responses API's input, whose
  validators refuse blank text);
- ``top_logprobs`` needs ``logprobs: true`` (chat); a tool choice needs tools (Responses, Anthropic);
- a choice constraint is a non-empty list of non-empty strings; one field at most constrains the
  output; a translation stream carries one text;
- ``/tokenize`` takes exactly one of ``prompt``, ``content``, ``messages``; ``/detokenize``'s
  ids are in the vocabulary of the model that reads them;
- a fill-mask text contains the model's mask token.
"""

from __future__ import annotations

import re
from typing import Any

from service.schemas.common import NOT_BLANK

NOT_NULL = {"not": {"type": "null"}}


def apply(components: dict[str, Any], registry) -> None:
    engines = [e for e in registry.engines.values() if e.ready]
    _blank_turns(components)
    chat = components.get("ChatCompletionRequest")
    if chat:
        chat["if"] = {"required": ["top_logprobs"], "properties": {"top_logprobs": NOT_NULL}}
        chat["then"] = {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}
    for name, field in (("StructuredOutputs", "choice"), ("ChatCompletionRequest", "guided_choice"),
                        ("CompletionRequest", "guided_choice")):
        for branch in components.get(name, {}).get("properties", {}).get(field, {}).get("anyOf", []):
            if branch.get("type") == "array":
                branch.update(minItems=1, items={"type": "string", "minLength": 1})
    _tool_choice_needs_tools(components)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        _one_constraint(components.get(name))
    for name, fields in (("CompletionRequest", ("guided_regex", "guided_grammar", "guided_json")),
                         ("ChatCompletionRequest", ("guided_regex", "guided_grammar", "guided_json")),
                         ("StructuredOutputs", ("regex", "grammar", "json"))):
        for field in fields:  # a pattern, grammar or schema text is not empty
            for branch in components.get(name, {}).get("properties", {}).get(field, {}).get("anyOf", []):
                if branch.get("type") == "string":
                    branch["minLength"] = 1
    text_format = components.get("TextFormat")
    if text_format:  # a json_schema format carries its schema (branches: a generator may not apply an if/then)
        text_format["anyOf"] = [{"properties": {"type": {"enum": ["text", "json_object"]}}},
                                {"required": ["schema"], "properties": {"schema": {"type": "object"}}}]
    translate = components.get("TranslateRequest")
    if translate:  # a stream carries one text
        translate.setdefault("allOf", []).append({"anyOf": [{"properties": {"stream": {"const": False}}},
                                                            {"properties": {"text": {"type": "string"}}}]})
    responses = components.get("ResponsesRequest")
    if responses:  # a chat model
        chat_models = [e.name for e in engines if e.family == "decoder" and getattr(e, "chat", None) is not None]
        responses["properties"]["model"] = {"enum": chat_models, "description": "a loaded model with a chat "
                                            "template (GET /v1/models: chat); another is a 400, an unknown one a 404"}
    tokenize = components.get("TokenizeRequest")
    if tokenize:
        fields = ("prompt", "content", "messages")
        # one branch per field, the others null or absent: exclusive by construction, and the
        # messages branch names the chat models itself (a generator picks a branch; an if/then it may not apply)
        tokenize["oneOf"] = [{"required": [f], "properties": {f: NOT_NULL, **{o: {"type": "null"} for o in fields
                                                                              if o != f}}} for f in fields]
        tokenize["description"] = ("exactly one of prompt, content (llama.cpp's name) or messages; messages need a "
                                   "model with a chat template")
        chat_models = [e.name for e in engines if e.family == "decoder" and getattr(e, "chat", None) is not None]
        tokenize["oneOf"][2]["properties"]["model"] = {"enum": [None, *chat_models]}
    _token_ids(components.get("DetokenizeRequest"), engines, registry)
    _mask_token(components.get("FillMaskRequest"), [e for e in engines if e.family == "encoder"])


CONSTRAINTS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _one_constraint(request: dict | None) -> None:
    """At most one field constrains the output (``response_format`` is only ``text`` here)."""
    if request:
        fields = [f for f in CONSTRAINTS if f in request["properties"]]
        request.setdefault("allOf", []).append({"anyOf": [
            {"properties": {other: {"type": "null"} for other in fields if other != kept}} for kept in fields]})


def _tool_choice_needs_tools(components: dict) -> None:
    """A tool choice other than none needs a non-empty ``tools`` (Responses, Anthropic)."""
    has_tools = {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}
    no_choice = {"ResponsesRequest": {"enum": [None, "none"]},
                 "MessagesRequest": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
                     "type": {"const": "none"}}}]}}
    no_choice["CountTokensRequest"] = no_choice["MessagesRequest"]
    for name, choice in no_choice.items():
        request = components.get(name)
        if request:
            request.setdefault("allOf", []).append(
                {"anyOf": [has_tools, {"properties": {"tool_choice": choice}}]})


def _not_blank_text(*, tool_results: bool) -> dict:
    """A string with a non-blank character, or a list of blocks with a non-blank text (or a tool result)."""
    blocks = [{"type": "object", "required": ["type", "text"], "properties": {
        "type": {"enum": ["text", "input_text", "output_text"]}, "text": {"type": "string", "pattern": NOT_BLANK}}}]
    if tool_results:
        blocks.append({"type": "object", "required": ["type"], "properties": {"type": {"const": "tool_result"}}})
    return {"anyOf": [{"type": "string", "pattern": NOT_BLANK}, {"type": "array", "contains": {"anyOf": blocks}}]}


def _without_block(kind: str) -> dict:
    return {"properties": {"content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {
        "not": {"type": "object", "required": ["type"], "properties": {"type": {"const": kind}}}}}]}}}


def _blank_turns(components: dict) -> None:
    for name, tool_results in (("MessageParam", True), ("MessageItem", False)):
        message = components.get(name)
        if message:  # an assistant turn may be empty (an earlier reply)
            message["if"] = {"required": ["role"], "properties": {"role": {"const": "assistant"}}}
            message["else"] = {"properties": {"content": _not_blank_text(tool_results=tool_results)}}
            if tool_results:  # tool_use blocks belong in assistant turns, tool_result blocks in user turns
                message["then"] = _without_block("tool_result")
                message["else"] = {"allOf": [message["else"], _without_block("tool_use")]}
    responses = components.get("ResponsesRequest", {}).get("properties", {})
    for branch in responses.get("input", {}).get("anyOf", []):
        if branch.get("type") == "string":
            branch["pattern"] = NOT_BLANK


def _token_ids(request: dict | None, engines: list, registry) -> None:
    """Each model's vocabulary; without ``model``, the default text-generation model's."""
    if not request or not engines:
        return
    tokens = request["properties"]["tokens"]
    tokens["items"] = {"type": "integer", "minimum": 0, "maximum": max(e.vocab_size for e in engines) - 1}
    tokens["description"] = "ids in the vocabulary of the model (GET /v1/models), else 400"
    rules = [{"if": {"required": ["model"], "properties": {"model": {"const": e.name}}},
              "then": {"properties": {"tokens": {"items": {"maximum": e.vocab_size - 1}}}}} for e in engines]
    default = registry.default("text-generation") or engines[0]
    rules.append({"if": {"anyOf": [{"not": {"required": ["model"]}}, {"properties": {"model": {"type": "null"}}}]},
                  "then": {"properties": {"tokens": {"items": {"maximum": default.vocab_size - 1}}}}})
    request["allOf"] = rules
    model = request["properties"]["model"]
    model["anyOf"] = [{"enum": [e.name for e in engines]}, {"type": "null"}]
    model["description"] = "a loaded model; none: the default text-generation model; an unknown one is a 404"


def _mask_token(request: dict | None, encoders: list) -> None:
    masks = {e.mask_token for e in encoders if getattr(e, "mask_token", None)}
    if not request or len(masks) != 1:
        return
    (mask,) = masks
    text = request["properties"]["text"]
    for branch in text.get("anyOf", [text]):
        target = branch["items"] if branch.get("type") == "array" else branch
        if target.get("type") == "string":
            target["pattern"] = re.escape(mask)  # holds a non-blank character too
    text["description"] = f"texts each containing the mask token {mask} (else 400). " + text.get("description", "")
