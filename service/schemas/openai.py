"""OpenAI-compatible bodies: /v1/completions, /v1/embeddings, /v1/models.

Field names, defaults and response shapes follow the OpenAI API so the official client
works unmodified. Parameters we do not implement are rejected with a clear 400 rather
than silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.schemas.common import MAX_SEED, UNSET_SAMPLING, KeepAlive, RequestModel, StopStrings, Usage
from service.schemas.structured import GuidedFields, ResponseFormat, StructuredOutputs


class StreamOptions(RequestModel):
    include_usage: bool = False


class CompletionRequest(StopStrings, GuidedFields, KeepAlive):
    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=4096)
    temperature: float | None = Field(None, ge=0.0, le=2.0, description=UNSET_SAMPLING)
    top_p: float | None = Field(None, gt=0.0, le=1.0, description=UNSET_SAMPLING)
    n: int = Field(1, ge=1, le=8)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    best_of: int | None = Field(None, ge=1, le=8)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    suffix: str | None = None
    user: str | None = None
    # extensions (vLLM accepts the same names)
    top_k: int | None = Field(None, ge=0, le=100_000, description=UNSET_SAMPLING)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0, description=UNSET_SAMPLING)
    ignore_eos: bool = False
    # structured outputs (docs/structured-outputs.md): OpenAI's chat field, vLLM accepts it here too
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"model": "generate-en", "prompt": "To be, or not to be", "max_tokens": 32, "temperature": 0.7},
        {"model": "generate-en", "prompt": "HAMLET:", "max_tokens": 48, "stream": True, "stop": ["\n\n"],
         "logprobs": 2, "seed": 7},
    ]})

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.best_of not in (None, self.n):
            raise ValueError("best_of must equal n (server-side best-of is not supported)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.suffix:
            raise ValueError("suffix (insertion) is not supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        return self


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class EmbeddingRequest(KeepAlive):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"model": "fill-mask-en", "input": "The quick brown fox"},
        {"model": "fill-mask-en", "input": ["first sentence", "second sentence"], "encoding_format": "base64"},
    ]})


class EmbeddingItem(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingItem]
    model: str
    usage: Usage


class ModelMemory(BaseModel):
    weights_bytes: int  # weights, with the int8 and prepacked copies serving adds
    kv_cache_bytes: int  # the paged KV cache's block pool, the prefix cache's blocks among them
    total_bytes: int


class Quantization(BaseModel):
    # weights, decode, decode_q4: null until the model is loaded (a load decides them)
    weights: str | None  # what prompts run in: float32, bfloat16, float16; int8 (an int8 encoder-decoder, sources too)
    decode: str | None  # what decode steps multiply with: int8; q4+int8 (4-bit runs + int8); the dtype
    source: str | None = None  # the source file's quantization (a GGUF file type: Q4_1, Q4_K_M, ...)
    decode_q4: int | None = 0  # projections whose decode steps read the file's Q4_0 / Q4_1 weights as stored


class SamplingDefaults(BaseModel):
    """What a generation request's unset sampling fields take (TSERVE_GENERATION_CONFIG)."""

    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    source: list[str]  # where the values that are not the API's come from: the model's file, the override setting
    not_applied: list[str] = Field(default_factory=list)  # what the model recommends that this server does not do


class ModelCard(BaseModel):
    """An OpenAI model object with this server's extra fields. What a model is (family, task,
    architecture, context length, parameters, chat, tools, language pair, source quantization and
    size) is read from its files before it loads; the fields only a load can know are null while
    it is not loaded and named in ``until_loaded`` (empty once loaded)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    state: Literal["loaded", "loading", "available", "failed"] = "loaded"
    state_reason: str | None = None  # why the last load failed, or why it was refused (memory budget)
    keep_alive: float | None = None  # seconds it stays loaded once idle; -1: forever
    memory: ModelMemory | None = None  # what it holds now (0 while not loaded)
    family: str | None = None
    task: str | None = None
    architecture: str | None = None  # llama, qwen2, qwen3, mistral, phi3, gemma3, gpt2, bert, marian, transformer
    context_length: int | None = None  # tokens one request may use (prompt + generated; source for translation)
    max_seq_len: int | None = None  # the same limit, under its older name
    quantization: Quantization | None = None
    decode_step: Literal["native", "python", "python+native-attention", "triton"] | None = None  # decoder models
    parameters: int | None = None
    chat: bool = False  # serves /v1/chat/completions (the model has a chat template)
    prefix_cache: dict[str, int] | None = None  # decoder models: block_tokens, blocks_named (the prefix cache)
    kv_cache: dict[str, int] | None = None  # generative models: block_tokens, blocks, bytes, capacity_tokens
    speculative: dict[str, Any] | None = None  # decoder models: prompt-lookup drafting's settings and counts
    structured_outputs: bool = False  # follows response_format / structured_outputs / guided_* (decoder models)
    tools: bool = False  # takes tools on /v1/chat/completions
    tool_prompt: Literal["template", "generic"] | None = None  # who shows the model its tools
    sampling_defaults: SamplingDefaults | None = None  # decoder models
    tool_format: Literal["hermes", "llama3", "mistral", "generic"] | None = None  # how it writes a call
    metrics: dict[str, Any] = Field(default_factory=dict)
    language_pair: list[str] | None = None  # translation models: [source, target] language codes
    source_bytes: int | None = None  # the size of its weight files on disk
    until_loaded: list[str] = Field(default_factory=list)  # fields null because only a load can know them
    card_error: str | None = None  # why its files could not be read before a load (the other fields then null)


class ModelAction(RequestModel):
    """``POST /models/load`` and ``/models/unload`` (llama.cpp server's router shape)."""

    model: str = Field(min_length=1, max_length=1000)


class ModelActionResult(BaseModel):
    success: bool = True
    model: str
    state: Literal["loaded", "loading", "available", "failed"]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
