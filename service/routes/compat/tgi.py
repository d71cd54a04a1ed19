"""Text Generation Inference: POST /generate, POST /generate_stream (SSE token events).

As TGI serves them (https://huggingface.github.io/text-generation-inference/): ``{"inputs",
"parameters"}``; greedy unless ``do_sample`` (or a temperature / top_k / top_p) asks to sample;
``details`` adds finish reason, token count, seed and tokens; errors are
``{"error", "error_type"}`` with 422 (validation), 424 (generation), 429 (overloaded).
``POST /`` and ``GET /info`` live in ``hf_inference`` (shared with TEI).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, Field

from service.chat.structured import from_tgi
from service.engines.errors import EngineError, InvalidRequestError
from service.engines.generative import MAX_STOP_STRINGS, EngineEvent, GenerativeEngine, RequestStream, SamplingParams
from service.engines.waiting import collect
from service.http.dependencies import RegistryDep, SettingsDep
from service.routes.compat.common import error_route
from service.routes.inputs import input_ids
from service.routes.streaming import check_event, client_gone, mark, sse_event, sse_response
from service.schemas.common import MAX_SEED, RequestModel

TGI_FINISH = {"eos": "eos_token", "length": "length", "stop": "stop_sequence"}
TGI_ERROR_TYPES = {400: "validation", 404: "validation", 413: "validation", 422: "validation", 429: "overloaded",
                   503: "overloaded", 504: "generation"}


def render(exc: EngineError) -> JSONResponse:
    status = 422 if exc.status in (400, 404) else (424 if exc.status in (500, 504) else exc.status)
    headers = ({"Retry-After": str(getattr(exc, "retry_after", 1))}
               if status == 429 or hasattr(exc, "retry_after") else None)
    return JSONResponse({"error": exc.message, "error_type": TGI_ERROR_TYPES.get(status, "generation")},
                        status_code=status, headers=headers)


router = APIRouter(tags=["Text Generation Inference"], route_class=error_route(render))


class TGIParameters(RequestModel):
    model_config = ConfigDict(extra="ignore")  # strict JSON types, as TGI (serde) reads them: 0 is no bool

    do_sample: bool = False
    max_new_tokens: int | None = Field(None, ge=1, le=4096)
    temperature: float | None = Field(None, gt=0.0, le=100.0)
    top_k: int | None = Field(None, ge=1)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    stop: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    details: bool = False
    return_full_text: bool = False
    decoder_input_details: bool = False
    top_n_tokens: int | None = Field(None, ge=0, le=5)
    grammar: dict | None = None  # {"type": "json" | "regex", "value": ...}: constrained decoding
    # accepted and refused when set, as a TGI without these features would do
    best_of: int | None = None
    watermark: bool = False
    truncate: int | None = None
    typical_p: float | None = None
    frequency_penalty: float | None = None
    adapter_id: str | None = None


class TGIRequest(RequestModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="extension: which loaded model (TGI serves one)")
    inputs: str = Field(..., min_length=1)
    parameters: TGIParameters = Field(default_factory=TGIParameters)
    stream: bool = False


def sampling(p: TGIParameters, prompt_len: int, engine: GenerativeEngine) -> SamplingParams:
    refused = [name for name, value in (("best_of", p.best_of not in (None, 1)), ("watermark", p.watermark),
                                         ("truncate", p.truncate is not None),
                                         ("typical_p", p.typical_p not in (None, 1.0)),
                                         ("frequency_penalty", p.frequency_penalty not in (None, 0.0)),
                                         ("adapter_id", p.adapter_id is not None)) if value]
    if refused:
        raise InvalidRequestError(f"Input validation error: `{refused[0]}` is not supported by this server",
                                  refused[0])
    # TGI is greedy unless asked to sample (its own default, kept); a sampled request's unset fields,
    # and an unset repetition penalty, take the model's defaults (GET /v1/models: sampling_defaults)
    sample = p.do_sample or any(v is not None for v in (p.temperature, p.top_k, p.top_p))
    max_new = p.max_new_tokens or max(1, min(100, engine.max_len - prompt_len))
    return engine.sampling(max_new_tokens=max_new, temperature=p.temperature if sample else 0.0, top_k=p.top_k,
                           top_p=p.top_p, repetition_penalty=p.repetition_penalty, stop=p.stop, seed=p.seed,
                           logprobs=p.top_n_tokens if p.top_n_tokens else 0)


def _token(engine: GenerativeEngine, token_id: int, logprob: float | None) -> dict:
    return {"id": token_id, "text": engine.token_text(token_id), "logprob": logprob,
            "special": engine.is_special(token_id)}


def _details(engine: GenerativeEngine, events: list[EngineEvent], seed: int | None) -> dict:
    tokens = [_token(engine, t, lp) for e in events for t, lp in zip(e.token_ids, e.logprobs or [None] * 99)]
    final = events[-1]
    return {"finish_reason": TGI_FINISH.get(final.finish_reason or "length", "length"),
            "generated_tokens": engine.completion_tokens(final), "seed": seed, "prefill": [], "tokens": tokens}


async def prepare(body: TGIRequest, request: Request, registry, settings) -> tuple[GenerativeEngine, list[int],
                                                                                    SamplingParams]:
    engine: GenerativeEngine = await registry.acquire(body.model, "decoder", request.url.path, only_one=True)
    mark(request, engine.name)
    ids = input_ids(body.inputs, "inputs", engine, settings)[0]
    return engine, ids, sampling(body.parameters, len(ids), engine)


async def _submit(engine: GenerativeEngine, ids: list[int], params: SamplingParams, body: TGIRequest,
                  settings) -> RequestStream:
    constraint = from_tgi(body.parameters.grammar, settings)
    (stream,) = await engine.submit_constrained([(ids, params, "inputs")], constraint.spec if constraint else None,
                                                constraint.field if constraint else "", group_field="inputs")
    return stream


async def generate_one(body: TGIRequest, request: Request, registry, settings) -> dict:
    engine, ids, params = await prepare(body, request, registry, settings)
    (events,) = await collect(client_gone(request), [await _submit(engine, ids, params, body, settings)])
    mark(request, usage=engine.usage([ids], [events[-1]]))
    text = "".join(e.text for e in events)
    out: dict = {"generated_text": (body.inputs + text) if body.parameters.return_full_text else text}
    if body.parameters.details:
        out["details"] = _details(engine, events, body.parameters.seed)
    return out


async def stream_response(body: TGIRequest, request: Request, registry, settings):
    engine, ids, params = await prepare(body, request, registry, settings)
    stream = await _submit(engine, ids, params, body, settings)
    return sse_response(_events(engine, stream, request, body, ids), [stream], done=False,
                        error_chunk=lambda exc: {"error": exc.message, "error_type": "generation"})


async def _events(engine: GenerativeEngine, stream: RequestStream, request: Request, body: TGIRequest,
                  ids: list[int]) -> AsyncIterator[dict]:
    """One event per token: {index, token, top_tokens, generated_text (last only), details (last only)}."""
    index, text, events = 0, "", []
    start = time.monotonic()
    async for event in stream:
        check_event(event)
        events.append(event)
        text += event.text
        tokens = list(zip(event.token_ids, event.logprobs or [None] * len(event.token_ids)))
        if not tokens and event.finished:
            tokens = [(engine.eos_token_id or 0, None)]  # nothing new (a stop string): close the stream
        for i, (token_id, logprob) in enumerate(tokens):
            index += 1
            last = event.finished and i == len(tokens) - 1
            token = _token(engine, token_id, logprob)
            token["text"] = event.text if len(tokens) == 1 else token["text"]
            chunk = {"index": index, "token": token, "top_tokens": None, "generated_text": None, "details": None}
            if last:
                mark(request, usage=engine.usage([ids], [event]))
                chunk["generated_text"] = (body.inputs + text) if body.parameters.return_full_text else text
                if body.parameters.details:
                    chunk["details"] = {"finish_reason": TGI_FINISH.get(event.finish_reason or "length", "length"),
                                        "generated_tokens": engine.completion_tokens(event),
                                        "seed": body.parameters.seed, "input_length": len(ids),
                                        "total_time_ms": round((time.monotonic() - start) * 1000)}
            yield chunk


@router.post("/generate", summary="TGI: generate text")
async def generate(body: TGIRequest, request: Request, registry: RegistryDep, settings: SettingsDep):
    return await generate_one(body, request, registry, settings)


@router.post("/generate_stream", summary="TGI: generate text, one Server-Sent Event per token")
async def generate_stream(body: TGIRequest, request: Request, registry: RegistryDep, settings: SettingsDep):
    return await stream_response(body, request, registry, settings)


__all__ = ["TGIRequest", "generate_one", "render", "router", "sse_event", "stream_response"]
