"""model.encoder.EncoderCore on tiny real checkpoints (a Hugging Face BERT masked LM, a
sentence-transformers directory): its answers against a direct forward pass of the same model,
batched against alone, and the rescorer's order where one is set."""

from __future__ import annotations

import math

import pytest
import torch

from model import load_model, save
from model.decode import DecodeOptions
from model.encoder import EncoderCore, EncoderJob
from model.encoder.rescore import FillRescorer
from model.formats.manifest import RescoreSpec
from model.nn.transformer import build_model
from model.tokenization.tokenizer import train_bpe
from tests.model.hf_tiny import ENGLISH, GERMAN, save_bert, save_sentence_transformer
from tests.model.nn.test_llama import llama_config
from tests.service.conftest import CORPUS

FILL = ["The quick brown [MASK] jumps over the lazy dog.", "Hello [MASK], how are you today?",
        "I like [MASK] apples and [MASK] cherries."]


@pytest.fixture(scope="module")
def mlm(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bert") / "bert"
    save_bert(directory, seed=4)
    return load_model(directory)


@pytest.fixture(scope="module")
def core(mlm):
    return EncoderCore(mlm)


def _direct_logprobs(ckpt, text: str) -> tuple[list[int], torch.Tensor]:
    """The mask positions of ``text`` and the log-probabilities there, special tokens excluded,
    from the model's own forward over the text alone."""
    ids = ckpt.tokenizer.encode(text)
    with torch.inference_mode():
        logits = ckpt.model(torch.tensor([ids]))[0].float()  # (T, V)
    where = [p for p, t in enumerate(ids) if t == ckpt.config.mask_token_id]
    at = logits[where]
    at[:, sorted(ckpt.tokenizer.special_ids)] = float("-inf")
    return where, at.log_softmax(-1)


def test_fill_mask_top_k_is_the_forward_pass_argsort(core, mlm):
    answers = core.fill_mask(FILL, top_k=5)
    assert [len(per_text) for per_text in answers] == [1, 1, 2]  # one list per mask
    for text, per_text in zip(FILL, answers):
        where, logp = _direct_logprobs(mlm, text)
        for pos, at, candidates in zip(where, logp, per_text):
            assert [c["token"] for c in candidates] == at.argsort(descending=True)[:5].tolist()
            for c in candidates:
                assert math.isclose(c["score"], at[c["token"]].exp().item(), rel_tol=1e-5)
                assert c["token_str"] == mlm.tokenizer.decode([c["token"]]).strip()
            filled = mlm.tokenizer.encode(text)
            filled[pos] = candidates[0]["token"]
            assert candidates[0]["sequence"] == mlm.tokenizer.decode(filled)
            assert not {c["token"] for c in candidates} & mlm.tokenizer.special_ids


def test_a_batch_answers_each_job_as_alone(core):
    jobs = [EncoderJob("fill_mask", core.encode(FILL[:2]), 3, FILL[:2]),
            EncoderJob("embed", core.encode(ENGLISH[:3])),
            EncoderJob("fill_mask", core.encode(FILL[2:]), 4, FILL[2:]),
            EncoderJob("embed_raw", core.encode(GERMAN[:2] + ["a"]))]
    together = core.run(jobs)
    for job, got in zip(jobs, together):
        (alone,) = core.run([job])
        if job.kind == "fill_mask":
            assert [[[c["token"] for c in m] for m in t] for t in got] == \
                [[[c["token"] for c in m] for m in t] for t in alone]
            scores = [c["score"] for t in got for m in t for c in m]
            assert scores == pytest.approx([c["score"] for t in alone for m in t for c in m], rel=1e-5)
        else:
            assert torch.tensor(got) == pytest.approx(torch.tensor(alone), abs=1e-5)


def test_embeddings_pool_as_the_model_and_normalise(core, mlm):
    texts = ENGLISH[:4]
    unit, raw = core.embed(texts), core.embed(texts, normalize=False)
    unit, raw = torch.tensor(unit), torch.tensor(raw)
    assert unit.shape == raw.shape == (4, mlm.config.d_model)
    assert unit.norm(dim=-1) == pytest.approx(torch.ones(4), abs=1e-5)
    assert unit == pytest.approx(torch.nn.functional.normalize(raw, dim=-1), abs=1e-6)
    for text, row in zip(texts, raw):  # mean over the text's tokens, alone and unpadded
        with torch.inference_mode():
            hidden = mlm.model.hidden_states(torch.tensor([mlm.tokenizer.encode(text)]))[0]
        assert row == pytest.approx(hidden.mean(0).float(), abs=1e-5)


@pytest.mark.parametrize("pooling", ["cls", "max"])
def test_embeddings_follow_the_sentence_transformers_config(tmp_path, pooling):
    st = load_model(save_sentence_transformer(tmp_path / "st", pooling, normalize=False, max_seq_length=8))
    core = EncoderCore(st)
    assert core.mask_id is None and core.max_len == 8
    long = ENGLISH[0] + " " + ENGLISH[1]
    (row,) = torch.tensor(core.embed([long]))  # not normalised: the checkpoint says so
    ids = st.tokenizer.encode(long)[:7] + [st.tokenizer.encode("")[-1]]  # cut at 8, [SEP] kept
    with torch.inference_mode():
        hidden = st.model.hidden_states(torch.tensor([ids]))[0]
    expected = hidden[0] if pooling == "cls" else hidden.amax(0)
    assert row == pytest.approx(expected.float(), abs=1e-5)
    with pytest.raises(ValueError, match="at most 8"):
        core.embed([long], truncate=False)
    with pytest.raises(ValueError, match="without a masked-LM head"):
        core.fill_mask(["a [MASK]"])


def test_fill_mask_needs_a_mask(core):
    with pytest.raises(ValueError, match=r"text\[1\] must contain the mask token \[MASK\]"):
        core.fill_mask([FILL[0], "no mask here"])


def test_the_rescorer_reorders_one_mask_texts(tmp_path, mlm):
    bpe = train_bpe(CORPUS, vocab_size=320, template="<s> $A")
    lm_dir = tmp_path / "lm"
    save(lm_dir, build_model(llama_config(vocab_size=bpe.vocab_size, max_positions=256, bos_token_id=1,
                                          eos_token_id=2)).init_weights(7).eval(), bpe)
    spec = RescoreSpec(lm_dir, candidates=6, mlm_weight=0.5, context=4)
    rescorer = FillRescorer(load_model(lm_dir), spec, DecodeOptions(quantize="none", kv_dtype="float32"))
    plain, rescored = EncoderCore(mlm), EncoderCore(mlm, rescorer=rescorer)
    got = rescored.fill_mask(FILL, top_k=3)
    assert got[2] == plain.fill_mask(FILL, top_k=3)[2]  # two masks: the masked LM's answer
    for text, (answer,) in zip(FILL[:2], got[:2]):
        where, logp = _direct_logprobs(mlm, text)
        top, tokens = logp[0].topk(6)
        words = [[mlm.tokenizer.id_to_token(t) for t in tokens.tolist()]]
        (order,) = rescorer.rerank([text], "[MASK]", words, [top.tolist()])
        assert [c["token"] for c in answer] == [tokens[i].item() for i, _ in order[:3]]
        assert [c["score"] for c in answer] == pytest.approx([s for _, s in order[:3]], rel=1e-5)
