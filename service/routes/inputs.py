"""Checks on client texts that depend on settings (list sizes, text length)."""

from __future__ import annotations

from service.engine_errors import InvalidRequestError
from service.settings import Settings


def text_list(value: str | list[str], field: str, settings: Settings) -> list[str]:
    """A single text or a list of texts -> a non-empty list within the configured limits."""
    texts = [value] if isinstance(value, str) else list(value)
    if not texts:
        raise InvalidRequestError(f"{field} must not be an empty list", field)
    if len(texts) > settings.max_texts:
        raise InvalidRequestError(f"{field} has {len(texts)} items; at most {settings.max_texts} are allowed "
                                  f"(TSERVE_MAX_TEXTS)", field)
    for i, text in enumerate(texts):
        where = f"{field}[{i}]" if len(texts) > 1 or not isinstance(value, str) else field
        if not text.strip():
            raise InvalidRequestError(f"{where} must not be empty", field)
        if len(text) > settings.max_text_chars:
            raise InvalidRequestError(f"{where} has {len(text)} characters; at most {settings.max_text_chars} are "
                                      f"allowed (TSERVE_MAX_TEXT_CHARS)", field)
    return texts
