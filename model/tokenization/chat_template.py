"""Chat templates: the one piece of code taken from a model file, rendered in a sandbox.

    template = ChatTemplate(ckpt.chat_template, bos_token="<s>", eos_token="</s>")
    prompt = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)

Semantics follow Hugging Face's ``apply_chat_template``: a Jinja template with
``trim_blocks``/``lstrip_blocks``, the variables ``messages``, ``add_generation_prompt``,
``bos_token``, ``eos_token`` (and the other special tokens), ``tools``/``documents`` (None),
the ``raise_exception`` and ``strftime_now`` functions, a ``tojson`` that keeps non-ASCII
text, loop controls and ``{% generation %}`` blocks.

The template runs in ``jinja2``'s ImmutableSandboxedEnvironment (no attribute access to
internals such as ``__class__``, no mutation of the inputs) plus limits of our own: a
render time limit checked on every call, attribute/item access, loop step and output
chunk; and a cap on the size of the output and of anything built by ``*`` or by a
numeric argument (``center(10**9)``). Breaking any of them is a ``ChatTemplateError``.
"""

from __future__ import annotations

import contextvars
import json
import operator
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROLES = ("system", "user", "assistant")
DEFAULT_TIME_LIMIT_S = 1.0
DEFAULT_MAX_CHARS = 1_000_000
MAX_RANGE = 100_000  # items one range() call may produce (the sandbox's own limit)

_deadline: contextvars.ContextVar[float] = contextvars.ContextVar("chat_template_deadline", default=float("inf"))


class ChatTemplateError(ValueError):
    """A template that does not compile, raises, escapes the sandbox or breaks a limit."""


class ChatMessageError(ValueError):
    """Messages that are not a valid conversation; the message names the field."""


def _check_deadline() -> None:
    if time.monotonic() > _deadline.get():
        raise ChatTemplateError("chat template rendering exceeded its time limit")


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` marks the assistant's part of a training
    sample in transformers; rendering a prompt just keeps the body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with a deadline and size limits on the hooks it already has."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, max_chars: int):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, loopcontrols])
        self.max_chars = max_chars
        self.filters = {name: self._limited(f) for name, f in self.filters.items()}
        self.filters["tojson"] = self._limited(_tojson)
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.globals["range"] = self._range

    def _check_size(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool) and abs(value) > self.max_chars:
                raise ChatTemplateError(f"chat template passed {value} to a function; the limit is {self.max_chars}")

    def _limited(self, fn: Any) -> Any:
        skip = 2 if hasattr(fn, "jinja_pass_arg") else 1  # the context/environment, then the filtered value

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            _check_deadline()
            self._check_size(args[skip:], kwargs)
            return fn(*args, **kwargs)
        if hasattr(fn, "jinja_pass_arg"):  # keep the @pass_context / @pass_environment marker
            wrapper.jinja_pass_arg = fn.jinja_pass_arg  # type: ignore[attr-defined]
        return wrapper

    def _range(self, *args: int) -> _CheckedRange:
        self._check_size(args, {})
        items = range(*args)
        if len(items) > MAX_RANGE:
            raise ChatTemplateError(f"chat template asked for range() of {len(items)} items; the limit is {MAX_RANGE}")
        return _CheckedRange(items)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's signature
        _check_deadline()
        __self._check_size(args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check_deadline()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check_deadline()
        return super().getitem(obj, argument)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # The sandbox's default is a silent Undefined (renders as ""); a probe of internals fails loudly.
        raise ChatTemplateError(f"chat template tried to access attribute {attribute!r} of a "
                                f"{type(obj).__name__} object, which the sandbox forbids")

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        _check_deadline()
        if op == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > self.max_chars:
                    raise ChatTemplateError(f"chat template built a sequence of {len(seq) * times} items with '*'; "
                                            f"the limit is {self.max_chars}")
        if op == "**" and isinstance(right, (int, float)) and abs(right) > 64:
            raise ChatTemplateError(f"chat template raised to the power {right}; the limit is 64")
        return {"*": operator.mul, "**": operator.pow}[op](left, right)


class _CheckedRange(Sequence[int]):
    """A range whose iteration checks the deadline at every step (an empty nested loop
    makes no other call the sandbox could check it in)."""

    def __init__(self, items: range):
        self.items = items

    def __iter__(self) -> Iterator[int]:
        for i in self.items:
            _check_deadline()
            yield i

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: Any) -> Any:
        return self.items[index]


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template raised: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' tojson: unlike Jinja's own, it does not escape HTML characters or non-ASCII text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def validate_messages(messages: Any) -> list[dict[str, str]]:
    """Check a conversation and return it as plain ``{"role", "content"}`` dicts. Content may
    be a string or a list of ``{"type": "text", "text": ...}`` parts (joined with newlines);
    other keys of a message (e.g. ``name``) are dropped."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatMessageError("messages must be a non-empty list")
    clean = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ChatMessageError(f"{where} must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise ChatMessageError(f"{where}.role is {role!r}; expected one of {list(ROLES)}")
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ChatMessageError(f"{where}.content[{j}] must be {{\"type\": \"text\", \"text\": <string>}}")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise ChatMessageError(f"{where}.content must be a string or a list of text parts")
        clean.append({"role": role, "content": content})
    return clean


class ChatTemplate:
    """One compiled template and the special tokens it is rendered with (thread-safe)."""

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None,
                 special_tokens: Mapping[str, str | None] | None = None,
                 time_limit_s: float = DEFAULT_TIME_LIMIT_S, max_chars: int = DEFAULT_MAX_CHARS):
        if not isinstance(source, str):
            raise ChatTemplateError("chat template must be a string")
        self.source, self.time_limit_s, self.max_chars = source, time_limit_s, max_chars
        self.special_tokens = {"bos_token": bos_token, "eos_token": eos_token, **(special_tokens or {})}
        self.env = _LimitedSandbox(max_chars)
        try:
            self.template = self.env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc.message} (line {exc.lineno})") from None

    def render(self, messages: Any, add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for ``messages``; ``extra`` adds template variables."""
        variables = {"tools": None, "documents": None, **self.special_tokens, **extra,
                     "messages": validate_messages(messages), "add_generation_prompt": add_generation_prompt}
        token = _deadline.set(time.monotonic() + self.time_limit_s)
        chunks, size = [], 0
        try:
            for chunk in self.template.generate(**variables):
                _check_deadline()
                size += len(chunk)
                if size > self.max_chars:
                    raise ChatTemplateError(f"chat template output exceeds {self.max_chars} characters")
                chunks.append(chunk)
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as exc:
            raise ChatTemplateError(f"chat template tried something the sandbox forbids: {exc}") from None
        except RecursionError:
            raise ChatTemplateError("chat template recursed too deeply") from None
        except MemoryError:
            raise ChatTemplateError("chat template ran out of memory") from None
        except Exception as exc:  # noqa: BLE001 - any error inside a template is the template's fault
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
        finally:
            _deadline.reset(token)
        return "".join(chunks)


def render_chat(source: str, messages: Any, add_generation_prompt: bool = True, **special_tokens: Any) -> str:
    """One-off rendering (compiles every time; keep a ``ChatTemplate`` to render many)."""
    return ChatTemplate(source, special_tokens=special_tokens).render(messages, add_generation_prompt)
