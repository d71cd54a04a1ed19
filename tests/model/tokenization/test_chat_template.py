"""Chat templates render exactly as transformers' apply_chat_template does, and a template
cannot reach internals, mutate its inputs, loop forever or render megabytes."""

from __future__ import annotations

import threading
import time

import pytest

from model.tokenization.chat_template import (
    ChatMessageError,
    ChatTemplate,
    ChatTemplateError,
    render_chat,
    validate_messages,
)
from tests.model.gguf_tiny import CHATML, train_byte_bpe, transformers

LLAMA3_LIKE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Block tags on their own, indented lines: only right with trim_blocks and lstrip_blocks.
ZEPHYR_LIKE = """{% for message in messages %}
    {% if message['role'] == 'user' %}
<|user|>
{{ message['content'] }}{{ eos_token }}
    {% elif message['role'] == 'system' %}
<|system|>
{{ message['content'] }}{{ eos_token }}
    {% else %}
<|assistant|>
{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}
    {% endif %}
    {% if loop.last and add_generation_prompt %}
<|assistant|>
    {% endif %}
{% endfor %}"""
# Alternation enforced with raise_exception, a namespace, loop controls and tojson.
STRICT = """{% set ns = namespace(system='') %}
{% if messages[0]['role'] == 'system' %}{% set ns.system = messages[0]['content'] %}{% endif %}
{{ bos_token }}{{ ns.system | tojson }}
{% for message in messages if message['role'] != 'system' %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]{% else %}
{{ message['content'] }}{{ eos_token }}{% endif %}
    {% if loop.index > 10 %}{% break %}{% endif %}
{% endfor %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Wie geht's? 東京 🙂"}],
    [{"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "  Two\tthings:\n1. a\n2. b  "}],
    [{"role": "user", "content": "One"}, {"role": "assistant", "content": "Two"}, {"role": "user", "content": "\"3\""}],
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.PreTrainedTokenizerFast(tokenizer_object=train_byte_bpe(), bos_token="<|im_start|>",
                                                eos_token="<|im_end|>")


@pytest.mark.parametrize("source", [CHATML, LLAMA3_LIKE, ZEPHYR_LIKE, STRICT], ids=["chatml", "llama3", "zephyr",
                                                                                   "strict"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_like_apply_chat_template(source, add_generation_prompt, hf_tokenizer):
    template = ChatTemplate(source, bos_token=hf_tokenizer.bos_token, eos_token=hf_tokenizer.eos_token)
    for messages in CONVERSATIONS:
        expected = hf_tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False,
                                                    add_generation_prompt=add_generation_prompt)
        assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected


def test_raise_exception_is_a_template_error_with_its_message():
    with pytest.raises(ChatTemplateError, match=r"roles must alternate"):
        ChatTemplate(STRICT).render([{"role": "assistant", "content": "first"}])


def test_text_parts_are_joined():
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert render_chat(CHATML, [{"role": "user", "content": parts}], False) == render_chat(
        CHATML, [{"role": "user", "content": "one\ntwo"}], False)


@pytest.mark.parametrize("messages, message", [
    ([], r"non-empty list"),
    ("hello", r"non-empty list"),
    ([["user", "hi"]], r"messages\[0\] must be an object"),
    ([{"role": "tool", "content": "x"}], r"messages\[0\]\.role is 'tool'"),
    ([{"content": "x"}], r"messages\[0\]\.role is None"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}], r"messages\[1\]\.content must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], r"messages\[0\]\.content\[0\] must be"),
])
def test_invalid_messages_are_named(messages, message):
    with pytest.raises(ChatMessageError, match=message):
        validate_messages(messages)


def test_extra_message_keys_are_dropped():
    assert validate_messages([{"role": "user", "content": "x", "name": "bob"}]) == [{"role": "user", "content": "x"}]


# --- the sandbox ----------------------------------------------------------------------------

@pytest.mark.parametrize("source, message", [
    ("{{ messages.__class__ }}", r"attribute '__class__'"),
    ("{{ raise_exception.__globals__ }}", r"attribute '__globals__'"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", r"attribute '__class__'"),
    ("{{ messages[0].__init__.__globals__['os'] }}", r"attribute '__init__'|attribute '__globals__'"),
    ("{{ cycler.__init__.__globals__ }}", r"attribute '__init__'"),
    ("{{ messages.append(1) }}", r"attribute 'append'"),
    ("{% set x = messages.pop() %}", r"attribute 'pop'"),
])
def test_internals_and_mutation_are_refused(source, message):
    with pytest.raises(ChatTemplateError, match=message):
        ChatTemplate(source).render(CONVERSATIONS[0])


@pytest.mark.parametrize("source, message", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", r"time limit"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}", r"time limit"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", r"output exceeds 1000000 characters"),
    ("{{ 'x' * 10**9 }}", r"with '\*'"),
    ("{{ 'x' | center(1000000000) }}", r"passed 1000000000"),
    ("{{ 'x'.ljust(1000000000) }}", r"passed 1000000000"),
    ("{{ range(10**9) | list }}", r"range\(\) of 1000000000 items|passed 1000000000"),
    ("{{ 10 ** 100000 }}", r"power 100000"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", r"recursed too deeply"),
])
def test_runaway_templates_hit_a_limit(source, message):
    template = ChatTemplate(source, time_limit_s=0.3)
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=message):
        template.render(CONVERSATIONS[0])
    assert time.monotonic() - start < 5


def test_syntax_errors_are_reported_at_load():
    with pytest.raises(ChatTemplateError, match=r"does not compile.*line 1"):
        ChatTemplate("{% for %}")


def test_helpers_transformers_templates_use():
    out = ChatTemplate("{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|{{ range(3) | length }}").render(
        [{"role": "user", "content": "Köln <b>"}])
    assert out == '[{"role": "user", "content": "Köln <b>"}]|4|3'


def test_deadlines_are_per_render_and_thread():
    slow = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                        time_limit_s=0.5)
    fast = ChatTemplate(CHATML)
    errors: list[Exception] = []

    def run_slow() -> None:
        try:
            slow.render(CONVERSATIONS[0])
        except ChatTemplateError as exc:
            errors.append(exc)

    thread = threading.Thread(target=run_slow)
    thread.start()
    for _ in range(50):
        assert fast.render(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")
    thread.join()
    assert len(errors) == 1 and "time limit" in str(errors[0])
