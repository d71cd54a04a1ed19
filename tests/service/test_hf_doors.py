"""Hugging Face's InferenceClient at the doors a user is given as an endpoint URL: our task routes
take the HF task shape ``{"inputs", "parameters"}`` (``service/routes/compat/hf_task_doors.py``),
``GET <route>/info`` describes that task's model (TEI's /info for embeddings), and
``chat_completion`` without a model (the client sends ``"dummy"``) reaches the default chat model.

One server: tiny random models (translation, fill-mask, a Qwen-like chat model) and the
real all-MiniLM-L6-v2. Random models write nonsense: this checks paths, shapes and errors, and that
each door answers what the task's own route answers.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import huggingface_hub
import huggingface_hub.constants
import huggingface_hub.errors
import numpy as np
import pytest

from tests.service.conftest import settings_for
from tests.service.server_thread import ServerThread
from tests.service.test_tool_formats import make_weights

REPO = Path(__file__).resolve().parents[2]
MASKED = "The quick brown [MASK] jumps."


@pytest.fixture(scope="module")
def server(weights_dir, tmp_path_factory):
    root = make_weights(tmp_path_factory.mktemp("hf-doors"))  # qwen-tiny: a chat template, tools
    for name, source in (("translate-tiny-en-de", "translate-tiny"),
                         ("fill-mask-tiny", "fill-mask-tiny")):
        (root / name).symlink_to(weights_dir / source, target_is_directory=True)
    (root / "all-minilm-l6-v2").symlink_to(REPO / "weights" / "all-minilm-l6-v2", target_is_directory=True)
    settings = settings_for(root, max_seq_len=1024, default_generation_model="qwen-tiny")
    with ServerThread(settings) as srv:
        yield srv


@pytest.fixture(autouse=True)
def online(monkeypatch):
    # HF_HUB_OFFLINE (set by the HF parity tests) also blocks a local base_url; nothing here reaches a hub
    monkeypatch.setattr(huggingface_hub.constants, "is_offline_mode", lambda: False)


def door(server, path: str) -> huggingface_hub.InferenceClient:
    return huggingface_hub.InferenceClient(base_url=server.url + path, api_key="unused")


def endpoint_info(url: str) -> dict:
    # with base_url set the client refuses get_endpoint_info; given the URL as the model it reads URL/info
    return huggingface_hub.InferenceClient(provider="hf-inference").get_endpoint_info(model=url)


def test_fill_mask_door_takes_the_task_shape(server):
    results = door(server, "/v1/fill-mask").fill_mask(MASKED, top_k=3)  # posts {"inputs", "parameters"}
    own = httpx.post(server.url + "/v1/fill-mask", json={"text": MASKED, "top_k": 3}).json()
    assert [(r.token_str, round(r.score, 6)) for r in results] == [(o["token_str"], round(o["score"], 6))
                                                                     for o in own]
    r = httpx.post(server.url + "/v1/fill-mask", json={"inputs": MASKED, "parameters": {"top_k": 500}})
    assert r.status_code == 422 and "top_k" in r.json()["error"]  # HF's error shape, naming the limit
    assert r.json()["error_type"] == "validation" and "[1, 100]" in r.json()["error"]


def test_embeddings_door_takes_the_task_shape_and_its_info_is_teis(server):
    client = door(server, "/v1/embeddings")
    text = "A sentence to embed, naïve café."
    vector = client.feature_extraction(text)
    own = httpx.post(server.url + "/v1/embeddings", json={"input": text, "model": "all-minilm-l6-v2"}).json()
    assert vector.shape == (1, 384)
    np.testing.assert_allclose(vector[0], own["data"][0]["embedding"], atol=1e-6)
    raw = client.feature_extraction(text, normalize=False)
    assert abs(float(np.linalg.norm(raw)) - 1.0) > 1e-3  # the option reached the model
    r = httpx.post(server.url + "/v1/embeddings", json={"inputs": ""})
    assert r.status_code == 400 and r.json()["error_type"] == "Empty"  # TEI's error shape
    # GET <endpoint>/info: the embedding model, in TEI's shape, though a generation model is served too
    info = endpoint_info(server.url + "/v1/embeddings")
    assert info["model_id"] == "all-minilm-l6-v2" and info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["max_input_length"] == 256  # sentence-transformers' max_seq_length for this model
    assert httpx.get(server.url + "/info").json()["model_id"] == "qwen-tiny"  # the root stays TGI's


def test_generate_door_takes_the_task_shape_plain_and_streamed(server):
    client = door(server, "/v1/generate")
    text = client.text_generation("To be, or not", max_new_tokens=6)
    own = httpx.post(server.url + "/v1/generate", json={"model": "qwen-tiny", "prompt": "To be, or not",
                                                        "max_tokens": 6, "temperature": 0}).json()
    assert text == own["text"]  # TGI's default is greedy, as temperature 0 is here
    out = client.text_generation("To be, or not", max_new_tokens=6, details=True)
    assert out.generated_text == text and out.details.generated_tokens == own["usage"]["completion_tokens"]
    assert "".join(client.text_generation("To be, or not", max_new_tokens=6, stream=True)) == text
    info = endpoint_info(server.url + "/v1/generate")
    assert info["model_id"] == "qwen-tiny" and info["model_pipeline_tag"] == "text-generation"


def test_translate_door_takes_the_task_shape(server):
    client = door(server, "/v1/translate")
    out = client.translation("Open the file menu", src_lang="en", tgt_lang="de")
    own = httpx.post(server.url + "/v1/translate", json={"text": "Open the file menu"}).json()
    assert out.translation_text == own["translations"][0]["text"]
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError):  # no de -> en model: a client error
        client.translation("Hallo", src_lang="de", tgt_lang="en")


def test_own_bodies_are_unchanged_and_a_mixed_body_is_still_refused(server):
    r = httpx.post(server.url + "/v1/fill-mask", json={"inputs": MASKED, "top_k": 2})  # our alias of text
    assert r.status_code == 200 and len(r.json()) == 2
    r = httpx.post(server.url + "/v1/generate", json={"prompt": "To be", "inputs": "To be"})
    assert r.status_code == 400 and "inputs" in r.json()["error"]["message"]  # our shape: an unknown field


def test_chat_completion_without_a_model_reaches_the_default_chat_model(server):
    # InferenceClient(base_url=ROOT).chat_completion sends model "dummy" (TGI answers any name)
    out = door(server, "").chat_completion([{"role": "user", "content": "Say hello."}], max_tokens=4)
    assert out.model == "qwen-tiny" and out.usage.completion_tokens <= 4
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError) as err:
        door(server, "").chat_completion([{"role": "user", "content": "Hi"}], model="no-such-model", max_tokens=2)
    assert err.value.response.status_code == 404
