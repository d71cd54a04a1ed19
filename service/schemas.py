"""Request and response bodies of our own endpoints (/v1/generate, /v1/translate, /v1/fill-mask).

Static limits live in the ``Field`` constraints, so a violation's message names the field
and the bound. Limits that depend on the model or on settings (prompt + max_tokens, text
length, list sizes) are checked by the routes and the engine.
OpenAI-shaped bodies are in ``service.openai_schemas``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

from service.engine import MAX_STOP_STRINGS, MAX_TOP_LOGPROBS


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


def normalise_stop(value: str | list[str] | None) -> list[str]:
    stops = [value] if isinstance(value, str) else list(value or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    if any(not s for s in stops):
        raise ValueError("stop strings must not be empty")
    return stops


class SamplingFields(BaseModel):
    """Sampling parameters shared by /v1/generate and /v1/completions."""

    model_config = ConfigDict(populate_by_name=True)

    max_tokens: int = Field(64, ge=1, le=4096, validation_alias=AliasChoices("max_tokens", "max_new_tokens"),
                            description="tokens to generate; prompt + max_tokens must fit the model")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 = greedy")
    top_k: int = Field(0, ge=0, le=100_000, description="0 = no limit")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="> 1 discourages repeats (CTRL rule)")
    stop: list[str] = Field(default_factory=list, description=f"up to {MAX_STOP_STRINGS} stop strings")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="same seed + same request = same output")
    ignore_eos: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value):
        return normalise_stop(value)


class GenerateRequest(SamplingFields):
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


class TranslateRequest(BaseModel):
    model: str | None = Field(None, description="a loaded encoder-decoder model; default: the first one")
    text: str | list[str] = Field(..., description="one text or a list of texts")
    beam_size: int = Field(4, ge=1, le=16, description="1 = greedy/sampled decoding")
    length_penalty: float = Field(1.0, ge=0.0, le=5.0, description="beam score = logprob / length^penalty")
    max_tokens: int = Field(128, ge=1, le=1024, validation_alias=AliasChoices("max_tokens", "max_new_tokens"))
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="with beam_size 1: 0 = greedy")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = Field(False, description="SSE; needs a single text (beam search sends one final chunk)")

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"text": "Open the file", "beam_size": 4},
        {"text": ["Save the document", "Close the window"], "beam_size": 1, "max_tokens": 64},
    ]}, populate_by_name=True)


class Translation(BaseModel):
    text: str
    finish_reason: Literal["stop", "length", "eos"]
    tokens: int


class TranslateResponse(BaseModel):
    id: str
    object: Literal["translation"] = "translation"
    created: int
    model: str
    translations: list[Translation]
    usage: Usage


class FillMaskRequest(BaseModel):
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
