"""How a model family writes a tool call: the text and special tokens that open and close one,
the JSON inside, and whether several calls may follow each other.

    fmt = detect(chat_template_source, tokenizer.token_to_id)        # or detect(..., override="hermes")
    fmt.open, fmt.open_id      # "<tool_call>", 151657 for Qwen2.5: the model writes the call's opening
                               # as one special token, so a grammar must ask for that token, not the text

The families (what each model was trained to write, as its own chat template teaches it):

- ``hermes``: Qwen2.5 / Qwen3, Hermes, and the generic prompt: one block per call,
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, blocks one per line.
- ``llama3``: Llama 3.1-3.3: a bare ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>``; one call per turn.
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``: one list of calls.
- ``generic``: a model whose template knows nothing of tools (SmolLM2, Gemma 3): the service's
  own prompt teaches it the ``hermes`` blocks, as text.

``detect`` reads the template's source (the markers it writes) and the vocabulary (whether a
marker is one token); a manifest's ``tool_format`` names one of ``FORMATS`` instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ToolFormat:
    name: str
    open: str  # the marker that opens a call ("" where a call is bare JSON)
    close: str  # the marker that closes it ("" where the JSON's end ends it)
    open_id: int | None = None  # ``open`` as one token of the vocabulary, when it is one
    close_id: int | None = None
    open_after: str = "\n"  # text between the opening marker and the JSON
    close_before: str = "\n"  # text between the JSON and the closing marker
    arguments_key: str = "arguments"  # the key of the call's arguments in its JSON
    as_list: bool = False  # the calls are one JSON list after one opening marker (Mistral)
    parallel: bool = True  # the family may write several calls in one turn
    separator: str = "\n"  # between two call blocks
    optional_open: bool = False  # the opening marker may be left out (Llama 3's bare JSON)

    def block(self, json_text: str) -> str:
        """One call as the model writes it (for the history of a conversation)."""
        return f"{self.open}{self.open_after}{json_text}{self.close_before}{self.close}"


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")
LLAMA3 = ToolFormat("llama3", "<|python_tag|>", "", open_after="", close_before="", arguments_key="parameters",
                    parallel=False, optional_open=True)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", open_after=" ", close_before="", as_list=True, separator=", ")
GENERIC = replace(HERMES, name="generic")
FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, GENERIC)}


class ToolFormatError(ValueError):
    """A format name that is not one of ``FORMATS``."""


def detect(template: str | None, token_id: Callable[[str], int | None], override: str | None = None) -> ToolFormat:
    """The format of a model whose chat template has ``template`` as source, ``token_id(text)``
    giving a vocabulary entry's id (None: no such entry). ``override``: a name from ``FORMATS``."""
    if override is not None:
        if override not in FORMATS:
            raise ToolFormatError(f"tool_format is {override!r}; expected one of {sorted(FORMATS)}")
        fmt = FORMATS[override]
    elif not template or "tools" not in template:
        fmt = GENERIC
    elif "[TOOL_CALLS]" in template:
        fmt = MISTRAL
    elif "<tool_call>" in template:
        fmt = HERMES
    elif "<|python_tag|>" in template or ("<|eom_id|>" in template and "parameters" in template):
        fmt = LLAMA3
    else:  # a template that shows tools its own way: Hermes blocks are the common habit
        fmt = HERMES
    return with_token_ids(fmt, token_id)


def with_token_ids(fmt: ToolFormat, token_id: Callable[[str], int | None]) -> ToolFormat:
    """``fmt`` with its markers' ids where the vocabulary holds them whole."""
    return replace(fmt, open_id=token_id(fmt.open) if fmt.open else None,
                   close_id=token_id(fmt.close) if fmt.close else None)
