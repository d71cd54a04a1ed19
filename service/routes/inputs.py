"""Client inputs -> token ids, written once for every endpoint.

An input is a text, a list of texts, a list of token ids, or a list of token-id lists
(the four shapes the OpenAI API accepts for ``prompt`` and ``input``). The list-size and
text-length limits come from the settings; tokenization and the token-id checks are the
engine's (``engine.tokenize`` / ``engine.validate_ids``).
"""

from __future__ import annotations

from service.engines.errors import EmptyInputError, InvalidRequestError
from service.engines.generative import BaseEngine
from service.settings import Settings

Input = str | list[str] | list[int] | list[list[int]]


def text_list(value: str | list[str], field: str, settings: Settings) -> list[str]:
    """A single text or a list of texts -> a non-empty list within the configured limits."""
    if not isinstance(value, str | list):  # the drop-ins read their parameters untyped
        raise InvalidRequestError(f"{field} must be a string or a list of strings", field)
    texts = [value] if isinstance(value, str) else list(value)
    if not texts:
        raise EmptyInputError(f"{field} must not be an empty list", field)
    _check_count(len(texts), field, settings)
    for i, text in enumerate(texts):
        where = f"{field}[{i}]" if len(texts) > 1 or not isinstance(value, str) else field
        if not isinstance(text, str):
            raise InvalidRequestError(f"{where} must be a string", field)
        if not text.strip():
            raise EmptyInputError(f"{where} must not be empty", field)
        if len(text) > settings.max_text_chars:
            raise InvalidRequestError(f"{where} has {len(text)} characters; at most {settings.max_text_chars} are "
                                      f"allowed (TSERVE_MAX_TEXT_CHARS)", field)
    return texts


def is_text(value: Input) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and bool(value) and isinstance(value[0], str))


def input_ids(value: Input, field: str, engine: BaseEngine, settings: Settings) -> list[list[int]]:
    """Any of the four input shapes -> one list of token ids per input, checked."""
    if isinstance(value, list) and not value:
        raise EmptyInputError(f"{field} must not be an empty list", field)
    if is_text(value):
        return engine.tokenize(text_list(value, field, settings), field)
    rows = [list(value)] if isinstance(value[0], int) else [list(row) for row in value]
    _check_count(len(rows), field, settings)
    engine.validate_ids(rows, field)
    return rows


def _check_count(n: int, field: str, settings: Settings) -> None:
    if n > settings.max_texts:
        raise InvalidRequestError(f"{field} has {n} items; at most {settings.max_texts} are allowed "
                                  f"(TSERVE_MAX_TEXTS)", field)
