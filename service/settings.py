"""Service settings: read once (env vars ``TSERVE_*`` or a ``.env`` file) in the app factory.

Every limit the service enforces is here, with its default; the README's configuration
table lists the same fields. Model-specific limits (vocabulary, positions) come from each
checkpoint's config.json and are never repeated here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from model.decode import DecodeOptions
from model.formats.generation import check_sampling
from service.units import parse_duration, parse_size


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TSERVE_", env_file=".env", extra="ignore")

    # --- where and what to serve -----------------------------------------------------
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    weights_dir: Path = Path("weights")
    models: str = Field("", description="comma-separated models to serve; empty = all in weights_dir")
    preload: str = Field("", description="comma-separated models loaded at start-up (/ready waits for them); "
                         "empty = every model TSERVE_MODELS names, or without it every model found but those "
                         "whose manifest says \"preload\": false (the Qwen2.5-Coder models: loaded on their "
                         "first request); 'none' = nothing, models load on demand")
    memory_budget: int | None = Field(None, ge=0, description="bytes of weights + KV caches of the loaded models "
                                      "(4GiB, 800MB, ...); loading past it evicts the least recently used idle "
                                      "model; empty = no budget")
    keep_alive: float = Field(-1.0, description="how long a model stays loaded after its last request (Ollama's "
                              "syntax: 5m, 30s, 1h, seconds); -1 = forever, 0 = unload after each request")
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    kv_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="KV cache of decoder-only models: auto = the model's dtype; bfloat16 halves the "
                            "cache's memory and what a step reads, at a cost in fidelity")
    torch_threads: int = Field(0, ge=0, description="intra-op threads; 0 = torch's default")
    quantize: Literal["auto", "none", "int8"] = Field(
        "auto", description="int8: decode steps through per-channel int8 projections and head (CPU; prompts "
                            "too under the native step, see prefill); auto: int8 for decoders with a gated "
                            "feed-forward (Llama-style) on the CPU, none for the others")
    native_decode: Literal["auto", "on", "off"] = Field(
        "auto", description="native C++ decode step (Llama architecture, CPU, built with the machine's C++ compiler "
                            "before /ready): auto = where decode steps run int8 and it builds, on = every model it "
                            "can run (else a start-up error naming why), off = the Python step")
    native_library: str = Field(
        "", description="a prebuilt native decode library to load instead of compiling one (the container's, "
                        "built by python -m model.decode.native); empty = build with the machine's compiler")
    prefill: Literal["auto", "model"] = Field(
        "auto", description="how prompts are written: auto = through the native decode step where a model runs it "
                            "(int8, row by row, every chunk), else the model's forward; model = always the model's "
                            "float forward")
    decode_weights: Literal["auto", "int8"] = Field(
        "auto", description="weights of the native decode step: auto = a model's own 4-bit weights where its file "
                            "stores them as 4-bit runs (GGUF Q4_0 / Q4_1: 0.625 bytes a weight, read as they are), "
                            "int8 for the rest; int8 = int8 everywhere")
    decode_attention: Literal["auto", "sdpa", "triton", "native"] = Field(
        "auto", description="attention of the Python decode step (models the native step does not run, "
                            "encoder-decoders among them): auto = the Triton kernel on CUDA when triton is "
                            "installed, on the CPU the native library's paged attention where it builds, else SDPA; "
                            "triton, native = that kernel or a start-up error")

    # --- which model answers a drop-in request that names none (TGI, TEI, InferenceClient) -----
    default_generation_model: str = Field(
        "", description="text generation without a model (or with a placeholder such as 'tgi'); empty = the "
                        "first loaded model with a chat template, else the first text-generation model")
    default_embedding_model: str = Field("", description="embeddings without a model; empty = the first "
                                                         "embedding model loaded")
    default_fill_mask_model: str = Field("", description="fill-mask without a model; empty = the first "
                                                         "fill-mask model loaded")
    default_translation_model: str = Field("", description="translation without a model or language pair; "
                                                           "empty = the first translation model loaded")

    # --- engine limits (per model) -----------------------------------------------------
    max_batch: int = Field(32, ge=1, le=1024, description="sequences in flight per model (rows of the KV cache); "
                           "memory is TSERVE_KV_CACHE_BYTES")
    max_seq_len: int = Field(0, ge=0, description="context: prompt + generated tokens of one sequence; 0 = each "
                             "model's own maximum (its max_positions); else capped by it")
    kv_cache_bytes: int = Field(384 * 2**20, ge=2**20, description="the KV cache's block pool per generative model "
                                "(16-token blocks, touched as used), raised to hold one "
                                "sequence at its full context (its layers x KV heads x head size x cache dtype; "
                                "TSERVE_MAX_SEQ_LEN lowers that); a prompt that can never fit it gets 400, one "
                                "that fits later waits")
    max_queue: int = Field(128, ge=0, description="requests waiting for a slot before 429")
    max_prefill_tokens: int = Field(2048, ge=16, description="prompt tokens processed per engine step")
    prefix_cache: bool = Field(True, description="decoder models share the KV blocks of prompt prefixes they "
                               "have seen (read in place)")
    speculative: Literal["ngram", "draft", "off"] = Field(
        "ngram", description="speculative decoding for decoder models: ngram drafts the tokens that followed the "
        "text's latest repeated span (prompt lookup) and verifies them in the same step; draft = a draft model "
        "(TSERVE_DRAFT_MODEL) drafts for the models it names, ngram for the others; off")
    draft_model: str = Field(
        "", description="under TSERVE_SPECULATIVE=draft, each target's draft model: comma-separated "
        "target=draft pairs, each a served model name or a path (a draft must share its target's vocabulary)")
    speculative_tokens: int = Field(4, ge=1, le=16, description="draft tokens per sequence per step at most")
    speculative_max_batch: int = Field(4, ge=1, description="draft only while at most this many sequences "
                                       "decode (beyond, extra rows cost what they save)")
    max_encoder_batch: int = Field(64, ge=1, description="texts per fill-mask/embedding forward pass")
    fill_mask_rescore: bool = Field(True, description="let a fill-mask model whose manifest names a rescorer "
                                                      "(fill-mask-en: Gemma 3 270M) re-rank its candidates; "
                                                      "false = the masked LM's own answers, without loading it")
    request_timeout_s: float = Field(300.0, gt=0, description="a request still running after this fails with 504")
    warmup: bool = True

    # --- sampling a generation request leaves unset -------------------------------------------
    generation_config: Literal["auto", "none"] = Field(
        "auto", description="defaults of the sampling fields a generation request leaves unset (temperature, "
                            "top_p, top_k, repetition_penalty): auto = what the model's publisher recommends "
                            "(its manifest's generation block, generation_config.json or the GGUF's "
                            "general.sampling keys) where it says, the API's for the rest; none = the API's "
                            "(temperature 1, no top-p or top-k limit, no repetition penalty). GET /v1/models "
                            "shows each model's as sampling_defaults")
    generation_override: dict[str, Any] = Field(
        default_factory=dict, description="a JSON object of sampling defaults for every generative model, over "
                                          "the model's and the API's, e.g. {\"temperature\": 0.7, \"top_p\": 0.9}; "
                                          "a request's own fields still win")

    # --- structured outputs and tools (docs/structured-outputs.md) ---------------------------
    grammar_max_bytes: int = Field(65_536, ge=64, description="a JSON schema, regex, grammar or choice list, "
                                   "in bytes; larger get 400")
    grammar_max_depth: int = Field(32, ge=2, description="nesting of a JSON schema (objects and arrays); deeper "
                                   "get 400")
    grammar_max_enum: int = Field(1024, ge=1, description="values of one enum, or choices of a choice constraint")
    max_tools: int = Field(64, ge=1, description="functions in one request's tools")
    grammar_timeout_s: float = Field(5.0, gt=0, description="compiling one grammar of up to 16 KiB (off the "
                                     "engine thread), one more span per 16 KiB; past it a 503 with Retry-After")
    grammar_cache_size: int = Field(256, ge=1, description="compiled grammars kept per model (LRU)")

    # --- HTTP ------------------------------------------------------------------------------
    max_body_bytes: int = Field(1_000_000, ge=1024, description="larger request bodies get 413")
    max_header_bytes: int = Field(16_384, ge=1024, description="request line + headers; larger get 431")
    max_headers: int = Field(100, ge=8, description="header lines per request; more get 431")
    max_texts: int = Field(64, ge=1, description="list inputs (translate, fill-mask, embeddings, prompts)")
    max_text_chars: int = Field(20_000, ge=1, description="characters per input text")
    max_po_entries: int = Field(5_000, ge=1, description="entries in a .po file sent to /v1/translate/po")
    api_key: SecretStr | None = None
    protect_health_and_metrics: bool = False
    playground: bool = Field(True, description="serve the web playground at / and /playground")
    cors_origins: str = Field("", description="comma-separated allowed origins; '*' for any; empty = no CORS")
    exit_on_load_failure: bool = Field(
        False, description="a model that fails to load ends the process with exit code 1; default: it stays "
                           "up, /ready 503, /health 503 naming the error (an orchestrator restarts it)")
    shutdown_grace_s: float = Field(10.0, ge=0, description="in-flight requests get this long on shutdown")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_json: bool = True

    @field_validator("memory_budget", mode="before")
    @classmethod
    def _size(cls, value):
        return None if value is None or (isinstance(value, str) and not value.strip()) else parse_size(value)

    @field_validator("keep_alive", mode="before")
    @classmethod
    def _duration(cls, value):
        return parse_duration(value)

    @field_validator("generation_override")
    @classmethod
    def _generation_override(cls, value):
        return check_sampling(value, "TSERVE_GENERATION_OVERRIDE")

    def decode_options(self) -> DecodeOptions:
        """The decode step the settings choose (``model.decode.prepare`` reads it), as one value."""
        return DecodeOptions(quantize=self.quantize, native=self.native_decode,
                             native_library=self.native_library or None, kv_dtype=self.kv_dtype,
                             attention=self.decode_attention, prefill=self.prefill,
                             weights=self.decode_weights)

    def model_names(self) -> list[str]:
        return [m.strip() for m in self.models.split(",") if m.strip()]

    def preload_names(self) -> list[str] | None:
        """The models to load at start-up; None = every model served (the default)."""
        names = [m.strip() for m in self.preload.split(",") if m.strip()]
        if not names:
            return None
        return [] if names == ["none"] else names

    @field_validator("draft_model")
    @classmethod
    def _draft_model(cls, value: str) -> str:
        for pair in (p.strip() for p in value.split(",") if p.strip()):
            target, _, draft = pair.partition("=")
            if not target.strip() or not draft.strip():
                raise ValueError(f"TSERVE_DRAFT_MODEL: {pair!r} is not target=draft")
        return value

    def draft_models(self) -> dict[str, str]:
        """Target model -> its draft (a served name or a path), as TSERVE_DRAFT_MODEL pairs them."""
        pairs = (p.strip().partition("=") for p in self.draft_model.split(",") if p.strip())
        return {target.strip(): draft.strip() for target, _, draft in pairs}

    def cors_origin_list(self) -> list[str]:
        return [o.strip() for o in self.cors_origins.split(",") if o.strip()]
