"""POST /v1/completions: the OpenAI completions API on a decoder model.

Each (prompt, n) pair is one engine request; they run concurrently in the engine's batch.
Choice i*n + j is completion j of prompt i, as in the OpenAI API.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from service.dependencies import RegistryDep, SettingsDep
from service.engine import EngineEvent, GenerativeEngine, RequestStream, SamplingParams
from service.engine_errors import InvalidRequestError
from service.openai_schemas import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from service.routes.generate import ERRORS, token_text
from service.routes.inputs import text_list
from service.routes.streaming import check_event, collect, mark, sse_response
from service.schemas import Usage

router = APIRouter(tags=["openai"])


def _prompts(body: CompletionRequest, engine: GenerativeEngine, settings) -> list[list[int]]:
    p = body.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], str)):
        return engine.tokenizer.encode_batch(text_list(p, "prompt", settings))
    rows = [p] if isinstance(p[0], int) else p
    if len(rows) > settings.max_texts:
        raise InvalidRequestError(f"prompt has {len(rows)} items; at most {settings.max_texts}", "prompt")
    for row in rows:
        if not row or min(row) < 0 or max(row) >= engine.cfg.vocab_size:
            raise InvalidRequestError(f"prompt token ids must be non-empty and in [0, {engine.cfg.vocab_size})",
                                      "prompt")
    return [list(r) for r in rows]


def _finish(reason: str | None) -> str | None:
    return "stop" if reason == "eos" else reason  # OpenAI knows only stop / length


def _logprobs(engine: GenerativeEngine, events: list[EngineEvent], offset: int) -> CompletionLogprobs:
    tokens, lps, tops, offsets = [], [], [], []
    for e in events:
        for i, (t, lp) in enumerate(zip(e.token_ids, e.logprobs)):
            piece = token_text(engine, t)
            offsets.append(offset)
            offset += len(piece)
            tokens.append(piece)
            lps.append(lp)
            top = e.top_logprobs[i] if i < len(e.top_logprobs) else None
            tops.append({token_text(engine, k): v for k, v in top.items()} if top else None)
    return CompletionLogprobs(tokens=tokens, token_logprobs=lps, top_logprobs=tops, text_offset=offsets)


@router.post("/v1/completions", response_model=CompletionResponse, response_model_exclude_none=True,
             responses=ERRORS, summary="OpenAI-compatible text completion (stream=true for SSE)")
async def completions(body: CompletionRequest, request: Request, registry: RegistryDep, settings: SettingsDep):
    engine: GenerativeEngine = registry.get(body.model, "decoder", "/v1/completions")
    mark(request, engine.name)
    if body.echo and body.logprobs is not None:
        raise InvalidRequestError("echo together with logprobs is not supported", "echo")
    prompts = _prompts(body, engine, settings)
    items = []
    for i, ids in enumerate(prompts):
        max_tokens = body.max_tokens if body.max_tokens is not None else max(1, engine.max_len - len(ids))
        for j in range(body.n):
            params = SamplingParams(
                max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                repetition_penalty=body.repetition_penalty, stop=body.stop, logprobs=body.logprobs,
                seed=None if body.seed is None else body.seed + j, ignore_eos=body.ignore_eos)
            items.append((ids, params, "prompt" if len(prompts) == 1 else f"prompt[{i}]"))
    streams = engine.submit_all(items, group_field="n" if body.n > 1 else "prompt")
    rid, created = f"cmpl-{streams[0].request_id}", int(time.time())
    echoes = [engine.tokenizer.decode(ids) if body.echo else "" for ids in prompts for _ in range(body.n)]
    prompt_tokens = sum(len(ids) for ids in prompts)
    if body.stream:
        return sse_response(_chunks(engine, streams, echoes, request, rid, created, prompt_tokens, body), streams)
    results = await collect(request, streams)
    completion_tokens = sum(events[-1].completion_tokens for events in results)
    mark(request, usage=(prompt_tokens, completion_tokens))
    choices = [CompletionChoice(
        index=i, text=echoes[i] + "".join(e.text for e in events), finish_reason=_finish(events[-1].finish_reason),
        logprobs=_logprobs(engine, events, len(echoes[i])) if body.logprobs is not None else None)
        for i, events in enumerate(results)]
    return CompletionResponse(id=rid, created=created, model=engine.name, choices=choices,
                              usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                          total_tokens=prompt_tokens + completion_tokens))


async def _chunks(engine: GenerativeEngine, streams: list[RequestStream], echoes: list[str], request: Request,
                  rid: str, created: int, prompt_tokens: int, body: CompletionRequest) -> AsyncIterator[dict]:
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        async for event in stream:
            await queue.put((index, event))

    pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    offsets = [len(e) for e in echoes]
    remaining, completion_tokens = len(streams), 0
    try:
        for i, echo in enumerate(echoes):
            if echo:
                yield _chunk(rid, created, engine.name, i, echo, None, None)
        while remaining:
            index, event = await queue.get()
            check_event(event)
            logprobs = None
            if body.logprobs is not None:
                logprobs = _logprobs(engine, [event], offsets[index]).model_dump()
            offsets[index] += len(event.text)
            chunk = _chunk(rid, created, engine.name, index, event.text, _finish(event.finish_reason), logprobs)
            if event.finished:
                remaining -= 1
                completion_tokens += event.completion_tokens
                if len(streams) == 1:
                    chunk["usage"] = _usage(prompt_tokens, completion_tokens)
            yield chunk
        mark(request, usage=(prompt_tokens, completion_tokens))
        if len(streams) > 1 or (body.stream_options and body.stream_options.include_usage):
            yield {"id": rid, "object": "text_completion", "created": created, "model": engine.name, "choices": [],
                   "usage": _usage(prompt_tokens, completion_tokens)}
    finally:
        for p in pumps:
            p.cancel()


def _chunk(rid, created, model, index, text, finish_reason, logprobs) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
