"""langid's model is decoded once per process (2-3 s of one core quiet, 14 s measured on a loaded
2-core host, which put a first POST /detect past schemathesis's 10 s response-time check), and a
server that translates decodes it at start-up, before any /detect or ``source: auto`` needs it."""

from __future__ import annotations

import httpx
import pytest
from langid import langid

from service.http.app import create_app
from service.translation import language_id
from tests.service.conftest import settings_for, wait_ready

TEXTS = ("Die Größe der Datei übersteigt das Limit", "The quick brown fox jumps over the lazy dog", "0")


@pytest.fixture
def fresh(monkeypatch):
    """Empty caches and a count of decodes."""
    monkeypatch.setattr(language_id, "_model", [])
    monkeypatch.setattr(language_id, "_identifiers", {})
    calls = []
    decode = langid.LanguageIdentifier.from_modelstring.__func__

    def counted(cls, *args, **kwargs):
        calls.append(1)
        return decode(cls, *args, **kwargs)

    monkeypatch.setattr(langid.LanguageIdentifier, "from_modelstring", classmethod(counted))
    return calls


def test_each_language_set_ranks_as_langid_does_from_one_decode(fresh):
    sets = [(), ("en", "de"), ("de", "fr", "en")]
    got = {(s, t): language_id.detect(t, s) for s in sets for t in TEXTS}
    assert len(fresh) == 1
    reference = langid.LanguageIdentifier.from_modelstring(langid.model, norm_probs=True)
    for (s, t), ranked in got.items():
        reference.set_languages(list(s) if s else None)
        assert ranked == [(code, float(p)) for code, p in reference.rank(t)[:3]], (s, t)


@pytest.mark.asyncio
async def test_a_server_that_translates_decodes_the_model_at_start_up(fresh, weights_dir):
    app = create_app(settings_for(weights_dir))
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        await wait_ready(c)
        await app.state.langid
        assert language_id._model and len(fresh) == 1
        r = await c.post("/detect", data={"q": TEXTS[0]})
        assert r.status_code == 200 and r.json()[0]["language"] == "de"
        assert len(fresh) == 1  # the request decoded nothing


@pytest.mark.asyncio
async def test_a_server_that_does_not_translate_leaves_it_alone(fresh, weights_dir, tmp_path):
    (tmp_path / "generate-tiny").symlink_to(weights_dir / "generate-tiny")
    app = create_app(settings_for(tmp_path))
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        await wait_ready(c)
        assert not hasattr(app.state, "langid") and not language_id._model
