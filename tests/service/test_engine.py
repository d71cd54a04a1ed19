"""Engines without HTTP: aborts that race admission, all-or-nothing groups, and the encoder
engine's batching, timeout and shutdown."""

from __future__ import annotations

import asyncio

import pytest

from model import SamplingParams, load
from service.engines.encoder import EncoderEngine
from service.engines.errors import EngineStoppedError, InvalidRequestError, QueueFullError, RequestFailedError
from service.engines.generative import GenerativeEngine
from service.metrics import Metrics
from tests.service.conftest import settings_for

pytestmark = pytest.mark.asyncio


def sample(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def started(engine_cls, weights_dir, name: str, **overrides):
    metrics = Metrics()
    engine = engine_cls(name, load(weights_dir / name), settings_for(weights_dir, warmup=False, **overrides), metrics)
    await engine.start()
    return engine, metrics


async def test_abort_right_after_submit_never_runs_the_request(weights_dir):
    engine, metrics = await started(GenerativeEngine, weights_dir, "generate-tiny")
    try:
        long = SamplingParams(max_new_tokens=100, temperature=0, ignore_eos=True)
        for _ in range(5):  # the abort lands while the request is still in the engine's inbox
            engine.submit([5, 6, 7], long).abort()
        short = engine.submit([5, 6, 7], SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))
        events = [e async for e in short]  # this one runs after the aborted ones were handled
        assert events[-1].completion_tokens == 3
        assert sample(metrics, "tserve_generated_tokens_total", model="generate-tiny") == 3
        assert engine.core.slots_used == 0 and not engine.core.has_work
    finally:
        await engine.stop(1.0)


async def test_a_group_is_admitted_whole_or_not_at_all(weights_dir):
    engine, metrics = await started(GenerativeEngine, weights_dir, "generate-tiny", max_batch=2, max_queue=2)
    try:
        params = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
        with pytest.raises(InvalidRequestError) as too_big:  # can never fit: no retry helps
            engine.submit_all([([5, 6], params, "prompt")] * 5, group_field="n")
        assert too_big.value.param == "n" and "at most 4" in too_big.value.message

        hold = SamplingParams(max_new_tokens=60, temperature=0, ignore_eos=True)
        running = engine.submit_all([([5, 6], hold, "prompt")] * 3)
        with pytest.raises(QueueFullError):  # 3 of 4 places taken: a group of 2 does not fit now
            engine.submit_all([([7, 8], params, "prompt")] * 2)
        for stream in running:
            assert [e async for e in stream][-1].completion_tokens == 60
        # nothing of the rejected group ran: only the three admitted requests generated tokens
        assert sample(metrics, "tserve_generated_tokens_total", model="generate-tiny") == 180
        assert sample(metrics, "tserve_rejected_requests_total", model="generate-tiny", reason="queue_full") == 1
    finally:
        await engine.stop(1.0)


async def test_prefix_cache_and_kv_pool_come_from_the_settings(weights_dir):
    on, metrics = await started(GenerativeEngine, weights_dir, "generate-tiny", prefix_cache=True,
                                kv_cache_bytes=2**20)
    off, _ = await started(GenerativeEngine, weights_dir, "generate-tiny", prefix_cache=False)
    mt, _ = await started(GenerativeEngine, weights_dir, "translate-tiny")
    try:
        assert on.info()["prefix_cache"]["block_tokens"] == 16
        pool = on.info()["kv_cache"]
        assert pool["block_tokens"] == 16 and 0 < pool["bytes"] <= 2**20
        assert sample(metrics, "tserve_kv_cache_blocks", model="generate-tiny") == pool["blocks"]
        assert off.info()["prefix_cache"] is None and mt.info()["prefix_cache"] is None
        # the same prompt twice, one after the other, in the same engine: the second reads 4 blocks in place
        params = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
        prompt = [(11 * i) % 300 + 5 for i in range(80)]
        outs = []
        for engine in (on, on, off):
            outs.append([t async for e in engine.submit(prompt, params) for t in e.token_ids])
        assert outs[0] == outs[1] == outs[2]
        assert sample(metrics, "tserve_prefix_cache_hit_tokens_total", model="generate-tiny") == 64
        assert sample(metrics, "tserve_prefix_cache_query_tokens_total", model="generate-tiny") == 160
        assert sample(metrics, "tserve_prompt_tokens_total", model="generate-tiny") == 160
    finally:
        for engine in (on, off, mt):
            await engine.stop(1.0)


async def test_speculative_decoding_comes_from_the_settings(weights_dir):
    """Prompt lookup on a prompt that repeats itself: the same greedy tokens as without it,
    drafts counted in /metrics and in the model's card; off, and for translation, none."""
    on, metrics = await started(GenerativeEngine, weights_dir, "generate-tiny", speculative="ngram",
                                speculative_tokens=3)
    off, off_metrics = await started(GenerativeEngine, weights_dir, "generate-tiny", speculative="off")
    mt, _ = await started(GenerativeEngine, weights_dir, "translate-tiny")
    try:
        assert on.info()["speculative"]["tokens"] == 3
        assert off.info()["speculative"] is None and mt.info()["speculative"] is None
        params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
        prompt = [17, 42, 99, 23, 8, 61, 5] * 6
        outs = []
        for engine in (on, off):
            outs.append([t async for e in engine.submit(prompt, params) for t in e.token_ids])
        assert outs[0] == outs[1] and len(outs[0]) == 40
        drafted = sample(metrics, "tserve_spec_draft_tokens_total", model="generate-tiny")
        accepted = sample(metrics, "tserve_spec_accepted_tokens_total", model="generate-tiny")
        assert drafted > 0 and on.info()["speculative"]["drafted_tokens"] == drafted
        assert sample(metrics, "tserve_spec_acceptance_ratio", model="generate-tiny") == pytest.approx(
            accepted / drafted)
        assert sample(metrics, "tserve_generated_tokens_total", model="generate-tiny") == 40
        assert sample(off_metrics, "tserve_spec_draft_tokens_total", model="generate-tiny") == 0
    finally:
        for engine in (on, off, mt):
            await engine.stop(1.0)


async def test_concurrent_encoder_jobs_share_one_forward_pass(weights_dir):
    engine, metrics = await started(EncoderEngine, weights_dir, "fill-mask-tiny")
    try:
        rows = engine.tokenize([f"the quick brown {w} jumps" for w in ("fox", "dog", "cat", "owl")], "input")
        alone = [await engine.embed([r]) for r in rows]
        steps_before = sample(metrics, "tserve_engine_steps_total", model="fill-mask-tiny")
        together = await asyncio.gather(*(engine.embed([r]) for r in rows))
        steps = sample(metrics, "tserve_engine_steps_total", model="fill-mask-tiny") - steps_before
        assert steps < len(rows)  # jobs that arrive while a pass runs ride the next one together
        for a, b in zip(alone, together):  # batched (padded) equals alone
            assert a[0] == pytest.approx(b[0], abs=1e-5)
    finally:
        await engine.stop(1.0)


async def test_encoder_timeout_and_shutdown_are_clear_errors(weights_dir):
    engine, _ = await started(EncoderEngine, weights_dir, "fill-mask-tiny", request_timeout_s=0.5)
    rows = engine.tokenize(["a [MASK] sentence"], "text")
    gate = asyncio.Event()
    real_forward = engine._forward

    def slow_forward(batch):  # the worker thread waits until the test lets it go
        asyncio.run_coroutine_threadsafe(gate.wait(), engine._loop).result(timeout=10)
        return real_forward(batch)

    engine._forward = slow_forward
    with pytest.raises(RequestFailedError) as late:
        await engine.fill_mask(rows, 3)
    assert late.value.status == 504
    queued = asyncio.ensure_future(engine.embed(rows))  # waits behind the stuck pass
    await asyncio.sleep(0.05)
    stopping = asyncio.ensure_future(engine.stop(0.0))
    await asyncio.sleep(0.05)
    gate.set()
    await stopping
    with pytest.raises(EngineStoppedError):  # 503, not a bare RuntimeError (a 500)
        await queued


async def test_a_rescorer_reorders_one_mask_texts_and_leaves_the_rest_to_the_masked_lm(weights_dir):
    import dataclasses
    import math

    from model.formats.checkpoint import CheckpointError
    from model.formats.manifest import RescoreSpec
    from service.models.memory import weights_bytes

    spec = RescoreSpec(weights_dir / "generate-tiny", candidates=6, mlm_weight=0.5, context=8)
    ckpt = dataclasses.replace(load(weights_dir / "fill-mask-tiny"), fill_rescore=spec)
    settings = settings_for(weights_dir, warmup=False)
    engines = [EncoderEngine("fill-mask-tiny", load(weights_dir / "fill-mask-tiny"), settings, Metrics()),
               EncoderEngine("fill-mask-tiny", ckpt, settings, Metrics()),
               EncoderEngine("fill-mask-tiny", ckpt, settings_for(weights_dir, warmup=False, fill_mask_rescore=False),
                             Metrics())]
    plain_engine, engine, off = engines
    assert engine.rescorer is not None and off.rescorer is None and plain_engine.rescorer is None
    for e in engines:
        await e.start()
    try:
        texts = ["the quick brown [MASK] jumps over", "[MASK] the [MASK]"]
        rows = engine.tokenize(texts, "text")
        plain = await plain_engine.fill_mask(rows, 8, texts)
        got = await engine.fill_mask(rows, 8, texts)
        assert await off.fill_mask(rows, 8, texts) == plain  # switched off: the masked LM's answers
        assert await engine.fill_mask(rows, 8) == plain  # without the texts as sent: the same
        assert got[1] == plain[1]  # two masks in one text: not re-ranked
        # one mask, top_k 8 > the rescorer's 6 candidates: all 8 re-ranked, the scores descending
        first = plain[0][0]
        words = [[engine.tokenizer.id_to_token(c["token"]) for c in first]]
        (order,) = engine.rescorer.rerank(texts[:1], "[MASK]", words, [[math.log(c["score"]) for c in first]])
        assert [c["token"] for c in got[0][0]] == [first[i]["token"] for i, _ in order]
        assert [c["score"] for c in got[0][0]] == pytest.approx([s for _, s in order], rel=1e-5)
        assert [c["token"] for c in got[0][0]] != [c["token"] for c in first]  # it did reorder here
        scores = [c["score"] for c in got[0][0]]
        assert scores == sorted(scores, reverse=True)
        few = await engine.fill_mask(rows[:1], 2, texts[:1])  # top_k 2: the best 2 of 6 re-ranked
        (order6,) = engine.rescorer.rerank(texts[:1], "[MASK]", [words[0][:6]],
                                           [[math.log(c["score"]) for c in first[:6]]])
        assert [c["token"] for c in few[0][0]] == [first[i]["token"] for i, _ in order6[:2]]
        sequences = {c["token"]: (c["sequence"], c["token_str"]) for c in plain[0][0]}
        assert all(sequences[c["token"]] == (c["sequence"], c["token_str"]) for c in got[0][0])
        # the causal LM's weights count as this model's memory (the registry's budget reads it)
        extra = engine.memory()["weights_bytes"] - plain_engine.memory()["weights_bytes"]
        assert extra >= weights_bytes(engine.rescorer.model) > 0
    finally:
        for e in engines:
            await e.stop(1.0)
    missing = dataclasses.replace(ckpt, fill_rescore=dataclasses.replace(spec, model=weights_dir / "no-such-model"))
    with pytest.raises(CheckpointError, match="rescorer 'no-such-model' cannot be loaded.*FILL_MASK_RESCORE=false"):
        EncoderEngine("fill-mask-tiny", missing, settings, Metrics())
