"""Language identification with ``langid`` (its model ships inside the package: no download).

``detect(text, among)`` ranks the languages in ``among`` (the ones this server can translate,
as LibreTranslate ranks its installed languages); with fewer than two candidates it ranks
all 97 languages langid knows. Confidence is langid's normalised probability.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

_lock = threading.Lock()
_model: list[tuple] = []  # langid's decoded model, once per process
_identifiers: dict[frozenset[str], object] = {}


def _decoded() -> tuple:
    """langid's model, decoded from the string it ships (base64 + bz2 + a pickle): 2-3 s of one
    core when the host is quiet, 14 s measured on a loaded 2-core host; ``warm`` does it off the
    request path at start-up."""
    from langid import langid

    with _lock:
        if not _model:
            ident = langid.LanguageIdentifier.from_modelstring(langid.model)
            _model.append((ident.nb_ptc, ident.nb_pc, ident.nb_numfeats, ident.nb_classes, ident.tk_nextmove,
                           ident.tk_output))
        return _model[0]


def warm() -> None:
    """Decode the model now (the server calls it in a thread at start-up when it serves a
    translation model), so a first /detect or ``source: auto`` does not wait for it."""
    _identifier(frozenset())


def _identifier(among: frozenset[str]):
    from langid import langid

    model = _decoded()
    with _lock:
        if among not in _identifiers:  # a new identifier over the decoded arrays: no second decode
            ident = langid.LanguageIdentifier(*model, norm_probs=True)
            known = [code for code in among if code in ident.nb_classes]
            if len(known) >= 2:
                ident.set_languages(known)
            _identifiers[among] = ident
        return _identifiers[among]


def detect(text: str, among: Iterable[str] = (), top: int = 3) -> list[tuple[str, float]]:
    """The ``top`` most likely languages of ``text`` as (ISO 639-1 code, probability), best first."""
    ranked = _identifier(frozenset(among)).rank(text)
    return [(code, float(p)) for code, p in ranked[:top]]
