"""Speculative decoding with a draft model: greedy output with drafts equals greedy output without,
bit for bit at float32 (a draft that is the target itself: every draft kept; another random model
of the same vocabulary: most refused), through preemption, with the draft's rows given back when
their sequences finish; a draft of another vocabulary is refused, naming both models."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from model import SamplingParams
from model.engine import EngineCore, EngineRequest
from model.engine.draft_model import ModelDrafter, VocabularyMismatchError, check_vocabulary
from model.engine.speculative import SpeculativeConfig
from model.tokenization.tokenizer import train_bpe
from tests.conftest import tiny_model
from tests.model.engine.test_paged_cache import block_bytes, drain
from tests.model.engine.test_speculative import token_events

# drafts priced as free: the target as its own draft would cost as much as the target (which the
# estimate from their weights says), and these tests are about what verification keeps
DRAFT = SpeculativeConfig("draft", tokens=4, max_batch=64, draft_cost=0.0)
LLAMA = dict(vocab_size=512, d_model=64, max_positions=2048, positional="rope", norm="rmsnorm", mlp="gated",
             n_heads=4, n_kv_heads=2, activation="silu")


def lively(seed: int, **overrides):
    """A random model whose weights are 10x the usual initialisation: its greedy text wanders
    over the vocabulary instead of repeating one token (which any draft would guess)."""
    model = tiny_model("decoder", seed=seed, **{**LLAMA, **overrides})
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(10.0)
    return model


@pytest.fixture(scope="module")
def target():
    return lively(11)


@pytest.fixture(scope="module")
def other():
    """Another random model of the target's vocabulary, smaller: a draft the target mostly refuses."""
    return lively(12, n_decoder_layers=1)


def _requests(model, n: int, new: int) -> list[EngineRequest]:
    g = torch.Generator().manual_seed(7)
    return [EngineRequest(str(i), torch.randint(3, model.cfg.vocab_size, (20 + 7 * i,), generator=g).tolist(),
                          SamplingParams(max_new_tokens=new - 3 * i, temperature=0.0, ignore_eos=True, logprobs=1))
            for i in range(n)]


def _same(got: dict, expected: dict) -> None:
    """Tokens equal; logprobs as close as one row's float32 logits computed in another batch shape
    (as tests/model/engine/test_speculative.py holds prompt lookup's)."""
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in expected.items()}
    for rid, (_, logprobs) in expected.items():
        torch.testing.assert_close(torch.tensor(got[rid][1]), torch.tensor(logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("n", [1, 3], ids=["alone", "ragged-3"])
def test_the_target_as_its_own_draft_keeps_every_draft_and_the_greedy_output(target, n):
    reqs = _requests(target, n, 24)
    expected = token_events(EngineCore(target, None, n_slots=4, max_len=256), copy.deepcopy(reqs))
    core = EngineCore(target, None, n_slots=4, max_len=256, speculative=DRAFT, draft=target)
    _same(token_events(core, copy.deepcopy(reqs)), expected)
    assert core.drafted_tokens > 0 and core.accepted_tokens == core.drafted_tokens
    assert core.draft.rows_used == 0 and core.draft.cache.pool.used == 0


@pytest.mark.parametrize("n", [1, 3], ids=["alone", "ragged-3"])
def test_another_draft_is_mostly_refused_and_the_greedy_output_stays(target, other, n):
    reqs = _requests(target, n, 24)
    expected = token_events(EngineCore(target, None, n_slots=4, max_len=256), copy.deepcopy(reqs))
    core = EngineCore(target, None, n_slots=4, max_len=256, speculative=DRAFT, draft=other)
    _same(token_events(core, copy.deepcopy(reqs)), expected)
    assert 0 < core.drafted_tokens and core.accepted_tokens < core.drafted_tokens / 2
    assert core.draft.rows_used == 0 and core.draft.cache.pool.used == 0


def _draft_rows_belong_to_live_sequences(core: EngineCore) -> None:
    live = core.scheduler.running + core.scheduler.prefilling
    holders = [s for s in live if isinstance(s.drafter, ModelDrafter) and s.drafter.slot is not None]
    assert core.draft.rows_used == len(holders)
    held = sum(len(core.draft.cache.rows[s.drafter.slot]) for s in holders)
    assert core.draft.cache.pool.used == held  # no block outlives its row


def test_preemption_and_finishing_give_the_draft_rows_back_and_the_output_stays(target):
    """Six sequences in a pool of 12 blocks (the draft's pool as small): preempted and resumed
    many times, every stream equals the roomy run without drafts, and at every step the draft
    holds rows and blocks only for sequences in flight; at the end its pool is full again."""
    reqs = _requests(target, 6, 40)
    expected, errors = drain(EngineCore(target, None, n_slots=6, max_len=256), copy.deepcopy(reqs))
    assert not errors
    tight = EngineCore(target, None, n_slots=6, max_len=256, kv_cache_bytes=(1 + 12) * block_bytes(target),
                       speculative=DRAFT, draft=target)
    for r in copy.deepcopy(reqs):
        tight.add(r)
    got = {r.request_id: [] for r in reqs}
    while tight.has_work:
        for e in tight.step().events:
            assert e.error is None
            got[e.request_id] += e.token_ids
        _draft_rows_belong_to_live_sequences(tight)
    assert tight.scheduler.preemptions >= 3 and tight.accepted_tokens > 20
    assert got == expected
    assert tight.draft.rows_used == 0 and tight.draft.cache.pool.used == 0 and tight.cache.pool.used == 0


def test_an_aborted_sequence_gives_its_draft_row_back(target):
    core = EngineCore(target, None, n_slots=4, max_len=256, speculative=DRAFT, draft=target)
    for r in _requests(target, 2, 30):
        core.add(r)
    for _ in range(3):
        core.step()
    assert core.draft.rows_used == 2
    core.abort("0")
    _draft_rows_belong_to_live_sequences(core)
    assert core.draft.rows_used == 1
    core.abort("1")
    assert core.draft.rows_used == 0 and core.draft.cache.pool.used == 0


def test_a_step_with_more_sequences_than_max_batch_decodes_plainly(target):
    reqs = _requests(target, 3, 20)
    expected = token_events(EngineCore(target, None, n_slots=4, max_len=256), copy.deepcopy(reqs))
    spec = SpeculativeConfig("draft", tokens=4, max_batch=2, draft_cost=0.0)
    core = EngineCore(target, None, n_slots=4, max_len=256, speculative=spec, draft=target)
    _same(token_events(core, copy.deepcopy(reqs)), expected)
    assert core.drafted_tokens > 0  # drafted once the first sequence finished, not before


def _checkpoint(model, texts):
    return SimpleNamespace(config=model.cfg, tokenizer=train_bpe(texts, vocab_size=model.cfg.vocab_size))


def test_a_draft_of_another_vocabulary_is_refused_naming_both_models_and_the_first_difference(target, other):
    texts = ["def add(a, b):\n    return a + b\n" * 20, "the quick brown fox jumps over the lazy dog " * 20]
    t = _checkpoint(target, texts)
    check_vocabulary("big", t, "small", _checkpoint(other, texts))  # the same tokens: accepted
    with pytest.raises(VocabularyMismatchError, match=r"'small' and target 'big' differ at token id \d+"):
        check_vocabulary("big", t, "small", _checkpoint(other, ["lorem ipsum dolor sit amet " * 30]))
    narrow = lively(13, vocab_size=300)
    with pytest.raises(VocabularyMismatchError, match="'narrow' has 300 token ids and target 'big' 512"):
        check_vocabulary("big", t, "narrow", SimpleNamespace(config=narrow.cfg, tokenizer=None))
    with pytest.raises(ValueError, match="300 token ids and the model 512"):
        EngineCore(target, None, n_slots=2, max_len=64, speculative=DRAFT, draft=narrow)
    with pytest.raises(ValueError, match="needs a draft model"):
        EngineCore(target, None, n_slots=2, max_len=64, speculative=DRAFT)
