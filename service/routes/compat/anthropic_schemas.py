"""Anthropic Messages API bodies (``POST /v1/messages``, ``/v1/messages/count_tokens``), as
Anthropic documents them: text, ``tool_use`` and ``tool_result`` content blocks, tools with an
``input_schema``, ``tool_choice`` ``{"type": "auto" | "any" | "tool" | "none"}``. Unknown fields
are refused as Anthropic refuses them; blocks this server's text models cannot read (images,
documents, thinking) are refused by their ``type``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from service.engines.generative import MAX_STOP_STRINGS
from service.schemas.common import RequestModel
from service.schemas.structured import FUNCTION_NAME


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # accepted; there is no prompt caching to steer
    # Anthropic's citations are objects (a cited range of a document); typed so, not `Any`, so a
    # fuzzer can also write a wrong one (schemathesis cannot negate an array of anything)
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(RequestModel):
    """An assistant's earlier tool call, sent back in the history."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(pattern=FUNCTION_NAME)
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(RequestModel):
    """The result of a tool call, in a user message."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: list[TextBlock] | str = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        return f"Error: {body}" if self.is_error else body


def _block_type(value: Any) -> Any:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


# chosen by "type" (a callable discriminator: the strict base model's validators rule out the plain one)
Block = Annotated[Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
                  | Annotated[ToolResultBlock, Tag("tool_result")], Discriminator(_block_type)]


class MessageParam(RequestModel):
    role: Literal["user", "assistant"]
    content: list[Block] | str  # the list first: its errors (a block's type) are the ones worth naming

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> MessageParam:
        if isinstance(self.content, list):
            kinds = {b.type for b in self.content}
            if self.role == "user" and "tool_use" in kinds:
                raise ValueError("tool_use blocks belong in assistant messages")
            if self.role == "assistant" and "tool_result" in kinds:
                raise ValueError("tool_result blocks belong in user messages")
        return self


class ToolParam(RequestModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoiceParam(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_for_tool(self) -> ToolChoiceParam:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs a 'name'")
        return self


class CountTokensRequest(RequestModel):
    model: str = Field(min_length=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: list[TextBlock] | str | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None

    def system_text(self) -> str:
        if self.system is None:
            return ""
        return self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=4096, description="required, as Anthropic requires it")
    # absent: the model's default (GET /v1/models: sampling_defaults), else Anthropic's (1, no limits)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=100_000)
    stop_sequences: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list,
                                                                      max_length=MAX_STOP_STRINGS)
    stream: bool = False
    metadata: dict[str, Any] | None = None  # user_id: accepted, not used
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here
