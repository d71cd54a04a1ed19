"""``POST /tokenize`` and ``/detokenize`` in vLLM's shape (and llama.cpp's fields): the counts are
the prompt tokens the generation routes report, the ids round-trip, bad input is a 400/404 naming
the field."""

from __future__ import annotations

import httpx
import pytest

HELLO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, café 🙂"}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_prompt_counts_are_the_completions_prompt_tokens_and_round_trip(doors_server):
    text = "To be, or not to be: naïve café 🙂"
    r = post(doors_server, "/tokenize", {"model": "chat-tiny", "prompt": text, "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
    assert len(body["token_strs"]) == body["count"] and all(isinstance(s, str) for s in body["token_strs"])
    completion = post(doors_server, "/v1/completions", {"model": "chat-tiny", "prompt": text, "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == body["count"]
    assert post(doors_server, "/detokenize", {"model": "chat-tiny", "tokens": body["tokens"]}).json() == {
        "prompt": text, "content": text}
    llama = post(doors_server, "/tokenize", {"content": text, "with_pieces": True}).json()  # llama.cpp's fields
    assert [t["id"] for t in llama["tokens"]] == body["tokens"]
    ascii_text = "To be, or not to be"  # a piece holding part of a UTF-8 character is its vocabulary entry
    pieces = post(doors_server, "/tokenize", {"content": ascii_text, "with_pieces": True}).json()["tokens"]
    assert "".join(t["piece"] for t in pieces) == ascii_text


def test_messages_count_is_the_chat_prompt(doors_server):
    r = post(doors_server, "/tokenize", {"model": "chat-tiny", "messages": HELLO}).json()
    chat = post(doors_server, "/v1/chat/completions", {"model": "chat-tiny", "messages": HELLO, "max_tokens": 1})
    assert r["count"] == chat.json()["usage"]["prompt_tokens"]
    bare = post(doors_server, "/tokenize", {"model": "chat-tiny", "messages": HELLO,
                                            "add_generation_prompt": False}).json()
    assert r["tokens"][:bare["count"]] == bare["tokens"] and bare["count"] < r["count"]
    assert post(doors_server, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"].endswith("assistant\n")


def test_add_special_tokens(tmp_path):
    from tests.service.conftest import make_weights, settings_for
    from tests.service.server_thread import ServerThread

    with ServerThread(settings_for(make_weights(tmp_path), models="generate-tiny")) as srv:  # its template: <s> $A
        with_bos = post(srv, "/tokenize", {"prompt": "To be"}).json()["tokens"]
        without = post(srv, "/tokenize", {"prompt": "To be", "add_special_tokens": False}).json()["tokens"]
        assert with_bos[1:] == without and len(with_bos) == len(without) + 1


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "no-such-model", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"model": "chat-tiny"}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": HELLO}, 400, "messages"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/detokenize", {"model": "chat-tiny", "tokens": [1, 10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"model": "no-such-model", "tokens": [1]}, 404, "model"),
])
def test_bad_input_names_the_field(doors_server, path, body, status, param):
    r = post(doors_server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
