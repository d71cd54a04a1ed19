"""Placeholder-safe translation, written once: mask -> decode -> unmask -> retry -> restore.

Used by the offline evaluation (``model.train.evaluate.translate_all``) and by the service
(``service.translation.translate``); each supplies the decoding as a callback, plain for training,
``async`` for the service, and this module runs the same sequence around it:

1. a checkpoint trained with ``mask_placeholders`` reads each source masked
   (``model.text.placeholders.mask``: ``%s`` -> ``⟪1⟫``); one that does not reads it as sent;
2. every source is decoded once (``Attempt(retry=False)``); the callback answers with its
   candidates, best first (a beam search's n best, or the one output);
3. the first candidate whose sentinels map back (``unmask``) is taken; for a checkpoint that
   does not mask, the first candidate, checked (``same_placeholders``), never retried;
4. the sources none of whose candidates mapped back are decoded again, together
   (``Attempt(retry=True)``: the callback decodes them with beam search), same rule;
5. if still none maps back, the best candidate of the first (``restore="first"``) or of the
   retry's (``restore="last"``) decoding is returned with the placeholders put back as far as
   they survived (``restore``) and ``placeholders_ok`` false.

The driver itself is a generator (``steps``) that yields each ``Attempt`` and receives its
candidates, so one sequence serves both callbacks (``translate`` / ``translate_async``).
Texts are returned as decoded: callers strip them if they want to.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from model.text.placeholders import mask, restore, same_placeholders, unmask

T = TypeVar("T")  # what a caller keeps of one decoding (the service: the engine's final event)
Restore = Literal["first", "last"]


@dataclass(frozen=True)
class Source:
    """One text to translate: the client's text, what the model reads, the masked placeholders."""

    text: str
    masked: str
    originals: tuple[str, ...] = ()


def sources(texts: Sequence[str], masking: bool) -> list[Source]:
    """What the model reads of each text: masked when the checkpoint was trained on sentinels."""
    if not masking:
        return [Source(t, t) for t in texts]
    return [Source(t, masked, tuple(found)) for t in texts for masked, found in [mask(t)]]


@dataclass(frozen=True)
class Attempt:
    """One decoding the callback runs: ``texts[k]`` is what the model reads of source ``indices[k]``."""

    indices: list[int]
    texts: list[str]
    retry: bool  # False: every source, first time; True: the failures again, with beam search


@dataclass(frozen=True)
class Decoded(Generic[T]):
    """The callback's answer for one source of an attempt."""

    candidates: list[str]  # best first; at least one
    info: T


@dataclass
class Translated(Generic[T]):
    text: str
    placeholders_ok: bool
    info: T  # of the decoding whose output was taken
    retried: bool = False


def choose(src: Source, candidates: Sequence[str], masking: bool) -> tuple[str, bool] | None:
    """(text, placeholders_ok) of the first candidate whose sentinels map back; for a checkpoint
    that does not mask, the first candidate, checked. None: a masked source none of them kept."""
    if not masking:
        return candidates[0], same_placeholders(src.text, candidates[0])
    for candidate in candidates:
        text = unmask(candidate, src.originals)
        if text is not None:
            return text, same_placeholders(src.text, text)
    return None


def restored(src: Source, candidates: Sequence[str]) -> str:
    """The best candidate with the placeholders put back as far as they survived."""
    return restore(candidates[0], src.originals)


Steps = Generator[Attempt, list[Decoded[T]], list[Translated[T]]]


def steps(items: Sequence[Source], masking: bool, retry: bool = True,
          restore_from: Restore = "last") -> Steps:
    """The sequence: yields each attempt, is sent the callback's answers, returns the translations."""
    first: list[Decoded[T]] = yield Attempt(list(range(len(items))), [s.masked for s in items], retry=False)
    results: list[Translated[T] | None] = []
    for src, decoded in zip(items, first):
        chosen = choose(src, decoded.candidates, masking)
        results.append(None if chosen is None else Translated(*chosen, decoded.info))
    failed = [i for i, r in enumerate(results) if r is None]
    again: list[Decoded[T]] = []
    if failed and retry:
        again = yield Attempt(failed, [items[i].masked for i in failed], retry=True)
    for k, i in enumerate(failed):
        second = again[k] if again else None
        chosen = choose(items[i], second.candidates, masking) if second else None
        if chosen is not None and second is not None:
            results[i] = Translated(*chosen, second.info, retried=True)
            continue
        fallback = first[i] if restore_from == "first" or second is None else second
        results[i] = Translated(restored(items[i], fallback.candidates), False, fallback.info, retried=bool(again))
    return [r for r in results if r is not None]


def translate(items: Sequence[Source], decode: Callable[[Attempt], list[Decoded[T]]], masking: bool,
              retry: bool = True, restore_from: Restore = "last") -> list[Translated[T]]:
    """``steps`` driven by a plain ``decode`` callback (offline evaluation)."""
    run: Steps = steps(items, masking, retry, restore_from)
    try:
        attempt = next(run)
        while True:
            attempt = run.send(decode(attempt))
    except StopIteration as done:
        return done.value


async def translate_async(items: Sequence[Source], decode: Callable[[Attempt], Awaitable[list[Decoded[T]]]],
                          masking: bool, retry: bool = True, restore_from: Restore = "last") -> list[Translated[T]]:
    """``steps`` driven by an ``async`` ``decode`` callback (the service's engines)."""
    run: Steps = steps(items, masking, retry, restore_from)
    try:
        attempt = next(run)
        while True:
            attempt = run.send(await decode(attempt))
    except StopIteration as done:
        return done.value
