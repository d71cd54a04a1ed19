"""Tool calling: how a model is shown its tools, the grammar its calls must match, and the
calls read back out of its text (whole, or while it streams).

A call is written as Hermes / Qwen-style blocks, one per call, which is also what chat
templates that take ``tools`` teach their models::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- ``tool_choice`` ``required`` / a named function: the output is one block (or, with
  ``parallel_tool_calls``, one or more) whose JSON is constrained to the tools' parameter
  schemas (``{"name": const, "arguments": <parameters>}``, one ``anyOf`` branch per tool).
- ``auto``: the output is either text that does not start with ``<`` or call blocks as
  above; once the model starts a block, the grammar holds it to the schemas.
- ``none``: the tools are not shown and nothing is constrained.
A template whose source mentions ``tools`` renders them itself; for the others (SmolLM2's)
``GENERIC_TOOL_PROMPT`` is put in the system message. Earlier calls in the history
(assistant ``tool_calls``) are rendered as blocks, and ``role: "tool"`` results as a user
turn holding ``<tool_response>`` blocks, for both kinds of template.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from model.engine.grammar import JSON_OPTIONS
from service.chat.structured import Constraint, GrammarSpec, schema_text
from service.engines.errors import InvalidRequestError
from service.schemas.structured import FunctionCall, NamedToolChoice, Tool, ToolCall
from service.settings import Settings

CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
BLOCK = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)
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


def history(messages: list[Any]) -> list[dict[str, str]]:
    """Chat messages as the template takes them: assistant ``tool_calls`` as call blocks,
    tool results as ``<tool_response>`` user turns, ``developer`` as ``system``."""
    out = []
    for m in messages:
        if m.role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"})
            continue
        text = m.text()
        if m.role == "assistant" and m.tool_calls:
            blocks = [CALL_OPEN + json.dumps({"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                                             ensure_ascii=False) + CALL_CLOSE for c in m.tool_calls]
            text = "\n".join(([text] if text else []) + blocks)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # shown as the string the client sent


def plan(tools: list[Tool] | None, choice: str | NamedToolChoice | None, parallel: bool, messages: list[Any],
         template_takes_tools: bool, settings: Settings) -> ToolPlan:
    rendered = history(messages)
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
    schemas = [_call_schema(t, i, settings) for i, t in enumerate(tools) if t in chosen]
    one = isinstance(choice, NamedToolChoice) or not parallel
    text = _lark(schemas, one, free_text=choice == "auto")
    if len(text.encode()) > settings.grammar_max_bytes:
        raise InvalidRequestError(f"tools make a grammar of {len(text.encode())} bytes; at most "
                                  f"{settings.grammar_max_bytes} (TSERVE_GRAMMAR_MAX_BYTES)", "tools")
    specs = [t.model_dump(exclude_none=True, by_alias=True) for t in tools]
    if template_takes_tools:
        return ToolPlan(rendered, specs, Constraint(GrammarSpec("lark", text), "tools"), True, names)
    return ToolPlan(_with_system(rendered, _generic_prompt(specs)), None,
                    Constraint(GrammarSpec("lark", text), "tools"), True, names)


def _call_schema(tool: Tool, i: int, settings: Settings) -> dict:
    params = tool.function.parameters
    if params is None:
        params = NO_PARAMETERS
    else:
        params = json.loads(schema_text(params, f"tools[{i}].function.parameters", settings))
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _lark(schemas: list[dict], one: bool, free_text: bool) -> str:
    call = {"anyOf": schemas, "x-guidance": JSON_OPTIONS} if len(schemas) > 1 else {**schemas[0],
                                                                                    "x-guidance": JSON_OPTIONS}
    calls = "block" if one else 'block ("\\n" block)*'
    start = "TEXT | calls" if free_text else "calls"
    return "\n".join([f"start: {start}", f"calls: {calls}",
                      f"block: {json.dumps(CALL_OPEN)} call {json.dumps(CALL_CLOSE)}",
                      f"call: %json {json.dumps(call, ensure_ascii=False)}",
                      r"TEXT: /[^<][\s\S]*/"])


def _generic_prompt(specs: list[dict]) -> str:
    lines = "\n".join(json.dumps(s["function"], ensure_ascii=False) for s in specs)
    return GENERIC_TOOL_PROMPT.format(tools=lines)


def _with_system(messages: list[dict[str, str]], prompt: str) -> list[dict[str, str]]:
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def new_call(name: str, arguments: Any) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                    function=FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)))


def _read_block(body: str) -> ToolCall | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        return None
    return new_call(call["name"], call["arguments"])


def parse(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output: calls when it starts with a call block (text after
    the last block is dropped), else the text as content. An unfinished block (max_tokens)
    stays content."""
    if not text.lstrip().startswith(CALL_OPEN.strip()):
        return text, []
    calls = [c for c in (_read_block(m.group(1)) for m in BLOCK.finditer(text)) if c is not None]
    return (None, calls) if calls else (text, [])


class CallStream:
    """Streamed text -> OpenAI deltas: content passes through once the output is known not to
    start with a call; call blocks become ``tool_calls`` deltas as each block closes (a first
    delta with the id, type and name, then one with the arguments, as OpenAI sends them)."""

    def __init__(self):
        self.buf, self.mode, self.calls = "", None, 0

    def feed(self, text: str) -> list[dict]:
        self.buf += text
        if self.mode is None:
            head, marker = self.buf.lstrip(), CALL_OPEN.strip()
            if len(head) < len(marker) and marker.startswith(head):
                return []  # could still become a call
            self.mode = "calls" if head.startswith(marker) else "text"
        if self.mode == "text":
            out, self.buf = ([{"content": self.buf}] if self.buf else []), ""
            return out
        out = []
        while (end := self.buf.find(CALL_CLOSE)) != -1:
            start = self.buf.find(CALL_OPEN)
            call = _read_block(self.buf[start + len(CALL_OPEN): end]) if start != -1 else None
            self.buf = self.buf[end + len(CALL_CLOSE):]
            if call is not None:
                out += [{"tool_calls": [{"index": self.calls, "id": call.id, "type": "function",
                                         "function": {"name": call.function.name, "arguments": ""}}]},
                        {"tool_calls": [{"index": self.calls, "function": {"arguments": call.function.arguments}}]}]
                self.calls += 1
        return out

    def finish(self) -> list[dict]:
        """What is left at the end: text never decided, or an unfinished call (as content)."""
        rest, self.buf = self.buf, ""
        if self.mode == "calls" and self.calls and not rest.strip():
            return []
        return [{"content": rest}] if rest and (self.mode != "calls" or not self.calls) else []
