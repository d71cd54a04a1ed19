"""What a model is, before it loads: /v1/models shows each model's card from its files
(``model.formats.card``, ``service.models.facts.file_card``) with the fields a load gives, equal to
what it says once loaded; the fields only a load knows are null and named in ``until_loaded``. And
drop-in requests that name no model load their task's default, with nothing loaded before."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from deepl import Translator
from libretranslatepy import LibreTranslateAPI

from service.http.app import create_app
from tests.model.gguf_lineages import write_lineage_gguf
from tests.service.conftest import REPO, settings_for, wait_ready
from tests.service.server_thread import ServerThread
from tests.service.test_chat import make_chat_weights

# what the card says before a load and must still say after it
SAME = ("family", "task", "architecture", "chat", "tools", "tool_format", "tool_prompt", "structured_outputs",
        "context_length", "max_seq_len", "parameters", "language_pair", "metrics", "sampling_defaults",
        "source_bytes")
TOOLS_TEMPLATE = ("{% if tools %}{% for t in tools %}<tool_call>{{ t | tojson }}</tool_call>{% endfor %}{% endif %}"
                  "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """Tiny models of each family (ours), a chat model, a Qwen2 GGUF whose template takes tools,
    the real embedding model, and a translation model named for its pair."""
    root = make_chat_weights(tmp_path_factory.mktemp("card-weights"))
    write_lineage_gguf(root / "qwen2-tools.gguf", "qwen2", chat_template=TOOLS_TEMPLATE)
    (root / "all-minilm-l6-v2").symlink_to(REPO / "weights" / "all-minilm-l6-v2", target_is_directory=True)
    (root / "translate-tiny-en-de").symlink_to(root / "translate-tiny", target_is_directory=True)
    return root


def asgi_client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=600)


async def listed(c: httpx.AsyncClient) -> dict[str, dict]:
    r = await c.get("/v1/models")
    assert r.status_code == 200, r.text
    return {m["id"]: m for m in r.json()["data"]}


async def check_cards_equal_loads(c: httpx.AsyncClient, names: list[str]) -> dict[str, dict]:
    before = await listed(c)
    assert sorted(before) == sorted(names)
    for name in names:
        card = before[name]
        assert card["state"] == "available" and card["card_error"] is None, card
        assert card["memory"]["total_bytes"] == 0
        assert card["until_loaded"] and all(_field(card, f) is None for f in card["until_loaded"]), card
        r = await c.post("/models/load", json={"model": name})
        assert r.status_code == 200, r.text
        loaded = (await c.get(f"/v1/models/{name}")).json()
        assert loaded["state"] == "loaded" and loaded["until_loaded"] == []
        assert {f: card.get(f) for f in SAME} == {f: loaded.get(f) for f in SAME}, name
        assert card["quantization"]["source"] == loaded["quantization"]["source"]
        assert all(_field(loaded, f) is not None for f in card["until_loaded"] if f != "prefix_cache"), loaded
        assert (await c.post("/models/unload", json={"model": name})).status_code == 200
    return before


def _field(card: dict, dotted: str):
    for part in dotted.split("."):
        card = card[part]
    return card


@pytest.mark.asyncio
async def test_every_card_before_a_load_says_what_the_load_says(weights):
    names = ["all-minilm-l6-v2", "chat-tiny", "fill-mask-tiny", "generate-tiny", "translate-tiny",
             "translate-tiny-en-de"]
    served = ",".join([*names, str(weights / "qwen2-tools.gguf")])  # a GGUF file is served by its path
    app = create_app(settings_for(weights, models=served, preload="none", max_seq_len=0))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        names.append("qwen2-tools")
        cards = await check_cards_equal_loads(c, names)
    assert cards["qwen2-tools"]["tool_format"] == "hermes" and cards["qwen2-tools"]["tool_prompt"] == "template"
    assert cards["chat-tiny"]["chat"] and cards["chat-tiny"]["tool_format"] == "generic"
    assert not cards["generate-tiny"]["chat"] and cards["generate-tiny"]["tools"] is False
    assert cards["all-minilm-l6-v2"]["task"] == "feature-extraction" and cards["fill-mask-tiny"]["task"] == "fill-mask"
    assert cards["translate-tiny-en-de"]["language_pair"] == ["en", "de"]
    assert cards["translate-tiny"]["language_pair"] is None


@pytest.mark.slow
@pytest.mark.asyncio
async def test_shipped_models_with_preload_none(tmp_path, monkeypatch):
    """The issue's "done when": with TSERVE_PRELOAD=none, each shipped model's task, family, chat and
    tools flags, context length and parameters are what it says once loaded."""
    shipped = ["generate-en", "translate-en-de", "all-minilm-l6-v2", "fill-mask-en", "smollm2-135m-instruct",
               "gemma3-270m"]
    app = create_app(settings_for(REPO / "weights", models=",".join(shipped), preload="none", max_seq_len=0,
                                  warmup=False, fill_mask_rescore=False))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        cards = await check_cards_equal_loads(c, shipped)
    assert cards["smollm2-135m-instruct"]["chat"] and cards["smollm2-135m-instruct"]["tools"]
    assert cards["gemma3-270m"]["task"] == "text-generation" and not cards["gemma3-270m"]["chat"]
    assert cards["translate-en-de"]["language_pair"] == ["en", "de"]


def states(url: str) -> dict[str, str]:
    return {m["id"]: m["state"] for m in httpx.get(url + "/v1/models").json()["data"]}


def test_drop_in_requests_without_a_model_load_their_default(weights):
    models = "generate-tiny,chat-tiny,fill-mask-tiny,translate-tiny-en-de,all-minilm-l6-v2"
    with ServerThread(settings_for(weights, models=models, preload="none", max_seq_len=128)) as srv:
        assert set(states(srv.url).values()) == {"available"}
        text = LibreTranslateAPI(srv.url).translate("Open the file menu", "en", "de")
        assert isinstance(text, str) and text
        assert states(srv.url)["translate-tiny-en-de"] == "loaded"
        assert [s for s in states(srv.url).values()].count("loaded") == 1
        assert httpx.post(srv.url + "/models/unload", json={"model": "translate-tiny-en-de"}).status_code == 200

        result = Translator("any-key", server_url=srv.url).translate_text("Open the file menu", target_lang="DE")
        assert result.detected_source_lang == "EN" and isinstance(result.text, str)
        assert states(srv.url)["translate-tiny-en-de"] == "loaded"

        r = httpx.post(srv.url + "/embed", json={"inputs": "A sentence to embed."}, timeout=120)
        assert r.status_code == 200, r.text
        assert states(srv.url)["all-minilm-l6-v2"] == "loaded"  # TEI's task: the embedding model, not fill-mask
        reference = httpx.post(srv.url + "/v1/embeddings", json={"input": "A sentence to embed.",
                                                                 "model": "all-minilm-l6-v2"}).json()
        np.testing.assert_allclose(r.json()[0], reference["data"][0]["embedding"], atol=1e-6)
        assert states(srv.url)["fill-mask-tiny"] == "available"

        r = httpx.post(srv.url + "/generate", json={"inputs": "To be", "parameters": {"max_new_tokens": 3}})
        assert r.status_code == 200, r.text
        assert states(srv.url)["chat-tiny"] == "loaded"  # text generation's default: the chat model
        assert states(srv.url)["generate-tiny"] == "available"


def test_the_hf_root_and_a_default_setting_load_on_demand(weights):
    settings = settings_for(weights, models="generate-tiny,chat-tiny,fill-mask-tiny,translate-tiny-en-de",
                            preload="none", max_seq_len=128, default_generation_model="generate-tiny")
    with ServerThread(settings) as srv:
        r = httpx.post(srv.url + "/", json={"inputs": "the [MASK] menu", "parameters": {"top_k": 2}}, timeout=120)
        assert r.status_code == 200 and len(r.json()) == 2, r.text
        assert states(srv.url) == {"generate-tiny": "available", "chat-tiny": "available",
                                   "fill-mask-tiny": "loaded", "translate-tiny-en-de": "available"}
        r = httpx.post(srv.url + "/", json={"inputs": "Open the file", "parameters": {"src_lang": "en",
                                                                                     "tgt_lang": "de"}})
        assert r.status_code == 200 and "translation_text" in r.json()[0], r.text
        r = httpx.post(srv.url + "/", json={"inputs": "To be", "parameters": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text
        assert states(srv.url)["generate-tiny"] == "loaded"  # TSERVE_DEFAULT_GENERATION_MODEL, though chat-tiny chats
        assert states(srv.url)["chat-tiny"] == "available"


@pytest.mark.asyncio
async def test_models_counts_parameters_without_unpacking_int8_weights(weights_dir, monkeypatch):
    """A loaded model's count is taken before its projections become int8: afterwards a
    ``RowwiseInt8``'s bias is found by unpacking its fbgemm weights, which took /v1/models 41-65 s
    (the event loop with it) for Qwen2.5-Coder 1.5B."""
    from model.quant.int8 import RowwiseInt8

    app = create_app(settings_for(weights_dir))
    async with app.router.lifespan_context(app), asgi_client(app) as c:
        await wait_ready(c)
        engine = app.state.registry.engines["translate-tiny"]
        assert any(isinstance(m, RowwiseInt8) for m in engine.model.modules())  # the case in question
        counted = engine.model.num_parameters()

        def unpacks(self):
            raise AssertionError("/v1/models unpacked int8 weights")

        monkeypatch.setattr(RowwiseInt8, "float_weights", unpacks)
        listed = {m["id"]: m for m in (await c.get("/v1/models")).json()["data"]}
        assert listed["translate-tiny"]["parameters"] == counted
