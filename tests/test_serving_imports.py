"""`make run` installs the serving dependencies only (pyproject's base dependencies, the `serve`
extra); the dev extras (tests, benchmarks, training, triton) are not there. So the service must
start and answer without any package that only those extras bring.

The check runs here, in the dev venv, on a copy of its site-packages (symlinks) without the
dev-only distributions: `python -S` (no site, so no other site-packages and no .pth hooks)
with that copy on PYTHONPATH sees them as not installed, to imports, ``find_spec`` probes and
``importlib.metadata`` alike. `python -m service` started so loads the shipped models and
answers one request per endpoint family."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
from packaging.requirements import Requirement  # noqa: E402
from packaging.utils import canonicalize_name  # noqa: E402

from benchmarks.harness.server_process import ServerProcess, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "transformer-serve"

def _project_requirements(extras: tuple[str, ...]) -> list[Requirement]:
    """pyproject.toml's base dependencies plus those of ``extras``, self-references expanded."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    found, todo, seen = [Requirement(r) for r in project["dependencies"]], list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for line in optional[extra]:
            req = Requirement(line)
            if canonicalize_name(req.name) == PROJECT:
                todo.extend(req.extras)
            else:
                found.append(req)
    return found


def _closure(requirements: list[Requirement]) -> set[str]:
    """The installed distributions ``requirements`` pull in, transitively (canonical names);
    requirements whose marker does not hold here, or that are not installed, are left out."""
    names, todo = set(), [(r, "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        key = (name, tuple(sorted(req.extras)))
        if key in names:
            continue
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        names.add(key)
        for line in requires:
            sub = Requirement(line)
            if sub.marker is None:
                todo.append((sub, ""))
            else:
                todo.extend((sub, e) for e in ("", *req.extras))
    return {name for name, _ in names}


def _top_level_modules(distribution: str) -> set[str]:
    dist = metadata.distribution(distribution)
    listed = dist.read_text("top_level.txt")
    if listed:
        return {line.strip() for line in listed.splitlines() if line.strip()}
    tops = set()
    for file in dist.files or []:
        first = file.parts[0]
        if first.endswith((".dist-info", ".data", ".pth")) or first in ("..", "__pycache__"):
            continue
        if len(file.parts) == 1:
            if first.endswith(".py") or ".cpython-" in first or first.endswith(".so"):
                tops.add(re.split(r"[.]", first)[0])
        else:
            tops.add(first)
    return tops


def _serving_and_dev_only() -> tuple[set[str], set[str]]:
    serving = _closure(_project_requirements(("serve",)))
    return serving, _closure(_project_requirements(("dev",))) - serving


def dev_only_modules() -> set[str]:
    """Top-level modules of the distributions the dev extra brings and serving does not."""
    serving, dev = _serving_and_dev_only()
    keep = set().union(*(_top_level_modules(d) for d in serving))
    return set().union(*(_top_level_modules(d) for d in dev)) - keep


def _entries(distribution: str, site: Path) -> set[str]:
    """The names directly in ``site`` that ``distribution`` installed (packages, modules, its
    .dist-info, bundled .libs)."""
    dist = metadata.distribution(distribution)
    names = set()
    for file in dist.files or []:
        path = Path(str(dist.locate_file(file))).resolve()
        if path.is_relative_to(site):
            names.add(path.relative_to(site).parts[0])
    return names


def serving_site(where: Path) -> Path:
    """``where``/site-packages: symlinks to this venv's site-packages entries, less the dev-only
    distributions' (what a `make run` venv lacks)."""
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    serving, dev = _serving_and_dev_only()
    drop = set().union(*(_entries(d, site) for d in dev)) - set().union(*(_entries(d, site) for d in serving))
    out = where / "site-packages"
    out.mkdir(parents=True)
    for entry in site.iterdir():
        if entry.name not in drop and not entry.name.endswith(".pth") and entry.name != "__pycache__":
            (out / entry.name).symlink_to(entry)
    return out


def serving_python(where: Path) -> tuple[list[str], dict[str, str]]:
    """The command prefix and environment of a python that sees only the serving packages."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{serving_site(where)}", "PYTHONNOUSERSITE": "1"}
    return [sys.executable, "-S"], env


def test_the_dev_only_set_names_the_heavy_packages():
    blocked = dev_only_modules()
    missing = {"transformers", "selenium", "pytest", "schemathesis", "openai"} - blocked
    assert not missing, f"installed in the dev venv but not seen as dev-only: {missing}"
    for heavy in ("triton", "ctranslate2", "sentence_transformers", "xgrammar", "sentencepiece"):
        try:
            metadata.distribution(heavy.replace("_", "-"))
        except metadata.PackageNotFoundError:
            continue
        assert heavy in blocked, heavy
    assert not {"torch", "tokenizers", "gguf", "llguidance", "fastapi", "numpy", "service", "model"} & blocked


def test_the_serving_python_lacks_the_dev_packages(tmp_path):
    command, env = serving_python(tmp_path)
    code = ("import importlib.metadata as md, importlib.util as u\n"
            "for name in ('transformers', 'pytest', 'selenium'):\n"
            "    assert u.find_spec(name) is None, name\n"
            "    try:\n        md.version(name)\n    except md.PackageNotFoundError:\n        pass\n"
            "    else:\n        raise AssertionError(name + ' metadata')\n"
            "import torch, tokenizers, gguf, llguidance, fastapi, model, service\n"
            "print('serving imports ok', md.version('torch'))\n")
    out = subprocess.run([*command, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "serving imports ok" in out.stdout


def _call(url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, object]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, err.read()[:500]


@pytest.mark.slow
def test_the_service_serves_the_shipped_models_without_dev_packages(tmp_path):
    """The real `python -m service` on the shipped weights/ (every model whose package is
    installed), without the dev-only packages: it becomes ready and answers a chat completion
    with a JSON schema (llguidance), an embedding, a translation and a fill-mask."""
    port = free_port()
    command, env = serving_python(tmp_path)
    # the venv's bin/ (ninja, for a native step not built yet) as an activated venv has it
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    server = ServerProcess([*command, "-m", "service", "--port", str(port), "--log-level", "warning"],
                           tmp_path / "server.log", port=port, env=env, cwd=ROOT, stop_grace_s=60).start()
    base, log_path = server.url, server.log_path
    try:
        deadline = time.monotonic() + 600  # a first start converts the GGUF models and builds the native step
        while True:  # not wait_ready(): a model that failed (/health not 200) ends the wait at once
            assert server.alive(), "the server exited:\n" + log_path.read_text()[-4000:]
            try:
                if _call(base + "/ready", timeout=5)[0] == 200:
                    break
                health = _call(base + "/health", timeout=5)
                assert health[0] == 200, f"/health {health}:\n" + log_path.read_text()[-4000:]  # a model failed
            except OSError:
                pass
            assert time.monotonic() < deadline, "never ready:\n" + log_path.read_text()[-4000:]
            time.sleep(0.5)
        status, models = _call(base + "/v1/models")
        assert status == 200
        served = {m["id"]: m for m in models["data"]}
        # a loaded one: an on-demand model's card says "chat" too now (the Qwen2.5-Coder ones, where installed)
        chat = next((name for name, m in served.items() if m.get("chat") and m["state"] == "loaded"), None)
        if chat:
            schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
            status, body = _call(base + "/v1/chat/completions", {
                "model": chat, "messages": [{"role": "user", "content": "Name a person."}], "max_tokens": 24,
                "temperature": 0, "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "person", "schema": schema}}})
            assert status == 200, body
            assert "name" in json.loads(body["choices"][0]["message"]["content"])
        if "all-minilm-l6-v2" in served:
            status, body = _call(base + "/v1/embeddings", {"model": "all-minilm-l6-v2", "input": "hello"})
            assert status == 200 and len(body["data"][0]["embedding"]) == 384, body
        status, body = _call(base + "/v1/translate", {"text": "Open the file", "max_tokens": 16})
        assert status == 200 and body["translations"][0]["text"].strip(), body
        if "fill-mask-en" in served:  # all-MiniLM-L6-v2's package plus the head in weights/fill-mask-en
            status, body = _call(base + "/v1/fill-mask", {"model": "fill-mask-en", "text": "The [MASK] of the river."})
            assert status == 200 and body and "token_str" in body[0], body
    finally:
        server.stop()
