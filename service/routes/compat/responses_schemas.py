"""OpenAI Responses API bodies (``POST /v1/responses``), as the ``openai`` client's
``client.responses.create`` sends them: ``input`` a string or a list of items (messages with
string content or ``input_text`` / ``output_text`` parts, ``function_call`` and
``function_call_output`` items for tool round trips), ``instructions``, ``max_output_tokens``,
``text.format``, flat function ``tools``. Items keep fields they do not use (a client sends back
the ``output`` it got, ids and statuses included); unknown top-level fields are refused, as on
the other OpenAI routes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from service.schemas.common import MAX_SEED, RequestModel
from service.schemas.structured import FUNCTION_NAME


class ItemModel(RequestModel):
    model_config = ConfigDict(extra="ignore")


class InputTextPart(ItemModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(ItemModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[InputTextPart] | str

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(ItemModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str


class FunctionCallOutputItem(ItemModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: list[InputTextPart] | str

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


def _item_type(value: Any) -> Any:
    if isinstance(value, dict):
        return value.get("type", "message")  # EasyInputMessage has no type
    return getattr(value, "type", None)


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")], Discriminator(_item_type)]


class FunctionTool(RequestModel):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(RequestModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; one verbosity here


class ResponsesRequest(RequestModel):
    model: str = Field(min_length=1)
    input: list[InputItem] | str
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=4096)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = Field(None, description="accepted; nothing is stored (the response says store: false)")
    previous_response_id: str | None = Field(None, description="not supported: nothing is stored (400)")
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    truncation: Literal["disabled"] | None = Field(None, description="'auto' is not supported (400 for a long input)")
    include: list[str] | None = Field(None, max_length=0, description="no extra output to include")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="extension, as on the chat route")
