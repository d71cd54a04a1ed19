"""``POST /`` and ``GET /info``: the two paths TGI and TEI both define, and where
``huggingface_hub.InferenceClient(base_url=...)`` sends every task.

``POST /`` picks the task from the payload (the client sends each task's own fields):
1. ``parameters.src_lang`` / ``tgt_lang`` -> translation, ``[{"translation_text"}]``;
2. ``normalize`` / ``truncate`` / ``truncation_direction`` / ``prompt_name``, or no ``parameters`` at
   all (what ``feature_extraction`` sends; the other tasks always send one) -> embeddings (TEI ``/embed``);
3. ``stream`` or a text-generation parameter -> generation (TGI ``POST /``: a list of one result,
   or the SSE token stream);
4. a fill-mask model's mask token in ``inputs``, or only ``top_k`` / ``targets`` -> fill-mask;
5. otherwise the task of the loaded models, in the order text generation, embeddings,
   translation, fill-mask (TGI answers ``POST /`` with generation).
``GET /info`` answers as TGI when a text-generation model is loaded (what TGI clients and
``InferenceClient.get_endpoint_info`` read), otherwise as TEI when an embedding model is,
otherwise in TGI's shape for the first model loaded; it describes the default model of its task
(``EngineRegistry.default``), the one a request without ``model`` (or with a placeholder) gets.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

import service.routes.compat.tei as tei
import service.routes.compat.tgi as tgi
from service.engines.encoder import EncoderEngine
from service.engines.errors import InvalidRequestError
from service.engines.generative import MAX_STOP_STRINGS
from service.engines.waiting import unless_disconnected
from service.http.dependencies import RegistryDep, SettingsDep
from service.models.registry import EngineRegistry
from service.routes.compat.common import error_route, read_params, translate_texts
from service.routes.inputs import input_ids, text_list
from service.routes.streaming import client_gone, mark
from service.translation.translate import engine_for, reload_unloaded, translation_pairs

router = APIRouter(tags=["Hugging Face Inference (TGI / TEI)"], route_class=error_route(tgi.render))

VERSION = "transformer-serve 0.1.0"
GENERATION_KEYS = {"max_new_tokens", "do_sample", "temperature", "top_p", "repetition_penalty", "stop", "seed",
                   "details", "return_full_text", "decoder_input_details", "top_n_tokens", "watermark", "best_of",
                   "grammar", "typical_p", "frequency_penalty", "truncate", "adapter_id"}
EMBED_KEYS = {"normalize", "truncate", "truncation_direction", "prompt_name", "dimensions"}


def _served_tasks(registry: EngineRegistry) -> set[str]:
    """The tasks of every model served, loaded or not (from its card until it loads)."""
    return {e.task for e in registry.engines.values()} | {
        e.described["task"] for e in registry.entries.values() if e.described and e.described.get("task")}


def _loaded_task(registry: EngineRegistry) -> str:
    tasks = _served_tasks(registry)
    for task in ("text-generation", "feature-extraction", "translation", "fill-mask"):
        if task in tasks:
            return task
    raise InvalidRequestError("no model is loaded")


def pick_task(body: dict[str, Any], registry: EngineRegistry) -> str:
    params = body.get("parameters") if isinstance(body.get("parameters"), dict) else {}
    if "src_lang" in params or "tgt_lang" in params:
        return "translation"
    if EMBED_KEYS & set(body) or ("parameters" not in body and not body.get("stream") and
                                  "feature-extraction" in _served_tasks(registry)):
        return "feature-extraction"  # TEI's fields, or no "parameters" at all (the client's feature_extraction)
    if body.get("stream") or GENERATION_KEYS & set(params):
        return "text-generation"
    texts = body.get("inputs") if isinstance(body.get("inputs"), list) else [body.get("inputs")]
    masks = [e.mask_token for e in registry.engines.values() if isinstance(e, EncoderEngine) and e.mask_token]
    if any(isinstance(t, str) and m in t for t in texts for m in masks) or (params and set(params) <= {"top_k",
                                                                                                     "targets"}):
        return "fill-mask"
    return _loaded_task(registry)


@router.post("/", summary="TGI/TEI/HF Inference: the task is read from the payload (see the module docs)")
async def root(request: Request, registry: RegistryDep, settings: SettingsDep):
    # the tasks the schema lists; a task's default loads once the payload says which task it is
    await reload_unloaded(registry, ("encoder-decoder", "encoder", "decoder"), defaults=False)
    body = await read_params(request)
    if not isinstance(body.get("parameters", {}), dict | None):
        raise InvalidRequestError("parameters: must be an object", "parameters")
    return await answer(pick_task(body, registry), body, request, registry, settings)


async def answer(task: str, body: dict[str, Any], request: Request, registry: EngineRegistry, settings) -> Any:
    """One HF task's answer, in the shape InferenceClient reads for that task."""
    if task == "text-generation":
        req = tgi.TGIRequest.model_validate(body)
        if req.stream:
            return await tgi.stream_response(req, request, registry, settings)
        return [await tgi.generate_one(req, request, registry, settings)]
    if task == "feature-extraction":
        return await tei.embed(tei.EmbedRequest.model_validate(body), request, registry, settings)
    if task == "translation":
        return await _translation(body, request, registry, settings)
    return await _fill_mask(body, request, registry, settings)


async def _translation(body: dict, request: Request, registry: EngineRegistry, settings) -> list[dict]:
    params = body.get("parameters") or {}
    src, tgt = params.get("src_lang"), params.get("tgt_lang")
    for name, value in (("src_lang", src), ("tgt_lang", tgt)):  # both or neither, as huggingface_hub sends them
        if ("src_lang" in params or "tgt_lang" in params) and (not isinstance(value, str) or not value):
            raise InvalidRequestError(f"parameters.{name} must be a language code (a translation takes src_lang and "
                                      f"tgt_lang together); got {value!r}", f"parameters.{name}")
    if src or tgt:
        await reload_unloaded(registry)  # the default translation model, where none is loaded
        found = engine_for(registry, src or None, tgt or None)
        if found is None:
            raise InvalidRequestError(f"no translation model for {src or '?'} -> {tgt or '?'}; loaded pairs: "
                                      f"{sorted('-'.join(p) for p in translation_pairs(registry))}",
                                      "parameters.tgt_lang")
        engine = found[1]
    else:
        engine = await registry.acquire(None, "encoder-decoder", "/", only_one=True)
    texts = text_list(body.get("inputs") or "", "inputs", settings)
    translated, _ = await translate_texts(request, engine, texts, "inputs", settings)
    return [{"translation_text": t} for t in translated]


async def _fill_mask(body: dict, request: Request, registry: EngineRegistry, settings) -> list:
    params = body.get("parameters") or {}
    if isinstance(params.get("top_k"), float) and params["top_k"].is_integer():  # 14.0 is JSON Schema's integer
        params = {**params, "top_k": int(params["top_k"])}
    if params.get("targets"):
        raise InvalidRequestError("parameters.targets is not supported", "parameters.targets")
    top_k = params.get("top_k", 5)
    if not isinstance(top_k, int) or not 1 <= top_k <= 100:
        raise InvalidRequestError("parameters.top_k must be an integer in [1, 100]", "parameters.top_k")
    engine: EncoderEngine = await registry.acquire(None, "encoder", "/", "fill-mask", only_one=True)
    mark(request, engine.name)
    inputs = body.get("inputs")
    if not isinstance(inputs, (str, list)):
        raise InvalidRequestError("inputs must be a string or a list of strings", "inputs")
    rows = input_ids(inputs, "inputs", engine, settings)
    texts = [inputs] if isinstance(inputs, str) else list(inputs)
    results = await unless_disconnected(client_gone(request), engine.fill_mask(rows, top_k, texts))
    mark(request, usage=engine.usage(rows))
    shaped = [per_text[0] if len(per_text) == 1 else per_text for per_text in results]
    return shaped[0] if isinstance(inputs, str) else shaped


@router.get("/info", summary="TGI's /info when a generation model is loaded, else TEI's")
async def info(registry: RegistryDep, settings: SettingsDep):
    engines = list(registry.engines.values())
    decoder = registry.default("text-generation")  # the model a request without `model` goes to
    embedder = registry.default("feature-extraction")
    if decoder is None and embedder is not None:
        return tei_info(embedder, settings)
    model = decoder or (engines[0] if engines else None)
    if model is None:
        raise InvalidRequestError("no model is loaded")
    return tgi_info(model, settings)


def _common(settings) -> dict[str, Any]:
    return {"max_concurrent_requests": settings.max_queue + settings.max_batch, "max_client_batch_size":
            settings.max_texts, "version": VERSION, "sha": None, "docker_label": None}


def tei_info(embedder, settings) -> dict[str, Any]:
    """TEI's /info for an embedding model."""
    return {"model_id": embedder.name, "model_sha": None, "model_dtype": settings.dtype,
            "model_type": {"embedding": {"pooling": embedder.pooling}},
            "max_input_length": embedder.max_len, "max_batch_tokens": settings.max_encoder_batch * embedder.max_len,
            "max_batch_requests": settings.max_encoder_batch, "tokenization_workers": 1, **_common(settings)}


def tgi_info(model, settings) -> dict[str, Any]:
    """TGI's /info for a model of any task (``model_pipeline_tag`` names it)."""
    return {"model_id": model.name, "model_sha": None, "model_dtype": settings.dtype,
            "model_device_type": settings.device, "model_pipeline_tag": model.task, "max_best_of": 1,
            "max_stop_sequences": MAX_STOP_STRINGS, "max_input_tokens": model.max_len - 1,
            "max_total_tokens": model.max_len, "validation_workers": 1, "router": "text-generation-router",
            **_common(settings)}
