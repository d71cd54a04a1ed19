"""One chat turn, whichever API asked for it: OpenAI chat, Anthropic Messages, OpenAI Responses.

Each of those doors turns its own body into the same inputs (chat messages, tools in OpenAI's
shape, a tool choice, the output format it constrains) and calls ``chat_turn``, which makes of them

- the prompt ids: the tools planned (``tool_calls.plan``), the conversation rendered by the
  model's own template;
- the one constraint on the output: the door's format or the tools' grammar, never both (a 400);
- how the output is read back: tool-call blocks parsed out of it, or plain text.

The door then sends the turn (``ChatTurn.submit``: the grammar compiled off the engine thread)
and reads its output through the turn (``parse`` whole, ``deltas`` streamed), shaping both
into its own response or events. The checks run in one order for every door (the tools, then
the format, then the template), so a request wrong in two ways gets the same error through each.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from model.tokenization.tool_format import GENERIC, ToolFormat
from service.chat import call_parser, tool_calls
from service.chat.structured import Constraint, one_constraint
from service.engines.generative import EngineEvent, GenerativeEngine, RequestStream, SamplingParams
from service.schemas.structured import NamedToolChoice, Tool, ToolCall
from service.settings import Settings


@dataclass(frozen=True)
class ChatTurn:
    engine: GenerativeEngine
    prompt: list[int]  # the conversation, as the model's template renders it
    constraint: Constraint | None  # the one grammar the output follows
    parse_calls: bool  # the output may hold tool-call blocks: read them out
    fmt: ToolFormat = GENERIC  # how the model writes calls
    names: frozenset[str] = frozenset()  # the tools a call may name

    def max_tokens(self, asked: int | None) -> int:
        """What the door asked for, or else all the room the prompt leaves."""
        return asked if asked is not None else max(1, self.engine.max_len - len(self.prompt))

    async def submit(self, params: Sequence[SamplingParams], prompt_field: str, limit_field: str,
                     group_field: str | None = None) -> list[RequestStream]:
        """One request per ``params`` (choices), all following the constraint; errors name the
        door's own fields."""
        c = self.constraint
        streams = await self.engine.submit_constrained(
            [(self.prompt, p, prompt_field) for p in params], c.spec if c else None, c.field if c else "",
            group_field=group_field or prompt_field, limit_field=limit_field)
        return [RepeatGuard(s, self.fmt, self.names) for s in streams] if self.parse_calls else streams

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output."""
        if not self.parse_calls:
            return text, []
        content, calls = call_parser.parse(text, self.fmt, set(self.names))
        return content, call_parser.unique(calls)

    def deltas(self) -> OutputDeltas:
        """A reader for one streamed output (one per choice)."""
        return OutputDeltas(call_parser.CallStream(self.fmt, set(self.names)) if self.parse_calls else None)


class RepeatGuard:
    """A request's events, ended where the model repeats a call it has made (name and
    arguments): a small model given room for parallel calls may write the same one until
    ``max_tokens``. The repeat is cut off, the request aborted, and the turn ends (``stop``).
    A second or later call block is held until it closes (so a repeat never reaches the
    client); the first streams as it is written."""

    def __init__(self, stream: RequestStream, fmt: ToolFormat, names: frozenset[str]):
        self.stream, self.request_id = stream, stream.request_id
        self.fmt, self.names, self.done = fmt, set(names), False
        self.text, self.out = "", 0  # all text so far; how much of it went on

    def __aiter__(self) -> RepeatGuard:
        return self

    async def __anext__(self) -> EngineEvent:
        if self.done:
            raise StopAsyncIteration
        event = await self.stream.__anext__()
        self.done = event.finished
        if event.error or not self.fmt.close:
            return event
        self.text += event.text
        limit, repeat = self._limit()
        if repeat:
            self.stream.abort()
            self.done = True
            event = dataclasses.replace(event, finish_reason="stop", error=None)
        elif event.finished:
            limit = len(self.text)
        piece, self.out = self.text[self.out:max(limit, self.out)], max(limit, self.out)
        return dataclasses.replace(event, text=piece)

    def _limit(self) -> tuple[int, bool]:
        """How far the text may go on, and whether a repeated call ends it there."""
        fmt, seen, at, closed = self.fmt, set(), 0, 0
        while (start := self.text.find(fmt.open, at)) >= 0:
            end = self.text.find(fmt.close, start)
            if end < 0:
                return (len(self.text[:start].rstrip()) if closed else len(self.text)), False
            calls = call_parser.json_calls(self.text[start + len(fmt.open): end], self.names) or []
            keys = {call_parser.call_key(c) for c in calls}
            if keys and keys <= seen:
                return len(self.text[:start].rstrip()), True
            seen |= keys
            closed += 1
            at = end + len(fmt.close)
        return (at if closed else len(self.text)), False  # after a call, what follows waits for its block

    def abort(self) -> None:
        self.done = True
        self.stream.abort()


class OutputDeltas:
    """One streamed output as OpenAI-style deltas: ``{"content": text}`` or, where the turn reads
    calls, ``{"tool_calls": [...]}`` pieces as the calls are written."""

    def __init__(self, calls: call_parser.CallStream | None):
        self._calls = calls

    def feed(self, text: str, finished: bool) -> list[dict]:
        if self._calls is None:
            return [{"content": text}] if text else []
        return self._calls.feed(text) + (self._calls.finish() if finished else [])

    @property
    def called(self) -> bool:
        """At least one tool call came out."""
        return self._calls is not None and bool(self._calls.calls)


def chat_turn(engine: GenerativeEngine, settings: Settings, messages: list[Any], tools: list[Tool] | None = None,
              tool_choice: str | NamedToolChoice | None = None, parallel_tool_calls: bool = True,
              output_format: Callable[[], Constraint | None] | None = None, continue_final: bool = False) -> ChatTurn:
    """The turn of a conversation. ``messages``: chat messages (``role``, ``text()``,
    ``tool_calls``); ``output_format``: the door's own format constraint, read after the tools
    are checked (see the module docstring); ``continue_final``: a final assistant message is a
    prefill to continue (Anthropic's)."""
    fmt = engine.tool_format
    plan = tool_calls.plan(tools, tool_choice, parallel_tool_calls, messages, engine.template_takes_tools, settings,
                           fmt)
    constraint = one_constraint(output_format() if output_format else None, plan.constraint)
    prompt = engine.chat_prompt(plan.messages, plan.template_tools, continue_final=continue_final)
    return ChatTurn(engine, prompt, constraint, plan.parse_calls, fmt, frozenset(plan.names))
