"""Structured outputs: which constraint a request asks for, checked against the hard limits.

A request may name at most one constraint: OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` object or its older ``guided_*`` fields, or a
tool call forced by ``tool_choice`` (``service/chat/tool_calls.py``). Each becomes a
``GrammarSpec`` the engine compiles (off its thread, with a deadline: ``GenerativeEngine.
submit_constrained``). The limits below are checked before anything is compiled; each is a
400 naming the field and the limit (``TSERVE_GRAMMAR_*``, docs/structured-outputs.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from model.engine.grammar import GrammarSpec
from service.engines.errors import InvalidRequestError
from service.schemas.structured import GuidedFields, ResponseFormat, StructuredOutputs
from service.settings import Settings


@dataclass(frozen=True)
class Constraint:
    spec: GrammarSpec
    field: str  # the request field it came from: errors name it


def schema_text(schema: Any, field: str, settings: Settings) -> str:
    """A JSON Schema (an object, or its JSON text) checked against the limits, as JSON text."""
    if isinstance(schema, str):
        _check_bytes(schema, field, settings)
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{field} is not valid JSON: {exc}", field) from None
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequestError(f"{field} must be a JSON Schema (an object)", field)
    text = json.dumps(schema, ensure_ascii=False)
    _check_bytes(text, field, settings)
    _check_shape(schema, field, settings)
    return json.dumps(closed(schema), ensure_ascii=False)


SUBSCHEMA = {"items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties",
             "propertyNames", "unevaluatedItems"}
SUBSCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
SUBSCHEMA_LISTS = {"anyOf", "oneOf", "prefixItems"}


def closed(schema: Any) -> Any:
    """The schema with every object that lists ``properties`` and says nothing about others
    closed (``additionalProperties: false``), as OpenAI's strict mode reads schemas: a small
    model otherwise invents extra keys. Every output is still valid against the schema sent.
    Left as sent where ``allOf`` combines objects (closing one branch would refuse the
    properties of the others)."""
    if not isinstance(schema, dict) or "allOf" in json.dumps(schema):
        return schema
    schema = json.loads(json.dumps(schema))  # a copy
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("properties"), dict) and not {"additionalProperties", "patternProperties",
                                                             "unevaluatedProperties"} & node.keys():
            node["additionalProperties"] = False
        for key, value in node.items():  # only where JSON Schema puts subschemas, never into a properties map
            if key in SUBSCHEMA:
                stack += value if isinstance(value, list) else [value]
            elif key in SUBSCHEMA_MAPS and isinstance(value, dict):
                stack += list(value.values())
            elif key in SUBSCHEMA_LISTS and isinstance(value, list):
                stack += value
    return schema


def _check_bytes(text: str, field: str, settings: Settings) -> None:
    size = len(text.encode("utf-8"))
    if size > settings.grammar_max_bytes:
        raise InvalidRequestError(f"{field} is {size} bytes; at most {settings.grammar_max_bytes} "
                                  "(TSERVE_GRAMMAR_MAX_BYTES)", field)


def _check_shape(schema: Any, field: str, settings: Settings) -> None:
    """Nesting depth and enum lengths, iteratively (a deep schema must not exhaust our stack)."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > settings.grammar_max_depth:
            raise InvalidRequestError(f"{field} nests deeper than {settings.grammar_max_depth} levels "
                                      "(TSERVE_GRAMMAR_MAX_DEPTH)", field)
        if isinstance(node, dict):
            for key in ("enum",):
                values = node.get(key)
                if isinstance(values, list) and len(values) > settings.grammar_max_enum:
                    raise InvalidRequestError(f"{field} has an enum of {len(values)} values; at most "
                                              f"{settings.grammar_max_enum} (TSERVE_GRAMMAR_MAX_ENUM)", field)
            stack += [(v, depth + 1) for v in node.values() if isinstance(v, (dict, list))]
        elif isinstance(node, list):
            stack += [(v, depth + 1) for v in node if isinstance(v, (dict, list))]


def _text(value: str, field: str, settings: Settings) -> str:
    _check_bytes(value, field, settings)
    if not value:
        raise InvalidRequestError(f"{field} must not be empty", field)
    return value


def _choice(values: list[str], field: str, settings: Settings) -> str:
    if not values or not all(values):
        raise InvalidRequestError(f"{field} must be a non-empty list of non-empty strings", field)
    if len(values) > settings.grammar_max_enum:
        raise InvalidRequestError(f"{field} has {len(values)} choices; at most {settings.grammar_max_enum} "
                                  "(TSERVE_GRAMMAR_MAX_ENUM)", field)
    return _text(json.dumps(values, ensure_ascii=False), field, settings)


def from_response_format(fmt: ResponseFormat | None, settings: Settings) -> Constraint | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return Constraint(GrammarSpec("json_object"), "response_format")
    field = "response_format.json_schema.schema"
    return Constraint(GrammarSpec("json_schema", schema_text(fmt.json_schema.schema_ or {}, field, settings)), field)


def from_structured_outputs(so: StructuredOutputs | None, settings: Settings) -> Constraint | None:
    if so is None:
        return None
    if so.json_ is not None:
        field = "structured_outputs.json"
        return Constraint(GrammarSpec("json_schema", schema_text(so.json_, field, settings)), field)
    if so.regex is not None:
        return Constraint(GrammarSpec("regex", _text(so.regex, "structured_outputs.regex", settings)),
                          "structured_outputs.regex")
    if so.choice is not None:
        return Constraint(GrammarSpec("choice", _choice(so.choice, "structured_outputs.choice", settings)),
                          "structured_outputs.choice")
    if so.grammar is not None:
        return Constraint(GrammarSpec("lark", _text(so.grammar, "structured_outputs.grammar", settings)),
                          "structured_outputs.grammar")
    return Constraint(GrammarSpec("json_object"), "structured_outputs.json_object")


def from_guided(body: GuidedFields, settings: Settings) -> list[Constraint]:
    found = []
    if body.guided_json is not None:
        found.append(Constraint(GrammarSpec("json_schema", schema_text(body.guided_json, "guided_json", settings)),
                                "guided_json"))
    if body.guided_regex is not None:
        found.append(Constraint(GrammarSpec("regex", _text(body.guided_regex, "guided_regex", settings)),
                                "guided_regex"))
    if body.guided_choice is not None:
        found.append(Constraint(GrammarSpec("choice", _choice(body.guided_choice, "guided_choice", settings)),
                                "guided_choice"))
    if body.guided_grammar is not None:
        found.append(Constraint(GrammarSpec("lark", _text(body.guided_grammar, "guided_grammar", settings)),
                                "guided_grammar"))
    return found


def one_constraint(*found: Constraint | list[Constraint] | None) -> Constraint | None:
    """The request's one constraint, or None; two or more are a 400 naming the second."""
    flat = [c for f in found for c in (f if isinstance(f, list) else [f]) if c is not None]
    if len(flat) > 1:
        raise InvalidRequestError(f"'{flat[0].field}' and '{flat[1].field}' both constrain the output; send one",
                                  flat[1].field)
    return flat[0] if flat else None


def request_constraint(body: Any, settings: Settings, extra: Constraint | None = None) -> Constraint | None:
    """The constraint of an OpenAI-route body (chat or completions): response_format,
    structured_outputs, guided_* and, for chat, the tool call (``extra``)."""
    return one_constraint(from_response_format(body.response_format, settings),
                          from_structured_outputs(body.structured_outputs, settings),
                          from_guided(body, settings), extra)


def from_tgi(grammar: dict | None, settings: Settings) -> Constraint | None:
    """TGI's ``parameters.grammar``: ``{"type": "json", "value": <schema>}`` or
    ``{"type": "regex", "value": <pattern>}``."""
    if grammar is None:
        return None
    kind, value = grammar.get("type"), grammar.get("value")
    field = "parameters.grammar.value"
    if kind == "json":
        return Constraint(GrammarSpec("json_schema", schema_text(value, field, settings)), field)
    if kind == "regex" and isinstance(value, str):
        return Constraint(GrammarSpec("regex", _text(value, field, settings)), field)
    raise InvalidRequestError("parameters.grammar must be {\"type\": \"json\", \"value\": <JSON schema>} or "
                              "{\"type\": \"regex\", \"value\": <string>}", "parameters.grammar")
