"""Drop-in requests that name no model, or a placeholder, with several models of a task loaded:
each task has a default model (``TSERVE_DEFAULT_*_MODEL``; without one, the chat model for text
generation), used by the unmodified ``huggingface_hub.InferenceClient`` and described by ``/info``."""

from __future__ import annotations

import httpx
import huggingface_hub
import huggingface_hub.constants
import numpy as np
import pytest

from tests.service.conftest import REPO, settings_for
from tests.service.server_thread import ServerThread
from tests.service.test_chat import make_chat_weights


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """Two text-generation models (generate-tiny, and chat-tiny with a chat template), a fill-mask
    model and the real embedding model."""
    root = make_chat_weights(tmp_path_factory.mktemp("defaults-weights"))
    (root / "all-minilm-l6-v2").symlink_to(REPO / "weights" / "all-minilm-l6-v2", target_is_directory=True)
    return root


@pytest.fixture(autouse=True)
def online(monkeypatch):
    # HF_HUB_OFFLINE (set by the HF parity tests) also blocks a local base_url; nothing here reaches a hub.
    monkeypatch.setattr(huggingface_hub.constants, "is_offline_mode", lambda: False)


def generate(url: str, model: str | None, prompt: str, n: int) -> str:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": n}} | ({"model": model} if model is not None else {})
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["generated_text"]


def test_inference_client_without_a_model_gets_each_tasks_default(weights):
    with ServerThread(settings_for(weights, models="generate-tiny,chat-tiny,fill-mask-tiny,all-minilm-l6-v2",
                                   max_seq_len=128)) as srv:
        client = huggingface_hub.InferenceClient(base_url=srv.url, api_key="unused")
        text = client.text_generation("To be, or not to be", max_new_tokens=8)  # was a 400: two models could answer
        assert text == generate(srv.url, "chat-tiny", "To be, or not to be", 8)  # the chat model by default
        assert text != generate(srv.url, "generate-tiny", "To be, or not to be", 8)
        streamed = "".join(client.text_generation("To be, or not to be", max_new_tokens=8, stream=True))
        assert streamed == text
        for placeholder in ("tgi", "dummy", "", srv.url):
            assert generate(srv.url, placeholder, "To be, or not to be", 8) == text, placeholder
        info = httpx.get(srv.url + "/info").json()
        assert info["model_id"] == "chat-tiny" and info["max_total_tokens"] == 128
        vector = client.feature_extraction("A sentence to embed.")
        reference = httpx.post(srv.url + "/v1/embeddings", json={"input": "A sentence to embed.",
                                                                 "model": "all-minilm-l6-v2"}).json()
        np.testing.assert_allclose(vector[0], reference["data"][0]["embedding"], atol=1e-6)
        r = httpx.post(srv.url + "/embed", json={"model": "tei", "inputs": "A sentence to embed."})
        np.testing.assert_allclose(r.json()[0], reference["data"][0]["embedding"], atol=1e-6)
        assert len(client.fill_mask("The [MASK] of the river.", top_k=2)) == 2


def test_default_models_are_settings(weights):
    settings = settings_for(weights, models="generate-tiny,chat-tiny,fill-mask-tiny", max_seq_len=128,
                            default_generation_model="generate-tiny")
    with ServerThread(settings) as srv:
        client = huggingface_hub.InferenceClient(base_url=srv.url, api_key="unused")
        assert client.text_generation("To be", max_new_tokens=6) == generate(srv.url, "generate-tiny", "To be", 6)
        assert httpx.get(srv.url + "/info").json()["model_id"] == "generate-tiny"
    wrong = settings_for(weights, models="generate-tiny,chat-tiny", max_seq_len=128,
                         default_generation_model="fill-mask-tiny")
    with ServerThread(wrong) as srv:
        r = httpx.post(srv.url + "/generate", json={"inputs": "To be"})
        assert r.status_code == 422 and "TSERVE_DEFAULT_GENERATION_MODEL" in r.json()["error"]
        assert generate(srv.url, "generate-tiny", "To be", 2)  # a named model still answers
