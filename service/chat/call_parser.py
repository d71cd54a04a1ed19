"""Tool calls read back out of a model's text, whole (``parse``) or while it streams (``CallStream``).

What counts as a call, for a model writing in ``fmt`` (``model/tokenization/tool_format.py``):
- tagged blocks (``<tool_call>{...}</tool_call>``); text before the first block is content;
- a JSON call after the format's marker, or a bare JSON call (or list of calls) that is the
  whole output, or a ```json fenced one (text before the fence is content): small models trained
  for tools often write their call this way when the grammar leaves them free (``auto``);
- a call is ``{"name": <a tool in tools>, "arguments" | "parameters": {...}}``. A call naming a
  tool not in ``tools`` is never a call: an output whose calls are all unknown stays content.
An unfinished call (cut by ``max_tokens``) stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from model.tokenization.tool_format import ToolFormat
from service.schemas.structured import FunctionCall, ToolCall

FENCE = re.compile(r"```(?:json)?[ \t]*\n?(.*?)```", re.S)
_JSON = json.JSONDecoder()


def new_call(name: str, arguments: Any, raw: str | None = None) -> ToolCall:
    text = raw if raw is not None else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=text))


def as_call(obj: Any, names: set[str]) -> ToolCall | None:
    """A call object naming a known tool, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if args is None and not ({"arguments", "parameters"} & obj.keys()):
        return None
    return new_call(obj["name"], {} if args is None else args)


def json_calls(text: str, names: set[str]) -> list[ToolCall] | None:
    """The calls when ``text`` is nothing but JSON calls (objects, or lists of them), else None.
    A call in doubled braces counts too: Qwen2.5's own template shows the call's shape as
    ``{{"name": ..., "arguments": ...}}`` (braces escaped inside a Jinja string literal, so they
    render doubled), and its models copy it."""
    calls, i, text = [], 0, text.strip()
    if text.startswith("{{") and text.endswith("}}"):
        inner = json_calls(text[1:-1], names)
        if inner:
            return inner
    while i < len(text):
        try:
            obj, end = _JSON.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        for item in obj if isinstance(obj, list) else [obj]:
            call = as_call(item, names)
            if call is None:
                return None
            calls.append(call)
        i = end
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
    return calls or None


def _strip_markers(text: str, fmt: ToolFormat) -> str:
    for marker in (fmt.open, fmt.close):
        if marker:
            text = text.replace(marker, "")
    return text


def parse(text: str, fmt: ToolFormat, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output."""
    if fmt.close and fmt.open in text:  # tagged blocks
        blocks = re.findall(re.escape(fmt.open) + r"(.*?)" + re.escape(fmt.close), text, re.S)
        calls = [c for b in blocks for c in (json_calls(b, names) or [])]
        if calls:
            head = text[: text.find(fmt.open)].strip()
            return head or None, calls
        return text, []
    bare = json_calls(_strip_markers(text, fmt), names)
    if bare:
        return None, bare
    fences = list(FENCE.finditer(text))
    if fences and not text[fences[-1].end():].strip():
        found = [json_calls(m.group(1), names) for m in fences]
        if all(found):
            head = text[: fences[0].start()].strip()
            return head or None, [c for group in found for c in group]
    return text, []


def call_key(call: ToolCall) -> tuple[str, str]:
    try:
        args = json.dumps(json.loads(call.function.arguments), sort_keys=True)
    except json.JSONDecodeError:
        args = call.function.arguments
    return call.function.name, args


def repeats(calls: list[ToolCall]) -> bool:
    """The last call repeats an earlier one, name and arguments."""
    return len(calls) > 1 and call_key(calls[-1]) in {call_key(c) for c in calls[:-1]}


def unique(calls: list[ToolCall]) -> list[ToolCall]:
    seen, out = set(), []
    for c in calls:
        if call_key(c) not in seen:
            seen.add(call_key(c))
            out.append(c)
    return out


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class CallStream:
    """Streamed text -> OpenAI deltas. Content passes through up to where a call could begin (a
    marker, a fence, or JSON at the very start), which is held back until it is decided. A tagged
    block streams as OpenAI streams a call: a first delta with the id, type and name, then the
    arguments in pieces as they are written. Calls seen only at the end (bare or fenced JSON)
    come out whole then."""

    def __init__(self, fmt: ToolFormat, names: set[str]):
        self.fmt, self.names = fmt, names
        self.text, self.sent = "", 0  # all text so far; how much of it went out as content
        self.calls: list[ToolCall] = []  # calls sent (or being sent)
        self.block_start = -1  # where the open tagged block's JSON starts
        self.args_sent, self.block_call = "", False  # of the open block: arguments sent, its call begun

    @property
    def tagged(self) -> bool:
        return bool(self.fmt.close)

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        out = []
        if self.tagged:
            out += self._blocks()
        if self.calls or self.block_start >= 0:
            return out  # after a call has begun, only calls follow
        hold = self._hold_from()
        if hold > self.sent:
            out.append({"content": self.text[self.sent: hold]})
            self.sent = hold
        return out

    def _hold_from(self) -> int:
        """The first index that could begin a call: content stops there until it is decided."""
        text, cut = self.text, len(self.text)
        head = len(text) - len(text.lstrip())
        if text[head:head + 1] in ("{", "[") or (not text.strip() and text):
            return min(cut, head)
        markers = ["```"] + ([self.fmt.open] if self.fmt.open else [])
        for marker in markers:
            at = text.find(marker, self.sent)
            if at >= 0:
                cut = min(cut, at)
            for k in range(len(marker) - 1, 0, -1):  # a marker's start at the end of the text
                if text.endswith(marker[:k]):
                    cut = min(cut, len(text) - k)
                    break
        return max(cut, self.sent)

    def _blocks(self) -> list[dict]:
        fmt, out = self.fmt, []
        while True:
            if self.block_start < 0:
                at = self.text.find(fmt.open, self.sent)
                if at < 0:
                    return out
                if at > self.sent and not self.calls:
                    out.append({"content": self.text[self.sent:at]})
                self.block_start = at + len(fmt.open)
                self.sent = self.block_start
                self.args_sent, self.block_call = "", False
            end = self.text.find(fmt.close, self.block_start)
            body = self.text[self.block_start: end if end >= 0 else len(self.text)]
            out += self._stream_arguments(body, end >= 0)
            if end < 0:
                return out
            self.block_start, self.sent = -1, end + len(fmt.close)

    def _stream_arguments(self, body: str, closed: bool) -> list[dict]:
        head = _HEAD.match(body)
        out = []
        if not self.block_call:
            if head is None:
                if not closed:
                    return []
                calls = json_calls(body, self.names) or []
                for call in calls:
                    out += self._whole(call)
                return out
            name = json.loads(f'"{head.group(1)}"')
            if name not in self.names:
                return []  # never a call; the grammar keeps required / auto blocks to the tools
            call = new_call(name, None, raw="")
            self.calls.append(call)
            self.block_call = True
            out.append({"tool_calls": [{"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                        "function": {"name": name, "arguments": ""}}]})
        if head is None:
            return out
        args = body[head.end():]
        if closed:
            args = args.rstrip()
            args = args[:-1].rstrip() if args.endswith("}") else args  # the call object's own brace
        else:  # held back: a last brace that may be the call object's own, and the close marker's start
            cut = args.rfind("}")
            if cut >= 0 and self.fmt.close.startswith(args[cut + 1:].strip()):
                args = args[:cut]
            args = args.rstrip()
        if len(args) > len(self.args_sent) and args.startswith(self.args_sent):
            piece, self.args_sent = args[len(self.args_sent):], args
            self.calls[-1].function.arguments += piece
            out.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]})
        return out

    def _whole(self, call: ToolCall) -> list[dict]:
        self.calls.append(call)
        i = len(self.calls) - 1
        return [{"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                 "function": {"name": call.function.name, "arguments": ""}}]},
                {"tool_calls": [{"index": i, "function": {"arguments": call.function.arguments}}]}]

    def finish(self) -> list[dict]:
        """What is left at the end: held text decided as calls or content."""
        if self.calls:
            return []
        content, calls = parse(self.text, self.fmt, self.names)
        out = []
        if not calls:
            rest = self.text[self.sent:]
            return [{"content": rest}] if rest else []
        head = content or ""
        if len(head) > self.sent and head.startswith(self.text[: self.sent]):
            out.append({"content": head[self.sent:]})
        for call in calls:
            out += self._whole(call)
        return out
