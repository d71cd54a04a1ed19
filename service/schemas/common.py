"""Request and response bodies of our own endpoints (/v1/generate, /v1/translate, /v1/fill-mask).

Static limits live in the ``Field`` constraints, so a violation's message names the field
and the bound. Limits that depend on the model or on settings (prompt + max_tokens, text
length, list sizes) are checked by the routes and the engine.
OpenAI-shaped bodies are in ``service.schemas.openai``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, get_args

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator

from service.engines.generative import MAX_STOP_STRINGS, MAX_TOP_LOGPROBS
from service.units import DURATION_PATTERN, parse_duration

UNSET_SAMPLING = ("absent or null: the model's default (GET /v1/models: sampling_defaults; "
                  "TSERVE_GENERATION_CONFIG), else the API's (temperature 1, top_p 1, top_k 0, "
                  "repetition_penalty 1)")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


# A text that is not blank, as the server decides it (``str.strip``: Python's whitespace), written
# out so that a JSON Schema validator in any regex dialect agrees (ECMA's \S differs from Python's).
NOT_BLANK = r"[^\t\n\v\f\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"

# The largest integer every JSON parser reads exactly (IEEE doubles: JavaScript, jsonschema validators).
MAX_SEED = 2**53 - 1

_SURROGATE = re.compile("[\ud800-\udfff]")


def invalid_unicode(value: Any) -> str | None:
    """The first lone UTF-16 surrogate in a str (or in the strs of a list or dict), escaped so
    that it can be printed and encoded (``\\ud83d``); None when every character is a Unicode
    scalar value. JSON's ``"\\ud83d"`` escape decodes to such a character, which no UTF-8
    encoder (tokenizer, response, log) accepts. Iterative: a body nested hundreds of levels deep
    (a hostile JSON Schema) must reach the validators that name its depth limit, not exhaust the stack."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            found = None if node.isascii() else _SURROGATE.search(node)
            if found:
                return found.group().encode("utf-8", "backslashreplace").decode()
        elif isinstance(node, list | tuple):
            stack += reversed(node)
        elif isinstance(node, dict):
            stack += reversed([*node.values()])
            stack += reversed([*node])
    return None


def _wants_int(annotation: Any) -> bool:
    """An int field (or list of ints) that takes no float: ``int | None``, ``list[list[int]]``."""
    found: set[Any] = set()
    stack = [annotation]
    while stack:
        t = stack.pop()
        found.add(t)
        stack += get_args(t)
    return int in found and float not in found


def _as_ints(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_as_ints(v) for v in value]
    return value


def printable(text: str) -> str:
    """Client text safe to echo in a message: lone surrogates escaped (``\\ud83d``)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class RequestModel(BaseModel):
    """The base of every request body.

    Strict JSON types, as OpenAI's API: ``"5"`` is not an integer, ``false`` is not 0, ``0`` is
    not ``false`` (a float field still takes an integer, ``1`` for ``1.0``); numbers must be
    finite; every text must be valid Unicode (no lone surrogates); a field the endpoint does not
    know is refused, as OpenAI refuses it ("Unrecognized request argument supplied"), not silently
    ignored. A violation is a 400 naming the field.
    """

    model_config = ConfigDict(strict=True, allow_inf_nan=False, populate_by_name=True, extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _integral_floats(cls, value: Any, info: ValidationInfo) -> Any:
        """JSON Schema counts ``5.0`` as an integer, so the schema's integers take it (never
        ``"5"``, never ``true``)."""
        field = cls.model_fields.get(info.field_name or "")
        return _as_ints(value) if field is not None and _wants_int(field.annotation) else value

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        bad = invalid_unicode(value)
        if bad:
            raise ValueError(f"must be valid Unicode text; it contains the lone surrogate {bad}")
        return value


def normalise_stop(value: Any) -> Any:
    """``stop`` may be one string or a list (or null): always a list for the type check."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ValueError("must be a string, a list of strings, or null")
    return value


def check_stop(stops: list[str]) -> list[str]:
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    if any(not s for s in stops):
        raise ValueError("stop strings must not be empty")
    return stops


class KeepAlive(RequestModel):
    """Ollama's ``keep_alive`` as an extension field: how long the model stays loaded after this
    request, in seconds or a duration (``"5m"``, ``"1h"``); negative = until unloaded, 0 = unload
    once the request is done. Parsed to seconds (-1 for forever); absent: TSERVE_KEEP_ALIVE."""

    # the pattern is checked here with Python's re, as a schema-driven client's generator reads it
    # (its ``$`` also matches before a final newline, which the duration parser strips)
    keep_alive: float | Annotated[str, WithJsonSchema({"type": "string", "pattern": DURATION_PATTERN})] | None = Field(
        None, description="seconds or a duration ('30s', '5m', '1h30m'); negative = forever, 0 = unload after "
                          "this request")

    @field_validator("keep_alive")
    @classmethod
    def _keep_alive(cls, value):
        if isinstance(value, str) and not re.search(DURATION_PATTERN, value):
            raise ValueError(f"{value[:40]!r} is not a duration: use seconds (300) or a duration such as '30s', '5m', "
                             "'1h30m' (at most 9 digits a number); negative = forever")
        return None if value is None else parse_duration(value)


class StopStrings(RequestModel):
    """A ``stop`` field: one string or a list of them, always checked as a list."""

    stop: list[str] = Field(default_factory=list, description=f"up to {MAX_STOP_STRINGS} stop strings")

    @field_validator("stop", mode="before", json_schema_input_type=str | list[str] | None)
    @classmethod
    def _stop_list(cls, value):
        return normalise_stop(value)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        return check_stop(value)


class SamplingFields(StopStrings):
    """Sampling parameters shared by /v1/generate and /v1/completions."""

    max_tokens: int = Field(64, ge=1, le=4096, validation_alias=AliasChoices("max_tokens", "max_new_tokens"),
                            description="tokens to generate at most; the output also ends where the "
                            "model's context does (finish_reason length)")
    temperature: float | None = Field(None, ge=0.0, le=100.0, description="0 = greedy; " + UNSET_SAMPLING)
    top_k: int | None = Field(None, ge=0, le=100_000, description="0 = no limit; " + UNSET_SAMPLING)
    top_p: float | None = Field(None, gt=0.0, le=1.0, description=UNSET_SAMPLING)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0, description="> 1 discourages repeats (CTRL "
                                             "rule); " + UNSET_SAMPLING)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="same seed + same request = same output")
    ignore_eos: bool = False



class GenerateRequest(SamplingFields, KeepAlive):
    model: str | None = Field(None, description="a loaded decoder model; default: the first one")
    prompt: str = Field(..., min_length=1)
    stream: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS,
                                 description="return each token's logprob and this many alternatives")

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "To be, or not to be", "max_tokens": 32, "temperature": 0.8, "top_p": 0.95, "seed": 1},
        {"prompt": "ROMEO:", "max_tokens": 64, "stream": True, "stop": ["\n\n"]},
    ]}, populate_by_name=True)


class TopLogprob(BaseModel):
    token: str
    token_id: int
    logprob: float


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] | None = None  # most likely first


class GenerateResponse(BaseModel):
    id: str
    object: Literal["text_generation"] = "text_generation"
    created: int
    model: str
    text: str
    finish_reason: Literal["stop", "length", "eos"]
    usage: Usage
    logprobs: list[TokenLogprob] | None = None


class TranslateRequest(KeepAlive):
    model: str | None = Field(None, description="a loaded encoder-decoder model; default: the first one")
    text: str | list[str] = Field(..., description="one text or a list of texts")
    beam_size: int = Field(4, ge=1, le=16, description="1 = greedy/sampled decoding")
    length_penalty: float = Field(1.0, ge=0.0, le=5.0, description="beam score = logprob / length^penalty")
    max_tokens: int = Field(128, ge=1, le=1024, validation_alias=AliasChoices("max_tokens", "max_new_tokens"))
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="with beam_size 1: 0 = greedy")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = Field(False, description="SSE; needs a single text (beam search sends one final chunk)")

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"text": "Open the file", "beam_size": 4},
        {"text": ["Save the document", "Close the window"], "beam_size": 1, "max_tokens": 64},
    ]}, populate_by_name=True)


class Translation(BaseModel):
    text: str
    finish_reason: Literal["stop", "length", "eos"]
    tokens: int
    placeholders_ok: bool = Field(description="the translation has the source's format placeholders (%s, {0}, "
                                  "%(name)s, $1, ...), each as often; false: check it before use")


class TranslateResponse(BaseModel):
    id: str
    object: Literal["translation"] = "translation"
    created: int
    model: str
    translations: list[Translation]
    usage: Usage


class FillMaskRequest(KeepAlive):
    model: str | None = Field(None, description="a loaded encoder model; default: the first one")
    text: str | list[str] = Field(..., validation_alias=AliasChoices("text", "inputs"),
                                  description="text(s) containing the model's mask token, e.g. [MASK]")
    top_k: int = Field(5, ge=1, le=100)

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"text": "The [MASK] of the river was calm."},
        {"text": ["Call the [MASK] function.", "A [MASK] day in [MASK]."], "top_k": 3},
    ]}, populate_by_name=True)


class FillMaskCandidate(BaseModel):
    score: float
    token: int
    token_str: str
    sequence: str


# HF shape: one text with one mask -> [candidates]; several masks -> [[...] per mask];
# a list of texts -> one of those per text (texts may differ in their number of masks).
FillMaskPerText = list[FillMaskCandidate] | list[list[FillMaskCandidate]]
FillMaskResponse = FillMaskPerText | list[FillMaskPerText]


class TranslatePoOptions(BaseModel):
    """Options of POST /v1/translate/po: query parameters, or form fields beside ``file``."""

    model: str | None = Field(None, description="a loaded encoder-decoder model; default: the first one")
    include_fuzzy: bool = Field(False, description="also retranslate entries already flagged fuzzy")
    beam_size: int = Field(4, ge=1, le=16, description="beam search width; 1 = greedy")
    max_tokens: int = Field(128, ge=1, le=1024, description="tokens to generate per text at most")
    max_entries: int | None = Field(None, ge=1, description="translate at most this many entries (in file "
                                    "order); send the returned file again for the rest")

    model_config = ConfigDict(extra="ignore")
