"""POST /v1/translate/po end to end with the shipped en->de checkpoint and a real catalogue
(GNOME Mines, German, with some translations blanked: tests/fixtures/README.md)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import polib
import pytest
import pytest_asyncio

from service.http.app import create_app
from service.translation import translate as translation
from tests.conftest import checkpoint_variant
from tests.service.conftest import settings_for, wait_ready

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "gnome-mines-de.po"
SHIPPED = ROOT / "weights" / "translate-en-de"


@pytest.fixture(scope="module")
def po_weights(tmp_path_factory) -> Path:
    """The shipped checkpoint, and a copy whose config says it was trained on masked placeholders."""
    root = tmp_path_factory.mktemp("po-weights")
    (root / "translate-en-de").symlink_to(SHIPPED)
    checkpoint_variant(SHIPPED, root / "translate-en-de-masked", mask_placeholders=True)
    return root


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def app_client(po_weights):
    app = create_app(settings_for(po_weights, max_seq_len=256, max_body_bytes=60_000, max_batch=8, max_queue=64))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=300) as c:
            await wait_ready(c, timeout=120)
            yield app, c


@pytest.fixture
def client(app_client):
    return app_client[1]


pytestmark = pytest.mark.asyncio(loop_scope="module")
SOURCE = FIXTURE.read_bytes()
ORIGINAL = polib.pofile(str(FIXTURE))
BLANK = [e for e in ORIGINAL if not e.obsolete and not e.translated() and "fuzzy" not in e.flags]
OPTIONS = {"model": "translate-en-de", "beam_size": "2", "max_tokens": "48"}


def by_key(po: polib.POFile) -> dict:
    return {(e.msgctxt, e.msgid, e.obsolete): e for e in po}


async def post_multipart(client, data: bytes = SOURCE, **fields) -> httpx.Response:
    return await client.post("/v1/translate/po", files={"file": ("de.po", data, "text/x-po")},
                             data=OPTIONS | fields)


async def test_multipart_fills_untranslated_entries_and_keeps_the_rest(client):
    r = await post_multipart(client)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "text/x-gettext-translation; charset=utf-8"
    out = polib.pofile(r.text)
    assert out.metadata == ORIGINAL.metadata and out.header == ORIGINAL.header
    assert len(out) == len(ORIGINAL) and [e.msgid for e in out] == [e.msgid for e in ORIGINAL]
    new, old = by_key(out), by_key(ORIGINAL)
    filled = 0
    for key, before in old.items():
        after = new[key]
        assert (after.tcomment, after.comment, after.occurrences, after.msgctxt) == (
            before.tcomment, before.comment, before.occurrences, before.msgctxt)
        if before in BLANK:
            if after.msgstr or any(after.msgstr_plural.values()):
                filled += 1
                assert after.flags[0] == "fuzzy" and after.flags[1:] == before.flags  # c-format kept
        else:  # translated, fuzzy (include_fuzzy is off) and obsolete entries: untouched
            assert (after.msgstr, after.msgstr_plural, after.flags) == (before.msgstr, before.msgstr_plural,
                                                                         before.flags)
    headers = {k: int(v) for k, v in r.headers.items() if k.startswith("x-entries-")}
    assert headers["x-entries-total"] == len([e for e in ORIGINAL if not e.obsolete])
    assert headers["x-entries-translated"] == filled >= len(BLANK) - 2
    assert headers["x-entries-untranslated"] == len(BLANK) - filled == (
        headers["x-entries-skipped-placeholders"] + headers["x-entries-skipped-too-long"])
    assert headers["x-entries-fuzzy"] == filled + 1
    assert "Das aktuelle Spiel behalten" in r.text  # the fuzzy entry, not retranslated


async def test_plural_accelerator_and_context_entries(client):
    out = by_key(polib.pofile((await post_multipart(client)).text))
    plural = out[(None, "%d × %d, %d mine", False)]
    assert sorted(plural.msgstr_plural) == [0, 1] and all(plural.msgstr_plural.values())
    assert plural.msgstr_plural[0].count("%d") == 3 and plural.msgstr_plural[1].count("%d") == 3
    for msgid in ("_Cancel", "_Width", "A_ppearance"):
        text = out[(None, msgid, False)].msgstr
        assert text.count("_") == 1 and re.search(r"_\w", text), (msgid, text)
    assert out[("shortcut window", "Game size selection", False)].msgstr


async def test_raw_body_with_query_options_gives_the_same_file(client):
    multipart = (await post_multipart(client)).text
    for media in ("text/x-gettext-translation", "application/octet-stream"):
        r = await client.post("/v1/translate/po", content=SOURCE, params=OPTIONS, headers={"content-type": media})
        assert r.status_code == 200 and r.text == multipart


async def test_include_fuzzy_and_max_entries(client):
    r = await post_multipart(client, include_fuzzy="true", max_entries="3")
    out = by_key(polib.pofile(r.text))
    assert r.headers["x-entries-translated"] == "3"
    assert int(r.headers["x-entries-untranslated"]) == len(BLANK) - 3
    assert "fuzzy" in out[(None, "Keep Current Game", False)].flags  # retranslated entries stay fuzzy


async def test_an_entry_whose_placeholders_did_not_survive_is_left_empty_and_counted(client, monkeypatch):
    real = translation.translate

    async def losing(request, engine, sources, *args):
        results, usage = await real(request, engine, sources, *args)
        for src, result in zip(sources, results):
            result.placeholders_ok = "%d" not in src.text
        return results, usage

    monkeypatch.setattr(translation, "translate", losing)
    r = await post_multipart(client)
    out = by_key(polib.pofile(r.text))
    assert r.headers["x-entries-skipped-placeholders"] == "2"
    for msgid in ("%d × %d, %d mine", "<b>%d</b> mine"):
        assert not any(out[(None, msgid, False)].msgstr_plural.values())
        assert "fuzzy" not in out[(None, msgid, False)].flags
    assert out[(None, "_Cancel", False)].msgstr


async def test_masking_checkpoint_reports_placeholders(client):
    """The shipped weights never saw sentinels: what matters is that no sentinel leaks and the flag is told."""
    r = await client.post("/v1/translate", json={"model": "translate-en-de-masked", "beam_size": 2,
                                                 "text": ["Delete %s files from {folder}?", "Open the file"]})
    assert r.status_code == 200, r.text
    for item in r.json()["translations"]:
        assert "⟪" not in item["text"] and isinstance(item["placeholders_ok"], bool)
    r = await post_multipart(client, model="translate-en-de-masked")
    assert r.status_code == 200 and "⟪" not in r.text
    plain = (await client.post("/v1/translate", json={"model": "translate-en-de", "text": "Delete %s files"})).json()
    assert plain["translations"][0]["placeholders_ok"] is True


@pytest.mark.parametrize("content,content_type,param,status", [
    (b"\x00\xff\xfe garbage \x01", "application/octet-stream", "file", 400),
    (b"\xde\x12\x04\x95" + bytes(40), "application/octet-stream", "file", 400),  # a compiled .mo
    (b"Hello, this is not a catalogue", "text/x-po", "file", 400),
    (b"/etc/passwd", "text/x-po", "file", 400),  # polib would read a path: never
    (b"", "text/x-po", "file", 400),
    (SOURCE, "text/plain", "Content-Type", 400),
    (SOURCE, "application/json", "Content-Type", 400),
    (SOURCE + b"#" * 60_000, "text/x-po", None, 413),  # past TSERVE_MAX_BODY_BYTES
])
async def test_bad_files_are_4xx_naming_the_field(client, content, content_type, param, status):
    r = await client.post("/v1/translate/po", content=content, headers={"content-type": content_type})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


async def test_bad_options_and_forms(client):
    r = await client.post("/v1/translate/po", files={"other": ("x.po", SOURCE)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    r = await post_multipart(client, beam_size="many")
    assert r.status_code == 400 and r.json()["error"]["param"] == "beam_size"
    r = await client.post("/v1/translate/po", content=SOURCE, params={"beam_size": 0},
                          headers={"content-type": "text/x-po"})
    assert r.status_code == 400 and "beam_size" in r.json()["error"]["message"]
    r = await post_multipart(client, model="no-such-model")
    assert r.status_code == 404


async def test_entry_and_capacity_limits(app_client):
    app, client = app_client
    settings = app.state.settings
    saved = settings.max_po_entries, settings.max_queue
    try:
        settings.max_po_entries = 10
        r = await post_multipart(client)
        assert r.status_code == 413 and r.json()["error"]["param"] == "file" and "10" in r.json()["error"]["message"]
        settings.max_po_entries, settings.max_queue = saved[0], 0  # room for max_batch (8) texts only
        r = await post_multipart(client)
        assert r.status_code == 413 and r.json()["error"]["param"] == "max_entries"
        r = await post_multipart(client, max_entries="4")
        assert r.status_code == 200 and r.headers["x-entries-translated"] == "4"
    finally:
        settings.max_po_entries, settings.max_queue = saved


async def test_fixture_is_small_and_documented():
    assert len(ORIGINAL) <= 60 and len(BLANK) >= 10
    readme = (FIXTURE.parent / "README.md").read_text()
    assert "GPL-3+" in readme and "1:40.1-1" in readme


async def test_the_schema_bounds_the_options_as_form_fields_as_it_does_as_query_parameters(client):
    """The options come as query parameters or form fields; the schema states the served model's
    limits for both (a form's max_tokens of 306 once passed the schema and got a 400)."""
    op = (await client.get("/openapi.json")).json()["paths"]["/v1/translate/po"]["post"]
    query = {p["name"]: p["schema"] for p in op["parameters"]}
    form = op["requestBody"]["content"]["multipart/form-data"]["schema"]["properties"]
    assert query["max_tokens"]["maximum"] == form["max_tokens"]["maximum"] == 255  # max_seq_len 256, less one
    assert query["beam_size"]["maximum"] == form["beam_size"]["maximum"] == 8
    # the model: a translation model, as a query parameter or a form field (a form's fill-mask model once
    # passed the schema and got a 400)
    served = {m["id"] for m in (await client.get("/v1/models")).json()["data"] if m.get("task") == "translation"}
    for model in (query["model"], form["model"]):
        assert {v for b in model.get("anyOf", [model]) for v in b.get("enum", []) if v} == served != set()
    over = await post_multipart(client, max_tokens="256")
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"


async def test_a_query_option_the_form_overrides_is_still_checked(client):
    """The form's fields override the query's options, but a query naming no served model is
    refused as it would be alone (a query model of 'AAA' beside a served form model once answered
    200)."""
    files = {"file": ("de.po", SOURCE, "text/x-po")}
    unknown = await client.post("/v1/translate/po", params={"model": "AAA"}, files=files, data=OPTIONS)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model", unknown.text
    for name, value in (("max_tokens", "256"), ("beam_size", "9")):  # over the model's context, TSERVE_MAX_BATCH
        over = await client.post("/v1/translate/po", params={name: value}, files=files, data=OPTIONS)
        assert over.status_code == 400 and over.json()["error"]["param"] == name, over.text
        over = await client.post("/v1/translate/po", files=files, data=OPTIONS | {name: value})  # as a form field
        assert over.status_code == 400 and over.json()["error"]["param"] == name, over.text
    for value in ("0", "no", "True"):  # a form field's boolean is true or false, as the schema says
        odd = await client.post("/v1/translate/po", files=files, data=OPTIONS | {"include_fuzzy": value})
        assert odd.status_code == 400 and odd.json()["error"]["param"] == "include_fuzzy", odd.text
    overridden = await client.post("/v1/translate/po", params={"include_fuzzy": "true", "beam_size": "1"},
                                   files=files, data=OPTIONS)
    assert overridden.status_code == 200, overridden.text  # valid query options the form overrides
