"""OpenAI chat-completions bodies (``POST /v1/chat/completions``).

Field names and shapes follow OpenAI's API so the official client and LangChain's
``ChatOpenAI`` work unmodified. Structured outputs and tools (``service/schemas/structured.py``)
are served by constrained decoding; what a text-only model cannot do (images, audio, legacy
``functions``, ``logit_bias``) is refused with a 400 naming the field, never silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.engines.generative import MAX_TOP_LOGPROBS
from service.schemas.common import MAX_SEED, UNSET_SAMPLING, KeepAlive, RequestModel, StopStrings, Usage
from service.schemas.openai import StreamOptions
from service.schemas.structured import (
    GuidedFields,
    MessageToolCall,
    ResponseFormat,
    StructuredOutputs,
    Tool,
    ToolCall,
    ToolChoice,
)


class TextPart(RequestModel):
    type: str
    text: str | None = None

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _text_only(self) -> TextPart:
        if self.type != "text":
            raise ValueError(f"content parts of type '{self.type}' are not supported; this server's models read "
                             "text only (use parts of type 'text')")
        if self.text is None:
            raise ValueError("a content part of type 'text' needs a 'text' field")
        return self


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this result answers
    # OpenAI's other message fields: known, so refused by name when set (no audio, no legacy functions)
    function_call: Any = None
    audio: Any = None
    refusal: Any = None

    @model_validator(mode="after")
    def _plain(self) -> ChatMessage:
        for unsupported in ("function_call", "audio", "refusal"):
            if getattr(self, unsupported, None) is not None:  # the schema's type is null: {} or "" too
                raise ValueError(f"'{unsupported}' in messages is not supported (no audio or legacy function support)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry 'tool_calls'")
        if self.content is None and not self.tool_calls:
            raise ValueError("every message needs 'content' (an assistant message may have 'tool_calls' instead)")
        return self

    @field_validator("content")
    @classmethod
    def _not_blank(cls, value, info):
        """Blank texts are refused, as for every text input; only an assistant turn (an earlier
        reply, possibly empty) may have empty content."""
        text = value if isinstance(value, str) else "".join(p.text or "" for p in value or [])
        if value is not None and not text.strip() and info.data.get("role") != "assistant":
            raise ValueError("must not be empty or blank (only an assistant message may have empty content)")
        return value

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content or [])


class ChatCompletionRequest(StopStrings, GuidedFields, KeepAlive):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=4096)
    max_completion_tokens: int | None = Field(None, ge=1, le=4096)
    temperature: float | None = Field(None, ge=0.0, le=2.0, description=UNSET_SAMPLING)
    top_p: float | None = Field(None, gt=0.0, le=1.0, description=UNSET_SAMPLING)
    n: int = Field(1, ge=1, le=8)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    user: str | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # refused: legacy functions, audio; logit_bias is not implemented
    functions: list[dict[str, Any]] | None = None  # OpenAI's legacy function definitions: objects
    function_call: Any = None
    logit_bias: dict[str, float] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    # extensions (vLLM accepts the same names)
    top_k: int | None = Field(None, ge=0, le=100_000, description=UNSET_SAMPLING)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0, description=UNSET_SAMPLING)

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "What is the capital of France?"}],
         "max_tokens": 64, "temperature": 0},
        {"model": "smollm2-135m-instruct", "stream": True, "messages": [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three primary colours."}]},
    ]})

    @field_validator("functions", "audio")
    @classmethod
    def _no_functions(cls, value, info):
        if value:
            raise ValueError(f"'{info.field_name}' is not supported (use 'tools'; no audio support)")
        return value

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, value, info):
        if value not in (None, "none"):
            raise ValueError(f"'{info.field_name}' is not supported (use 'tool_choice')")
        return value

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, value):
        if value not in (None, ["text"]):
            raise ValueError("only the 'text' modality is supported")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value):
        if value:
            raise ValueError("'logit_bias' is not supported")
        return value

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value, info):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("'top_logprobs' needs 'logprobs': true")
        return value

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TopLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class LogprobEntry(TopLogprobEntry):
    top_logprobs: list[TopLogprobEntry]


class ChoiceLogprobs(BaseModel):
    content: list[LogprobEntry] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"] | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
