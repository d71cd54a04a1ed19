"""Tool calling: how a model is shown its tools, the grammar its calls must match, and the
calls read back out of its text (``service/chat/call_parser.py``).

A model writes calls in its family's format (``model/tokenization/tool_format.py``: Hermes /
Qwen ``<tool_call>`` blocks, Llama 3's bare JSON, Mistral's ``[TOOL_CALLS]`` list, or the generic
prompt's blocks as text). Where the vocabulary holds a marker as one special token, the grammar
asks for that token (llguidance's ``<[id]>``), as the model was trained to write it.

- ``tool_choice`` ``required`` / a named function: the output is calls only, each one's JSON
  constrained to the tools' parameter schemas (``{"name": const, "arguments": <parameters>}``,
  one ``anyOf`` branch per tool); with ``parallel_tool_calls`` at most ``MAX_CALLS`` of them.
- ``auto``: text that does not begin with a call's marker, or calls as above; a model that
  writes its call as plain (or fenced) JSON in text is still read as calling.
- ``none``: the tools are not shown and nothing is constrained.
A template whose source mentions ``tools`` renders them itself; for the others (SmolLM2's)
``GENERIC_TOOL_PROMPT`` is put in the system message. Earlier calls in the history
(assistant ``tool_calls``) are rendered in the model's format, and ``role: "tool"`` results as
a user turn holding ``<tool_response>`` blocks (Mistral: ``[TOOL_RESULTS]``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from model.engine.grammar import JSON_OPTIONS
from model.tokenization.tool_format import GENERIC, ToolFormat
from service.chat.call_parser import new_call, parse
from service.chat.structured import Constraint, GrammarSpec, schema_text
from service.engines.errors import InvalidRequestError
from service.schemas.structured import NamedToolChoice, Tool
from service.settings import Settings

__all__ = ["GENERIC_TOOL_PROMPT", "ToolPlan", "history", "new_call", "parse", "plan"]

MAX_CALLS = 8  # parallel calls in one turn: the grammar ends the list there
GENERIC_TOOL_PROMPT = """You can call functions. Here they are, one JSON object each (name, description, \
parameters as a JSON Schema):
{tools}
To call a function, reply with only this, one block per call:
<tool_call>
{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}
</tool_call>
To answer without a function, reply in plain text."""
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ToolPlan:
    """What a chat request with tools turns into: the messages (and tools) for the template, the
    constraint on the output, and whether to read calls out of it."""

    messages: list[dict[str, str]]
    template_tools: list[dict] | None = None
    constraint: Constraint | None = None
    parse_calls: bool = False
    names: list[str] = field(default_factory=list)


def history(messages: list[Any], fmt: ToolFormat = GENERIC) -> list[dict[str, str]]:
    """Chat messages as the template takes them: assistant ``tool_calls`` written as the model
    writes calls, tool results as user turns, ``developer`` as ``system``."""
    out = []
    for m in messages:
        if m.role == "tool":
            result = (f"[TOOL_RESULTS] {m.text()}[/TOOL_RESULTS]" if fmt.name == "mistral"
                      else f"<tool_response>\n{m.text()}\n</tool_response>")
            out.append({"role": "user", "content": result})
            continue
        text = m.text()
        if m.role == "assistant" and m.tool_calls:
            calls = [json.dumps({"name": c.function.name, fmt.arguments_key: _arguments(c.function.arguments)},
                                ensure_ascii=False) for c in m.tool_calls]
            blocks = [fmt.block("[" + ", ".join(calls) + "]")] if fmt.as_list else [fmt.block(c) for c in calls]
            text = fmt.separator.join(([text] if text else []) + blocks)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # shown as the string the client sent


def plan(tools: list[Tool] | None, choice: str | NamedToolChoice | None, parallel: bool, messages: list[Any],
         template_takes_tools: bool, settings: Settings, fmt: ToolFormat = GENERIC) -> ToolPlan:
    rendered = history(messages, fmt)
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs 'tools'", "tool_choice")
        return ToolPlan(rendered)
    if len(tools) > settings.max_tools:
        raise InvalidRequestError(f"tools has {len(tools)} functions; at most {settings.max_tools} "
                                  "(TSERVE_MAX_TOOLS)", "tools")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools: function names must be unique", "tools")
    choice = choice or "auto"
    if choice == "none":
        return ToolPlan(rendered)
    chosen = tools
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise InvalidRequestError(f"tool_choice names '{choice.function.name}', which is not in tools",
                                      "tool_choice")
    schemas = [_call_schema(t, i, fmt, settings) for i, t in enumerate(tools) if t in chosen]
    one = isinstance(choice, NamedToolChoice) or not parallel or not fmt.parallel
    text = grammar(fmt, schemas, one, free_text=choice == "auto")
    if len(text.encode()) > settings.grammar_max_bytes:
        raise InvalidRequestError(f"tools make a grammar of {len(text.encode())} bytes; at most "
                                  f"{settings.grammar_max_bytes} (TSERVE_GRAMMAR_MAX_BYTES)", "tools")
    specs = [t.model_dump(exclude_none=True, by_alias=True) for t in tools]
    constraint = Constraint(GrammarSpec("lark", text), "tools")
    # auto: what the model writes is read whatever the tool; only a listed tool becomes a call
    if template_takes_tools:
        return ToolPlan(rendered, specs, constraint, True, [t.function.name for t in chosen])
    return ToolPlan(_with_system(rendered, _generic_prompt(specs)), None, constraint, True,
                    [t.function.name for t in chosen])


def _call_schema(tool: Tool, i: int, fmt: ToolFormat, settings: Settings) -> dict:
    params = tool.function.parameters
    if params is None:
        params = NO_PARAMETERS
    else:
        params = json.loads(schema_text(params, f"tools[{i}].function.parameters", settings))
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, fmt.arguments_key: params},
            "required": ["name", fmt.arguments_key], "additionalProperties": False}


def _marker(text: str, token_id: int | None) -> str:
    """A Lark item for a call marker: the special token by id where the vocabulary has one."""
    return f"<[{token_id}]>" if token_id is not None else json.dumps(text)


def grammar(fmt: ToolFormat, schemas: list[dict], one: bool, free_text: bool) -> str:
    """The Lark grammar of a turn's calls in ``fmt`` (``free_text``: or text that does not open one)."""
    call = {"anyOf": schemas, "x-guidance": JSON_OPTIONS} if len(schemas) > 1 else {**schemas[0],
                                                                                    "x-guidance": JSON_OPTIONS}
    opener = _marker(fmt.open, fmt.open_id) if fmt.open else ""
    if fmt.optional_open and opener:
        opener = f"({opener})?"
    after = f" {json.dumps(fmt.open_after)}" if fmt.open_after else ""
    closer = (f"{json.dumps(fmt.close_before)} " if fmt.close_before else "") + (
        _marker(fmt.close, fmt.close_id) if fmt.close else "")
    more = "" if one else " " + " ".join(f'({json.dumps(fmt.separator)} call' for _ in range(MAX_CALLS - 1)) + \
        ")?" * (MAX_CALLS - 1)
    if fmt.as_list:
        rules = [f'calls: {opener}{after} "[" call{more} "]"']
    else:
        more = "" if one else " " + " ".join(f'({json.dumps(fmt.separator)} block' for _ in range(MAX_CALLS - 1)) + \
            ")?" * (MAX_CALLS - 1)
        # the separator may also end the turn: a model that writes it after its last block (Qwen2.5
        # does, after the closing token) and then wants to stop must not be held to another block
        trail = f" {json.dumps(fmt.separator)}?" if fmt.separator.strip() == "" else ""
        rules = [f"calls: block{more}{trail}", f"block: {opener}{after} call {closer}"]
    if free_text:
        # text may not begin as a call does: a marker written as text, or JSON where calls are bare
        first = "{" if not fmt.open or fmt.optional_open else (fmt.open[0] if fmt.open_id is None else "")
        text = rf"/[^{_class(first)}][\s\S]*/" if first else r"/[\s\S]+/"
        # a special token cannot be part of TEXT, so text may come before calls that open with one
        start = "start: TEXT | calls" if first else "start: TEXT | TEXT? calls"
        rules = [start, *rules, f"TEXT: {text}"]
    else:
        rules = ["start: calls", *rules]
    return "\n".join([*rules, f"call: %json {json.dumps(call, ensure_ascii=False)}"])


def _class(chars: str) -> str:
    return "".join("\\" + c if c in "[]\\^-/" else c for c in chars)


def _generic_prompt(specs: list[dict]) -> str:
    lines = "\n".join(json.dumps(s["function"], ensure_ascii=False) for s in specs)
    return GENERIC_TOOL_PROMPT.format(tools=lines)


def _with_system(messages: list[dict[str, str]], prompt: str) -> list[dict[str, str]]:
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
