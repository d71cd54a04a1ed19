"""The web playground (GET /): served from the package, self-contained, and working in a real
browser (headless Chromium from Debian driven by selenium) against a live server.

The browser tests run the shipped checkpoints (weights/), so the screenshots show real
answers, plus a tiny decoder that never emits EOS and is slowed down, so a generation lasts
long enough to be stopped. Screenshots go to $TSERVE_TEST_ARTIFACTS/playground (default
build/test-artifacts/playground) and, with TSERVE_UPDATE_SCREENSHOTS=1, to docs/screenshots/
for the README.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from model import ModelConfig, build_model, save
from model.tokenization.tokenizer import train_bpe
from service.http.app import create_app
from service.routes.playground import ASSETS, PAGE_DIR
from service.settings import Settings
from tests.service.conftest import CORPUS, settings_for
from tests.service.server_thread import ServerThread

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("generate-en", "translate-en-de", "fill-mask-en")
API_KEY = "playground-test-key"
ARTIFACTS = Path(os.environ.get("TSERVE_TEST_ARTIFACTS", ROOT / "build" / "test-artifacts")) / "playground"
DOCS_SCREENSHOTS = ROOT / "docs" / "screenshots"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


# --- without a browser -------------------------------------------------------------------

def _page_files() -> dict[str, str]:
    return {name: (PAGE_DIR / name).read_text() for name in ["index.html", *ASSETS]}


def test_page_and_assets_are_served_with_a_strict_policy(tmp_path):
    client = TestClient(create_app(settings_for(tmp_path)))  # no lifespan: the page needs no model
    for path in ("/", "/playground"):
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in r.headers["content-security-policy"]
        assert "connect-src 'self'" in r.headers["content-security-policy"]
    html = client.get("/").text
    referenced = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert referenced and all(ref.startswith("playground/assets/") for ref in referenced), referenced
    for ref in referenced + [f"playground/assets/{name}" for name in ASSETS]:
        r = client.get("/" + ref)
        assert r.status_code == 200 and r.content, ref
    assert client.get("/playground/assets/../settings.py").status_code == 404
    assert client.get("/playground/assets/nothing.js").json()["error"]["code"] == "not_found"


def test_page_references_no_other_host():
    for name, text in _page_files().items():
        assert not re.search(r"(?i)\b(?:https?|wss?|ftp):", text), name  # no absolute URL at all
        assert not re.search(r"""["'(]\s*//""", text), name  # no protocol-relative URL
        assert "@import" not in text, name
        imports = re.findall(r"""from\s+["']([^"']+)["']""", text)
        assert all(i.startswith("./") for i in imports), (name, imports)
    # every module the page imports is one we serve
    for name, text in _page_files().items():
        for module in re.findall(r"""from\s+["']\./([^"']+)["']""", text):
            assert module in ASSETS, (name, module)


def test_playground_false_turns_the_page_off(tmp_path, monkeypatch):
    monkeypatch.setenv("TSERVE_PLAYGROUND", "false")
    settings = Settings(_env_file=None, weights_dir=tmp_path)
    assert settings.playground is False
    client = TestClient(create_app(settings))
    for path in ("/playground", "/playground/assets/main.js"):
        r = client.get(path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path
    # `/` only takes POST then (the Hugging Face Inference API route): GET is a 405, not the page
    r = client.get("/")
    assert r.status_code == 405 and r.headers["content-type"] == "application/json"
    assert client.get("/docs").status_code == 200  # the API and its docs stay


# --- in a browser ----------------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser_weights(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("playground-weights")
    for name in SHIPPED:
        (root / name).symlink_to(ROOT / "weights" / name, target_is_directory=True)
    tok = train_bpe(CORPUS, vocab_size=320, template="<s> $A")
    cfg = ModelConfig(family="decoder", vocab_size=tok.vocab_size, d_model=32, n_heads=4, n_decoder_layers=2,
                      d_ff=64, dropout=0.0, max_positions=1024, pad_token_id=0, bos_token_id=1,
                      eos_token_id=None, norm_placement="pre", final_norm=True, positional="learned")
    # never ends by itself; chats through a small ChatML-like template
    save(root / "generate-long", build_model(cfg).init_weights(7).eval(), tok, chat_template=CHAT_TEMPLATE)
    return root


def _slow_down(server: ServerThread, model: str, seconds_per_step: float) -> None:
    core = server.app.state.registry.engines[model].core
    step = core.step
    core.step = lambda: (time.sleep(seconds_per_step), step())[1]


@pytest.fixture(scope="module")
def server(browser_weights):
    # fill-mask-en without its rescorer: gemma3-270m is not in this weights directory
    with ServerThread(settings_for(browser_weights, max_seq_len=1024, max_batch=4, fill_mask_rescore=False)) as s:
        _slow_down(s, "generate-long", 0.02)
        yield s


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("no Chromium here (Debian: apt-get install chromium chromium-driver; CI installs them)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the test extra")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1200,860",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    browser.set_page_load_timeout(30)
    yield browser
    browser.quit()


def _wait(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _open(driver, url: str, tab: str):
    from selenium.webdriver.common.by import By

    driver.get("about:blank")  # a fresh page each time, not just a new #fragment
    driver.get(f"{url}/#{tab}")
    _wait(lambda: driver.find_element(By.ID, f"panel-{tab}").is_displayed(), what=f"the {tab} panel")
    return driver.find_element(By.ID, f"panel-{tab}")


def _fill(panel, name: str, value) -> None:
    from selenium.webdriver.common.by import By

    field = panel.find_element(By.NAME, name)
    if field.tag_name == "select":
        from selenium.webdriver.support.select import Select

        Select(field).select_by_value(str(value))
        return
    field.clear()
    field.send_keys(str(value))


def _state(panel) -> str:
    return panel.get_attribute("data-state") or ""


def _finished(panel, timeout: float = 30.0) -> str:
    state = _wait(lambda: _state(panel) if _state(panel) in ("done", "stopped", "error") else "", timeout,
                  "the request to finish")
    return state


def _figure(panel, key: str) -> str:
    from selenium.webdriver.common.by import By

    return panel.find_element(By.CSS_SELECTOR, f'[data-figure="{key}"]').text


def _error(panel) -> str:
    from selenium.webdriver.common.by import By

    box = panel.find_element(By.CSS_SELECTOR, "[data-error]")
    return box.text if box.is_displayed() else ""


def _screenshot(driver, name: str) -> None:
    width = driver.execute_script("return window.innerWidth")
    height = driver.execute_script("return document.documentElement.scrollHeight")
    # the whole page, not just what fits the window
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                           {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
    try:
        png = driver.get_screenshot_as_png()
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / f"{name}.png").write_bytes(png)
    if os.environ.get("TSERVE_UPDATE_SCREENSHOTS") == "1":
        DOCS_SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        (DOCS_SCREENSHOTS / f"{name}.png").write_bytes(png)


@pytest.mark.slow
def test_tabs_follow_the_loaded_models(server, driver):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    _open(driver, server.url, "generate")
    tabs = {t.get_attribute("data-tab"): t.is_displayed() for t in driver.find_elements(By.CSS_SELECTOR, "[role=tab]")}
    assert tabs == {"chat": True, "generate": True, "translate": True, "fill-mask": True, "embeddings": True}

    def options(tab: str) -> list[str]:
        return sorted(o.get_attribute("value")
                      for o in driver.find_elements(By.CSS_SELECTOR, f"#panel-{tab} select[name=model] option"))

    assert options("generate") == ["generate-en", "generate-long"]
    assert options("chat") == ["generate-long"]  # the only model with a chat template ("chat": true)
    assert options("embeddings") == options("fill-mask") == ["fill-mask-en"]
    # keyboard: arrows move between the tabs (roving focus), the panel follows
    tab = driver.find_element(By.ID, "tab-generate")
    tab.send_keys(Keys.ARROW_LEFT)
    assert driver.switch_to.active_element.get_attribute("id") == "tab-chat"
    driver.switch_to.active_element.send_keys(Keys.ARROW_RIGHT, Keys.ARROW_RIGHT)
    assert driver.switch_to.active_element.get_attribute("id") == "tab-translate"
    assert driver.find_element(By.ID, "panel-translate").is_displayed()
    driver.switch_to.active_element.send_keys(Keys.END)
    assert driver.find_element(By.ID, "panel-embeddings").is_displayed()


@pytest.mark.slow
def test_generate_streams_text_into_the_page(server, driver):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    panel = _open(driver, server.url, "generate")
    _fill(panel, "model", "generate-long")
    _fill(panel, "max_tokens", 40)
    _fill(panel, "seed", 3)
    output = panel.find_element(By.CSS_SELECTOR, "[data-output]")
    prompt = panel.find_element(By.NAME, "prompt")
    prompt.send_keys(Keys.CONTROL, Keys.ENTER)  # Ctrl+Enter sends
    lengths = set()
    _wait(lambda: lengths.add(len(output.text)) or _state(panel) == "done", 30, "the stream to end")
    assert len(lengths) >= 4, lengths  # the text grew chunk by chunk, not all at once
    assert _figure(panel, "out") == "40" and _figure(panel, "in") != "–"
    assert _figure(panel, "ttft").endswith("ms") or _figure(panel, "ttft").endswith(" s")
    assert float(_figure(panel, "rate")) > 0
    assert output.text.startswith("To be, or not to be") and len(output.text) > len("To be, or not to be")

    # the shipped model, for the screenshot
    _fill(panel, "model", "generate-en")
    _fill(panel, "max_tokens", 48)
    _fill(panel, "seed", 4)
    panel.find_element(By.CSS_SELECTOR, "[data-send]").click()
    assert _finished(panel) == "done", _error(panel)
    _screenshot(driver, "playground-generate")


@pytest.mark.slow
def test_stop_aborts_the_generation_and_frees_the_slot(server, driver):
    from selenium.webdriver.common.by import By

    panel = _open(driver, server.url, "generate")
    _fill(panel, "model", "generate-long")
    _fill(panel, "max_tokens", 900)  # 18 s at the slowed-down pace
    before = server.metric("tserve_generated_tokens_total", model="generate-long")
    panel.find_element(By.CSS_SELECTOR, "[data-send]").click()
    output = panel.find_element(By.CSS_SELECTOR, "[data-output]")
    _wait(lambda: len(output.text) > len("To be, or not to be") + 10, what="streamed text")
    assert server.metric("tserve_running_requests", model="generate-long") == 1
    # the load panel reads the same gauges from /metrics (it polls every 2 s)
    _wait(lambda: driver.find_element(By.ID, "load-running").text == "1", 10, "the load panel to show 1")
    assert driver.find_element(By.ID, "load-kv").text.endswith("%")
    stop = panel.find_element(By.CSS_SELECTOR, "[data-stop]")
    started = time.monotonic()
    stop.click()
    assert _finished(panel, 5) == "stopped"
    _wait(lambda: server.metric("tserve_running_requests", model="generate-long") == 0, 10, "running 0")
    assert time.monotonic() - started < 10
    assert server.metric("tserve_kv_cache_slots_used", model="generate-long") == 0
    assert server.metric("tserve_generated_tokens_total", model="generate-long") - before < 900
    send = panel.find_element(By.CSS_SELECTOR, "[data-send]")
    assert not stop.is_enabled() and send.is_enabled()
    assert driver.switch_to.active_element == send  # the keyboard focus went Send -> Stop -> Send
    assert _error(panel) == ""  # stopping is not an error
    _wait(lambda: driver.find_element(By.ID, "load-running").text == "0", 10, "the load panel to show 0 again")


@pytest.mark.slow
def test_translate_a_sentence(server, driver):
    from selenium.webdriver.common.by import By

    panel = _open(driver, server.url, "translate")
    _fill(panel, "text", "Open the file")
    panel.find_element(By.CSS_SELECTOR, "[data-send]").click()
    assert _finished(panel) == "done", _error(panel)
    expected = httpx.post(server.url + "/v1/translate", json={"text": "Open the file", "beam_size": 4},
                          timeout=30).json()["translations"][0]["text"]
    target = panel.find_element(By.CSS_SELECTOR, "[data-output] .target").text
    assert target == expected and target
    assert int(_figure(panel, "in")) > 0 and int(_figure(panel, "out")) > 0

    _fill(panel, "text", "Save the document\nClose the window")  # several lines: one list request
    panel.find_element(By.CSS_SELECTOR, "[data-send]").click()
    assert _finished(panel) == "done", _error(panel)
    assert len(panel.find_elements(By.CSS_SELECTOR, "[data-output] li")) == 2
    _screenshot(driver, "playground-translate")


@pytest.mark.slow
def test_an_unloaded_model_is_driven_from_its_tab(browser_weights, driver, monkeypatch):
    """TSERVE_PRELOAD=none: the tabs come from the models' cards (nothing loaded), the panel says
    its model loads on first use, and a request shows the load as it happens, then its answer."""
    from selenium.webdriver.common.by import By

    import service.models.loading as loading

    real_load = loading.load_model
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: (time.sleep(3), real_load(*a, **k))[1])  # watchable
    settings = settings_for(browser_weights, max_seq_len=1024, max_batch=4, preload="none", fill_mask_rescore=False)
    with ServerThread(settings) as s:
        assert {m["state"] for m in httpx.get(s.url + "/v1/models").json()["data"]} == {"available"}
        panel = _open(driver, s.url, "translate")
        shown = [t.get_attribute("data-tab") for t in driver.find_elements(By.CSS_SELECTOR, "[role=tab]")
                 if t.is_displayed()]
        assert shown == ["chat", "generate", "translate", "fill-mask", "embeddings"]
        note = panel.find_element(By.CSS_SELECTOR, "[data-model-state]")
        choice = panel.find_element(By.CSS_SELECTOR, "select[name=model] option:checked")
        assert "loads on its first request" in note.text and choice.text == "translate-en-de (not loaded)"
        _screenshot(driver, "playground-not-loaded")
        _fill(panel, "text", "Open the file")
        panel.find_element(By.CSS_SELECTOR, "[data-send]").click()
        _wait(lambda: "Loading the model" in note.text, what="the load shown as it happens")
        assert _finished(panel, timeout=120) == "done", _error(panel)
        assert panel.find_element(By.CSS_SELECTOR, "[data-output] .target").text
        _wait(lambda: not note.is_displayed(), what="the note gone once loaded")
        assert panel.find_element(By.CSS_SELECTOR, "select[name=model] option:checked").text == "translate-en-de"
        states = {m["id"]: m["state"] for m in httpx.get(s.url + "/v1/models").json()["data"]}
        assert states.pop("translate-en-de") == "loaded" and set(states.values()) == {"available"}


@pytest.mark.slow
def test_fill_mask_bars_and_the_servers_error_message(server, driver):
    from selenium.webdriver.common.by import By

    panel = _open(driver, server.url, "fill-mask")
    _fill(panel, "text", "the file menu")  # no mask: the server's own message is shown
    panel.find_element(By.CSS_SELECTOR, "[data-send]").click()
    assert _finished(panel) == "error"
    assert "must contain the mask token" in _error(panel)

    text = "The [MASK] of the river was calm."
    _fill(panel, "text", text)
    panel.find_element(By.CSS_SELECTOR, "[data-send]").click()
    assert _finished(panel) == "done", _error(panel)
    assert _error(panel) == ""
    expected = httpx.post(server.url + "/v1/fill-mask", json={"text": text, "top_k": 5}, timeout=30).json()
    rows = panel.find_elements(By.CSS_SELECTOR, "[data-output] .candidate")
    assert [r.find_element(By.CSS_SELECTOR, ".token").text for r in rows] == [c["token_str"] for c in expected]
    widths = [r.find_element(By.CSS_SELECTOR, ".bar").size["width"] for r in rows]
    assert widths == sorted(widths, reverse=True) and widths[0] > widths[-1] >= 1  # bars scale with the score
    _screenshot(driver, "playground-fill-mask")


@pytest.mark.slow
def test_embeddings_heat_map(server, driver):
    from selenium.webdriver.common.by import By

    panel = _open(driver, server.url, "embeddings")
    panel.find_element(By.CSS_SELECTOR, "[data-send]").click()  # the four example sentences
    assert _finished(panel) == "done", _error(panel)
    cells = panel.find_elements(By.CSS_SELECTOR, "[data-output] td")
    assert len(cells) == 16
    sims = [float(c.get_attribute("data-similarity")) for c in cells]
    assert all(sims[i * 4 + i] == pytest.approx(1.0, abs=1e-4) for i in range(4))  # each with itself
    assert all(sims[i * 4 + j] == pytest.approx(sims[j * 4 + i], abs=1e-6) for i in range(4) for j in range(4))
    assert int(_figure(panel, "in")) > 0
    _screenshot(driver, "playground-embeddings")


@pytest.mark.slow
def test_phone_sized_window(server, driver):
    from selenium.webdriver.common.by import By

    driver.set_window_size(390, 844)
    try:
        panel = _open(driver, server.url, "translate")
        panel.find_element(By.CSS_SELECTOR, "[data-send]").click()
        assert _finished(panel) == "done", _error(panel)
        # nothing wider than the screen: no sideways scrolling
        assert driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
        _screenshot(driver, "playground-phone")
    finally:
        driver.set_window_size(1200, 860)


@pytest.mark.slow
def test_api_key_is_asked_for_and_sent(weights_dir, driver):
    from selenium.webdriver.common.by import By

    with ServerThread(settings_for(weights_dir, api_key=API_KEY)) as s:
        driver.get(s.url + "/#fill-mask")
        dialog = driver.find_element(By.ID, "key-dialog")
        _wait(dialog.is_displayed, what="the key dialog")  # /v1/models answered 401
        assert "API key" in driver.find_element(By.ID, "key-reason").text
        _screenshot(driver, "playground-api-key")
        key = driver.find_element(By.ID, "key-input")
        key.send_keys("wrong key")
        driver.find_element(By.ID, "key-save").click()
        _wait(dialog.is_displayed, what="the key dialog, again")  # still refused
        key.clear()
        key.send_keys(API_KEY)
        driver.find_element(By.ID, "key-save").click()
        panel = driver.find_element(By.ID, "panel-fill-mask")
        _wait(panel.is_displayed, what="the fill-mask panel")
        assert driver.execute_script("return sessionStorage.getItem('tserve.apiKey')") == API_KEY
        _fill(panel, "text", "a [MASK] day")
        panel.find_element(By.CSS_SELECTOR, "[data-send]").click()
        assert _finished(panel) == "done", _error(panel)
        assert s.metric("tserve_requests_total", endpoint="/v1/fill-mask", status="200") == 1
        assert driver.find_element(By.ID, "key-button").text == "API key ✓"
        driver.execute_script("sessionStorage.clear()")


@pytest.mark.slow
def test_chat_turns_stream_and_stop(server, driver):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    panel = _open(driver, server.url, "chat")
    panel.find_element(By.CSS_SELECTOR, "details.params summary").click()
    _fill(panel, "max_tokens", 30)
    _fill(panel, "seed", 5)
    _fill(panel, "system", "You are terse.")
    message = panel.find_element(By.NAME, "message")
    message.send_keys("Hello there")
    message.send_keys(Keys.ENTER)  # Enter sends in the chat
    reply = _wait(lambda: (panel.find_elements(By.CSS_SELECTOR, "[data-log] li[data-role=assistant]") or [None])[-1],
                  what="the assistant's bubble")
    lengths = set()
    _wait(lambda: lengths.add(len(reply.text)) or _state(panel) == "done", 30, "the reply to end")
    assert len(lengths) >= 4, lengths  # streamed token by token
    assert _error(panel) == "" and reply.text
    first_prompt = int(_figure(panel, "in"))  # the server's usage (stream_options.include_usage)
    assert _figure(panel, "out") == "30" and first_prompt > 0
    assert message.get_attribute("value") == ""

    # the same turn through the API gives the same text: the page sent the conversation as given
    body = {"model": "generate-long", "max_tokens": 30, "seed": 5, "temperature": 0.8, "top_p": 0.95,
            "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]}
    expected = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).json()
    assert reply.text == expected["choices"][0]["message"]["content"]

    # a second turn carries the first; Stop ends it and frees the slot
    _fill(panel, "max_tokens", 600)  # 12 s at the slowed-down pace
    prompt_before = server.metric("tserve_prompt_tokens_total", model="generate-long")
    message.send_keys("And again?", Keys.ENTER)
    second = _wait(lambda: len(panel.find_elements(By.CSS_SELECTOR, "[data-log] li[data-role=assistant]")) == 2
                   and panel.find_elements(By.CSS_SELECTOR, "[data-log] li[data-role=assistant]")[-1],
                   what=f"turn 2 ({_state(panel)}: {_error(panel)})")
    _wait(lambda: len(second.text) > 5, what="the second reply")
    panel.find_element(By.CSS_SELECTOR, "[data-stop]").click()
    assert _finished(panel, 5) == "stopped"
    _wait(lambda: server.metric("tserve_running_requests", model="generate-long") == 0, 10, "running 0")
    assert second.get_attribute("data-stopped") is not None
    # turn 2's prompt held turn 1 (system, question, answer) and the new question
    assert server.metric("tserve_prompt_tokens_total", model="generate-long") - prompt_before > first_prompt + 30
    assert [li.get_attribute("data-role") for li in panel.find_elements(By.CSS_SELECTOR, "[data-log] li")] == \
        ["user", "assistant", "user", "assistant"]
    _screenshot(driver, "playground-chat")


def test_chat_with_a_json_schema_and_tools(tmp_path, driver):
    import jsonschema
    from selenium.webdriver.common.by import By

    from tests.service.test_structured_outputs import PERSON, WEATHER, make_weights

    with ServerThread(settings_for(make_weights(tmp_path), max_seq_len=1024, max_batch=2)) as s:
        panel = _open(driver, s.url, "chat")
        panel.find_element(By.CSS_SELECTOR, "details.params summary").click()
        panel.find_element(By.CSS_SELECTOR, "details[data-structured] summary").click()
        _fill(panel, "max_tokens", 200)
        _fill(panel, "seed", 3)
        put = lambda name, value: driver.execute_script(  # noqa: E731 - long JSON: set, not typed
            "arguments[0].value = arguments[1]", panel.find_element(By.NAME, name), value)
        put("json_schema", "{not json")
        panel.find_element(By.NAME, "message").send_keys("Invent a person.")
        panel.find_element(By.CSS_SELECTOR, "[data-send]").click()
        assert _finished(panel) == "error" and "The JSON schema is not valid JSON" in _error(panel)

        put("json_schema", json.dumps(PERSON))
        panel.find_element(By.CSS_SELECTOR, "[data-send]").click()
        assert _finished(panel) == "done", _error(panel)
        reply = panel.find_elements(By.CSS_SELECTOR, "[data-log] li[data-role=assistant]")[-1]
        jsonschema.validate(json.loads(reply.text), PERSON)

        put("json_schema", "")
        put("tools", json.dumps([WEATHER]))
        _fill(panel, "tool_choice", "required")
        panel.find_element(By.NAME, "message").send_keys("Weather in Paris?")
        panel.find_element(By.CSS_SELECTOR, "[data-send]").click()
        assert _finished(panel) == "done", _error(panel)
        reply = panel.find_elements(By.CSS_SELECTOR, "[data-log] li[data-role=assistant]")[-1]
        shown = [c.text for c in reply.find_elements(By.CSS_SELECTOR, "code.tool-call")]
        assert shown and reply.get_attribute("data-tool-calls") is not None
        name, arguments = shown[0].split("(", 1)
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments[:-1]), WEATHER["function"]["parameters"])


def test_a_model_that_recommends_its_sampling_fills_the_fields(tmp_path, driver):
    """chat-tiny recommends temperature 0.3 and top-p 0.7 (its generation_config.json, shown by
    /v1/models as sampling_defaults): choosing it fills them in; a model that recommends nothing
    leaves the page's own values."""
    from selenium.webdriver.common.by import By

    from tests.service.test_structured_outputs import make_weights

    root = make_weights(tmp_path)
    shutil.copytree(root / "chat-tiny", root / "chat-plain")  # the same model, recommending nothing
    (root / "chat-tiny" / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_p": 0.7}))
    with ServerThread(settings_for(root, max_seq_len=256, max_batch=2)) as s:
        panel = _open(driver, s.url, "chat")
        value = lambda name: panel.find_element(By.NAME, name).get_attribute("value")  # noqa: E731
        assert panel.find_element(By.NAME, "model").get_attribute("value") == "chat-plain"  # the first, sorted
        assert (value("temperature"), value("top_p")) == ("0.8", "0.95")  # the page's own
        _fill(panel, "model", "chat-tiny")
        assert (value("temperature"), value("top_p")) == ("0.3", "0.7")
