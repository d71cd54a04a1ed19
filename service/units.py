"""Sizes and durations as operators write them: ``4GiB`` / ``512MB`` / plain bytes, and Ollama's
keep-alive durations (Go's syntax, ``5m``, ``1h30m``, ``30s``, or plain seconds; negative = forever)."""

from __future__ import annotations

import math
import re

SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
              "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
# what parse_duration accepts as text, for request schemas
# (ASCII digits, at most 9 before the point: a longer number of hours overflows a float to inf)
DURATION_PATTERN = r"^[+-]?([0-9]{1,9}(\.[0-9]{1,9})?|([0-9]{1,9}(\.[0-9]{1,9})?(ns|us|µs|ms|s|m|h)){1,7})$"
_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")


def parse_size(value: int | float | str) -> int:
    """Bytes from ``4GiB``, ``1.5 GB``, ``800M`` or a plain number; ValueError saying what is accepted."""
    if isinstance(value, bool):
        raise ValueError("a size is a number of bytes or a string such as '4GiB'")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        match = _SIZE.match(value)
        if not match or match.group(2).lower() not in SIZE_UNITS:
            raise ValueError(f"{value!r} is not a size: use bytes or a number with KB, MB, GB, KiB, MiB, GiB")
        number, unit = float(match.group(1)), match.group(2).lower()
    if number < 0 or not math.isfinite(number):
        raise ValueError("a size must be a finite number >= 0")
    return int(number * SIZE_UNITS[unit])


def parse_duration(value: int | float | str) -> float:
    """Seconds from Ollama's ``keep_alive``: a number of seconds, or a Go duration such as ``5m``,
    ``1h30m``, ``-1m``; a negative value means "forever" (returned as -1)."""
    if isinstance(value, bool):
        raise ValueError("a duration is a number of seconds or a string such as '5m'")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        if re.fullmatch(r"\d+(?:\.\d+)?", body):
            seconds = sign * float(body)
        elif body and _PART.sub("", body) == "":
            seconds = sign * sum(float(n) * DURATION_UNITS[u] for n, u in _PART.findall(body))
        else:
            raise ValueError(f"{value!r} is not a duration: use seconds (300) or a duration such as '30s', '5m', "
                             "'1h30m'; negative = forever")
    if not math.isfinite(seconds):
        raise ValueError("a duration must be finite")
    return -1.0 if seconds < 0 else seconds
