"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shape, with llama.cpp's fields where cheap.

- ``/tokenize``: ``{"model", "prompt"}`` (or llama.cpp's ``content``) -> ``{"tokens", "count",
  "max_model_len"}``; ``messages`` instead renders the model's chat template first, as vLLM does
  (``add_generation_prompt``, default true: the prompt ``/v1/chat/completions`` would run, so
  ``count`` is its ``prompt_tokens``); ``add_special_tokens`` (default true) for a ``prompt``;
  ``return_token_strs`` adds vLLM's ``token_strs``; ``with_pieces`` gives llama.cpp's
  ``[{"id", "piece"}]`` tokens.
- ``/detokenize``: ``{"model", "tokens"}`` -> ``{"prompt"}`` (and llama.cpp's ``content``).
Without ``model``, the default text-generation model answers (``EngineRegistry.default``).
Errors have the OpenAI shape, as vLLM's do: an unknown model is a 404, a token id outside the
vocabulary a 400 naming ``tokens``.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import Field

from service.chat import tool_calls
from service.engines.errors import InvalidRequestError
from service.engines.generative import BaseEngine, GenerativeEngine
from service.http.dependencies import RegistryDep
from service.http.errors import ERROR_RESPONSES
from service.models.registry import EngineRegistry
from service.routes.streaming import mark
from service.schemas.chat import ChatMessage
from service.schemas.common import RequestModel
from service.translation.translate import reload_unloaded

router = APIRouter(tags=["tokenization (vLLM / llama.cpp)"])


class TokenizeRequest(RequestModel):
    model: str | None = Field(None, description="a loaded model; none: the default text-generation model")
    prompt: str | None = None
    content: str | None = Field(None, description="llama.cpp's name for prompt")
    messages: list[ChatMessage] | None = Field(None, min_length=1, description="rendered by the chat template")
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    with_pieces: bool = False


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)


async def _engine(registry: EngineRegistry, name: str | None, endpoint: str) -> BaseEngine:
    """The named model, of any family, loaded again if keep_alive or /models/unload unloaded it
    (its family is known from its last load); unnamed: the default decoder, or any loaded model."""
    if name is None:
        if registry.default("text-generation") is None:  # the default one, unloaded by keep_alive: load it again
            await reload_unloaded(registry, ("decoder",))
        found = registry.default("text-generation") or next(iter(registry.engines.values()), None)
        if found is None:
            return registry.get(None, "decoder", endpoint)  # raises: loading, or nothing loaded
        name = found.name
    known, entry = registry.engines.get(name), registry.entries.get(name)
    card = entry.described if entry is not None else None  # its files' card, before any load
    family = known.family if known else card["family"] if card else "decoder"
    return await registry.acquire(name, family, endpoint)


@router.post("/tokenize", responses=ERROR_RESPONSES, summary="vLLM / llama.cpp: a prompt's (or a chat's) token ids")
async def tokenize(body: TokenizeRequest, request: Request, registry: RegistryDep):
    given = [name for name in ("prompt", "content", "messages") if getattr(body, name) is not None]
    if len(given) != 1:
        raise InvalidRequestError("/tokenize takes exactly one of 'prompt', 'content' (llama.cpp) or 'messages'; got "
                                  f"{len(given)}", given[1] if given else "prompt")
    engine = await _engine(registry, body.model, "/tokenize")
    mark(request, engine.name)
    if body.messages is not None:
        if not isinstance(engine, GenerativeEngine) or engine.family != "decoder":
            raise InvalidRequestError(f"model '{engine.name}' has no chat template; send 'prompt'", "messages")
        ids = engine.chat_prompt(tool_calls.history(body.messages, engine.tool_format),
                                 add_generation_prompt=body.add_generation_prompt)
    else:
        ids = engine.encode(body.prompt if body.prompt is not None else body.content, body.add_special_tokens)
    out: dict = {"tokens": ids, "count": len(ids), "max_model_len": engine.max_len}
    if body.with_pieces:
        out["tokens"] = [{"id": i, "piece": engine.token_text(i)} for i in ids]
    if body.return_token_strs:
        out["token_strs"] = engine.token_strs(ids)
    return out


@router.post("/detokenize", responses=ERROR_RESPONSES, summary="vLLM / llama.cpp: the text of token ids")
async def detokenize(body: DetokenizeRequest, request: Request, registry: RegistryDep):
    engine = await _engine(registry, body.model, "/detokenize")
    mark(request, engine.name)
    bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < engine.vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(f"tokens[{bad}] is {body.tokens[bad]}; token ids of model '{engine.name}' are in "
                                  f"[0, {engine.vocab_size})", "tokens")
    text = engine.detokenize(body.tokens)
    return {"prompt": text, "content": text}
