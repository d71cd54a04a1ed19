"""model.encoder.rescore: a causal LM re-ranks a masked LM's fill-mask candidates.

The scores are checked against the plainest reference there is: each filled-in text run whole
through the model's own forward, its token log-probabilities summed."""

from __future__ import annotations

import json

import pytest
import torch

from model import load_model, save
from model.decode import DecodeOptions
from model.encoder import rescore
from model.encoder.rescore import LEFT_CONTEXT, FillRescorer, filled
from model.formats.manifest import ManifestError, RescoreSpec, read_manifest
from model.nn.transformer import build_model
from model.tokenization.tokenizer import train_bpe
from tests.model.nn.test_llama import llama_config
from tests.service.conftest import CORPUS

GROUP = ["The quick brown fox jumps over the lazy dog.", "The quick brown cat jumps over the lazy dog.",
         "The quick brown lazy jumps over the lazy dog.", "The quick brown whether jumps over the lazy dog."]


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    """A tiny Llama-style decoder (the native step runs it) with a real BPE tokenizer."""
    bpe = train_bpe(CORPUS, vocab_size=320, template="<s> $A")
    cfg = llama_config(vocab_size=bpe.vocab_size, max_positions=256, bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("lm") / "lm-tiny"
    save(path, build_model(cfg).init_weights(7).eval(), bpe)
    return path


def _rescorer(lm_dir, context: int = 64, **options) -> FillRescorer:
    spec = RescoreSpec(lm_dir, candidates=4, mlm_weight=0.5, context=context)
    return FillRescorer(load_model(lm_dir), spec, DecodeOptions(quantize="none", kv_dtype="float32", **options))


@torch.inference_mode()
def _whole(r: FillRescorer, text: str) -> float:
    """The reference: log P(text) from one plain forward over the whole text."""
    ids = torch.tensor([r.encode(text)])
    logp = r.model(ids)[0].float().log_softmax(-1)
    return float(logp[:-1].gather(-1, ids[0, 1:, None]).sum())


@pytest.mark.parametrize("native", ["off", "on"])
def test_scores_differ_between_candidates_as_the_whole_texts_log_probabilities_do(lm_dir, native):
    r = _rescorer(lm_dir, native=native)
    assert (r.native is not None) == (native == "on")
    got = r.logprobs([GROUP, GROUP[:2]])
    want = [_whole(r, t) for t in GROUP]
    for scores, n in zip(got, (4, 2)):
        for i in range(n):  # the shared beginning cancels: differences are the whole texts'
            assert scores[i] - scores[0] == pytest.approx(want[i] - want[0], abs=2e-3)
    assert len(set(got[0])) == 4  # the candidates really differ


@pytest.mark.parametrize("native", ["off", "on"])
def test_a_shared_step_scores_as_an_own_copy_and_holds_the_lock(lm_dir, native):
    """A served decoder's model and prepared step, shared: the same scores bit for bit as a
    rescorer that loads and prepares its own copy, every pass through the LM under the lock."""
    import threading

    from model.decode import prepare

    options = DecodeOptions(quantize="none", kv_dtype="float32", native=native)
    own = FillRescorer(load_model(lm_dir), RescoreSpec(lm_dir, 4, 0.5, 64), options)
    served = load_model(lm_dir)
    step = prepare(served.model, options, served.tokenizer)

    class CountingLock:
        def __init__(self):
            self.lock, self.entered = threading.Lock(), 0

        def __enter__(self):
            self.lock.acquire()
            self.entered += 1

        def __exit__(self, *exc):
            self.lock.release()

    lock = CountingLock()
    shared = FillRescorer(served, RescoreSpec(lm_dir, 4, 0.5, 64), step=step, lock=lock)
    assert shared.shared and not own.shared and shared.model is served.model
    assert (shared.native is step) == (native == "on")
    text, words = "The quick brown [MASK] jumps over the lazy dog.", [["fox", "cat", "lazy", "whether"]]
    assert shared.logprobs([GROUP]) == own.logprobs([GROUP])
    assert shared.rerank([text], "[MASK]", words, [[-0.5, -1.5, -2.5, -3.0]]) == \
        own.rerank([text], "[MASK]", words, [[-0.5, -1.5, -2.5, -3.0]])
    assert lock.entered >= 3 and not lock.lock.locked()


def test_context_limits_the_scored_tokens_after_the_word(lm_dir):
    r = _rescorer(lm_dir, context=0)
    enc = [r.encode(t) for t in GROUP]
    start = rescore._common_prefix(enc)
    tail = rescore._common_suffix(enc, start)
    with torch.inference_mode():  # only the word's own tokens, given the text before it
        want = []
        for ids in enc:
            logp = r.model(torch.tensor([ids]))[0].float().log_softmax(-1)
            want.append(float(sum(logp[j - 1, ids[j]] for j in range(start, len(ids) - tail))))
    assert r.logprobs([GROUP])[0] == pytest.approx(want, abs=1e-3)
    assert r.logprobs([GROUP])[0] != pytest.approx(_rescorer(lm_dir).logprobs([GROUP])[0], abs=1e-3)


def test_spans_keep_bos_and_a_bounded_left_context():
    prefix = list(range(10, 10 + 200))
    seqs = [[1, *prefix, 5, 6, 7, 8], [1, *prefix, 9, 6, 7, 8], [1, *prefix, 9, 9, 6, 7, 8]]
    spans = rescore._scored_spans(seqs, context=2)
    for s, seq in zip(spans, seqs):
        assert s.ids[0] == 1 and s.first - 1 == LEFT_CONTEXT  # BOS, then the prefix's last LEFT_CONTEXT tokens
        assert s.ids[1:s.first] == prefix[-LEFT_CONTEXT:]
        assert s.ids[s.first:] == s.targets[:-1]  # the scored tokens are fed but the last
        cut = len(prefix) - LEFT_CONTEXT
        assert s.ids[1:] + s.targets[-1:] == seq[1 + cut:1 + cut + len(s.ids)]  # one run of the text
    assert [s.targets for s in spans] == [[5, 6, 7], [9, 6, 7], [9, 9, 6, 7]]  # the word, then 2 after
    same = rescore._scored_spans([[1, 4, 4], [1, 4, 4]], context=3)
    assert [s.targets for s in same] == [[], []]  # nothing differs: nothing to score


def test_rerank_orders_by_the_mixed_score_and_keeps_the_masked_lms_mass(lm_dir):
    r = _rescorer(lm_dir)
    text = "The quick brown [MASK] jumps over the lazy dog."
    words = [["fox", "cat", "lazy", "whether"]]
    mlm = [[-0.5, -1.5, -2.5, -3.0]]
    (order,) = r.rerank([text], "[MASK]", words, mlm)
    lm = r.logprobs([[filled(text, "[MASK]", w) for w in words[0]]])[0]
    mixed = [0.5 * a + b for a, b in zip(mlm[0], lm)]
    assert [i for i, _ in order] == sorted(range(4), key=lambda i: -mixed[i])
    scores = [s for _, s in order]
    assert scores == sorted(scores, reverse=True)
    assert sum(scores) == pytest.approx(sum(torch.tensor(mlm[0]).exp().tolist()), rel=1e-6)


@pytest.mark.parametrize("text,word,want", [
    ("The capital of France is [MASK].", "paris", "The capital of France is paris."),
    ("[MASK] is the capital.", "paris", "Paris is the capital."),
    ("It rained. [MASK] stayed in.", "we", "It rained. We stayed in."),
    ('He said "[MASK] are late."', "you", 'He said "you are late."'),
    ('Stop! "[MASK] now," she said.', "go", 'Stop! "Go now," she said.'),
    ("I was walk [MASK] home.", "##ing", "I was walking home."),
    ("Hello [MASK]", ",", "Hello ,"),
])
def test_filled_text(text, word, want):
    assert filled(text, "[MASK]", word) == want


def _manifest(tmp_path, **extra) -> dict:
    data = {"format": "sentence-transformers", "package": "p", "version": "1", "file": "m/model.safetensors",
            "sha256": "0" * 64, "licence": "MIT", "mlm_head": {"file": "h.safetensors", "sha256": "1" * 64}}
    data.update(extra)
    (tmp_path / "fill").mkdir(exist_ok=True)
    (tmp_path / "fill" / "manifest.json").write_text(json.dumps(data))
    return data


def test_manifest_rescore_field(tmp_path):
    _manifest(tmp_path, rescore={"model": "lm-tiny", "candidates": 20, "mlm_weight": 0.25, "context": 8})
    spec = read_manifest(tmp_path / "fill").rescore
    assert spec == RescoreSpec(tmp_path / "lm-tiny", 20, 0.25, 8)  # a sibling of the manifest's directory
    bad = [({"model": "../x", "candidates": 20, "mlm_weight": 0.25, "context": 8}, "rescore.model"),
           ({"model": "lm", "candidates": 1, "mlm_weight": 0.25, "context": 8}, "rescore.candidates"),
           ({"model": "lm", "candidates": 20, "mlm_weight": 0.25, "context": 99}, "rescore.context"),
           ({"model": "lm", "candidates": True, "mlm_weight": 0.25, "context": 8}, "'rescore' must be"),
           ({"model": "lm", "candidates": 20}, "'rescore' must be")]
    for field, words in bad:
        _manifest(tmp_path, rescore=field)
        with pytest.raises(ManifestError, match=words):
            read_manifest(tmp_path / "fill")
    data = _manifest(tmp_path, rescore={"model": "lm", "candidates": 20, "mlm_weight": 0.25, "context": 8})
    del data["mlm_head"]
    (tmp_path / "fill" / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="needs a masked-LM head"):
        read_manifest(tmp_path / "fill")


def test_a_rescorer_must_be_a_decoder(tmp_path):
    from tests.service.conftest import make_weights

    weights = make_weights(tmp_path)
    with pytest.raises(ValueError, match="must be a decoder-only language model"):
        FillRescorer(load_model(weights / "translate-tiny"), RescoreSpec(weights / "translate-tiny", 4, 0.5, 8))


def test_lean_rescorer_drops_only_what_the_native_step_never_reads(lm_dir):
    """int8 under the native step: without the float copies and with a bfloat16 token table,
    the scores of the full model whose table was rounded alike, fewer bytes."""
    from model.decode import prepare_weights
    from model.quant.int8 import DecodeInt8Linear
    from service.models.memory import weights_bytes

    spec = RescoreSpec(lm_dir, candidates=4, mlm_weight=0.5, context=8)
    keep = DecodeOptions(quantize="int8", native="on", prefill="model")
    rounded = load_model(lm_dir)
    prepare_weights(rounded.model, keep, rounded.tokenizer)  # int8 from the float table, as the lean one
    with torch.no_grad():
        rounded.model.embed.tokens.weight.copy_(rounded.model.embed.tokens.weight.bfloat16().float())
    full = FillRescorer(rounded, spec, keep)
    lean = FillRescorer(load_model(lm_dir), spec, DecodeOptions(quantize="int8", native="on"))
    int8 = [m for m in lean.model.modules() if isinstance(m, DecodeInt8Linear)]
    assert int8 and all(m.dense is None for m in int8)
    assert all(m.dense is not None for m in full.model.modules() if isinstance(m, DecodeInt8Linear))
    assert lean.logprobs([GROUP]) == full.logprobs([GROUP])
    assert weights_bytes(lean.model) < weights_bytes(full.model)
