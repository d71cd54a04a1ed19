"""Language identification with ``langid`` (its model ships inside the package: no download).

``detect(text, among)`` ranks the languages in ``among`` (the ones this server can translate,
as LibreTranslate ranks its installed languages); with fewer than two candidates it ranks
all 97 languages langid knows. Confidence is langid's normalised probability.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

_lock = threading.Lock()
_identifiers: dict[frozenset[str], object] = {}


def _identifier(among: frozenset[str]):
    from langid import langid  # imported on first use: loading its model takes about a second

    with _lock:
        if among not in _identifiers:
            ident = langid.LanguageIdentifier.from_modelstring(langid.model, norm_probs=True)
            known = [code for code in among if code in ident.nb_classes]
            if len(known) >= 2:
                ident.set_languages(known)
            _identifiers[among] = ident
        return _identifiers[among]


def detect(text: str, among: Iterable[str] = (), top: int = 3) -> list[tuple[str, float]]:
    """The ``top`` most likely languages of ``text`` as (ISO 639-1 code, probability), best first."""
    ranked = _identifier(frozenset(among)).rank(text)
    return [(code, float(p)) for code, p in ranked[:top]]
