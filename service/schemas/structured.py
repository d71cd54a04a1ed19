"""Request fields for structured outputs and tool calling, shared by the OpenAI routes.

- OpenAI: ``response_format`` (``text`` | ``json_object`` | ``json_schema`` with
  ``{name, description, schema, strict}``), ``tools`` (functions), ``tool_choice``
  (``none`` | ``auto`` | ``required`` | ``{"type": "function", "function": {"name"}}``),
  ``parallel_tool_calls``.
- vLLM (the shape of its current ``structured_outputs`` object: one of ``json``, ``regex``,
  ``choice``, ``grammar``, ``json_object``), and its older top-level ``guided_json``,
  ``guided_regex``, ``guided_choice``, ``guided_grammar``.
What each becomes is decided in ``service/chat/structured.py``; here only the shapes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.schemas.common import RequestModel

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class JsonSchemaFormat(RequestModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid")


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> ResponseFormat:  # with another type, json_schema is ignored
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs a 'json_schema' object")
        return self


class StructuredOutputs(RequestModel):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [n for n in ("json_", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of 'json', 'regex', 'choice', 'grammar', "
                             f"'json_object'; got {len(given)}")
        return self


class GuidedFields(RequestModel):
    """vLLM's older top-level fields (still accepted by vLLM; ``structured_outputs`` is newer)."""

    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid")


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition

    model_config = ConfigDict(extra="forbid")


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class MessageToolCall(RequestModel):
    """A tool call in an assistant message of the history (the client sends back what it got)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
