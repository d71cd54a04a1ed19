"""Format placeholders in software strings, and masking them to sentinels for translation.

A UI string such as ``"Delete %s files from {folder}?"`` must come out of translation with
the same placeholders, or the program that formats it crashes or prints garbage. The
translator never sees the placeholders: each occurrence is replaced by a numbered sentinel
(``⟪1⟫``, ``⟪2⟫``, ... in order of appearance) before tokenisation, on the target side of
training pairs too, so the model learns to copy a handful of sentinel tokens instead of
dozens of placeholder spellings. After decoding the sentinels are mapped back; German may
move them (``"%1$s of %2$s"`` -> ``"%2$s von %1$s"``), which the mapping handles.

``%%`` is a literal percent sign, not a placeholder, and is left as it is.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# Alternatives are tried in order: LibreOffice's %NAME before printf's %A, positional %1$s before %1.
PLACEHOLDER = re.compile(
    r"%[A-Z][A-Z0-9_]{2,}"  # LibreOffice: %PRODUCTNAME, %EXTENSION_NAME
    r"|%\(\w+\)[-+ #0]*\d*(?:\.\d+)?[a-zA-Z]"  # Python/Django: %(name)s, %(count)d
    r"|%\d+\$[-+ #0]*\d*(?:\.\d+)?(?:hh|h|ll|l|L|j|z|t)?[a-zA-Z]"  # positional printf: %1$s
    r"|%[-+ #0]*(?:\d+|\*)?(?:\.(?:\d+|\*))?(?:hh|h|ll|l|L|q|j|z|t)?[diouxXeEfFgGcsSpaAn]"  # printf
    r"|%\d+"  # Qt / LibreOffice: %1
    r"|\$\(\w+\)|\$\{\w+\}|\$\d+"  # $(ARG1), ${name}, $1
    r"|\{\w*(?:![rsa])?(?::[^{}\s]*)?\}"  # str.format: {0}, {name}, {}, {0:>3}
)
_SCAN = re.compile(r"%%|" + PLACEHOLDER.pattern)
SENTINEL = re.compile(r"⟪(\d+)⟫")


def sentinel(index: int) -> str:
    """The sentinel of the ``index``-th placeholder (1-based)."""
    return f"⟪{index}⟫"


def placeholders(text: str) -> list[str]:
    """The format placeholders in ``text``, sorted (order may legitimately change in German)."""
    return sorted(m.group() for m in _SCAN.finditer(text) if m.group() != "%%")


def same_placeholders(source: str, translation: str) -> bool:
    return placeholders(source) == placeholders(translation)


def mask(text: str) -> tuple[str, list[str]]:
    """``text`` with each placeholder replaced by its sentinel, and the placeholders in order.

    Text that already contains a sentinel-like ``⟪n⟫`` is returned unmasked (with no
    placeholders), so that unmasking can never confuse it with one of ours."""
    if SENTINEL.search(text):
        return text, []
    found: list[str] = []

    def swap(m: re.Match) -> str:
        if m.group() == "%%":
            return "%%"
        found.append(m.group())
        return sentinel(len(found))

    return _SCAN.sub(swap, text), found


def mask_target(target: str, source_placeholders: Sequence[str]) -> str | None:
    """Mask a reference translation with the sentinels of its source: each placeholder takes
    the number of the first unused source occurrence spelled the same way. None when the
    two sides do not hold the same placeholders (such a pair teaches nothing usable)."""
    free = list(enumerate(source_placeholders, start=1))
    failed = False

    def swap(m: re.Match) -> str:
        nonlocal failed
        if m.group() == "%%":
            return "%%"
        for k, (index, spelling) in enumerate(free):
            if spelling == m.group():
                del free[k]
                return sentinel(index)
        failed = True
        return m.group()

    masked = _SCAN.sub(swap, target)
    return None if failed or free or SENTINEL.findall(target) else masked


def unmask(text: str, originals: Sequence[str]) -> str | None:
    """Put the placeholders back; None when the translation lost, repeated or invented a
    sentinel (the caller then falls back, e.g. to another beam hypothesis)."""
    numbers = [int(n) for n in SENTINEL.findall(text)]
    if sorted(numbers) != list(range(1, len(originals) + 1)):
        return None
    return SENTINEL.sub(lambda m: originals[int(m.group(1)) - 1], text)


def restore(text: str, originals: Sequence[str]) -> str:
    """Put back as many placeholders as the translation kept: the first occurrence of each known
    sentinel gets its placeholder; repeated and invented sentinels are dropped. What ``unmask``
    refused, as far as it goes (a lost placeholder stays lost)."""
    used: set[int] = set()

    def swap(m: re.Match) -> str:
        n = int(m.group(1))
        if 1 <= n <= len(originals) and n not in used:
            used.add(n)
            return originals[n - 1]
        return ""

    return SENTINEL.sub(swap, text)
