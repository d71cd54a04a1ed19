"""The one direction of imports (docs/ARCHITECTURE.md, "Layers"), checked on the source, not by convention."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WEB_STACK = ("fastapi", "starlette", "pydantic", "pydantic_settings", "prometheus_client", "uvicorn", "httpx")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def offenders(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for f in files:
        for name in sorted(imported_modules(f)):
            if any(name == bad or name.startswith(bad + ".") for bad in forbidden):
                found.append(f"{f.relative_to(ROOT)} imports {name}")
    return found


def py_files(*parts: str) -> list[Path]:
    files = sorted(ROOT.joinpath(*parts).rglob("*.py"))
    assert files, f"no Python files under {'/'.join(parts)}"
    return files


@pytest.mark.parametrize("where,forbidden", [
    (("model",), WEB_STACK + ("service",)),  # usable alone, in a notebook
    (("service",), ("model.train",)),  # training is offline only
    (("service", "routes"), ("model", "service.scheduler")),  # routes reach the model only through the engine
])
def test_imports_go_one_way(where, forbidden):
    assert offenders(py_files(*where), forbidden) == []


# The HTTP edge of the service: the app and its server, the ASGI middleware, the dependencies
# routes declare, the HTTP error handlers and the OpenAPI document. Below them (engines,
# registry, translation, catalogues, waiting for results) nothing knows about HTTP: a client is
# an ``is_disconnected`` callable, an error an ``EngineError`` with a code.
HTTP_EDGE = {"app.py": ("fastapi", "service.routes"), "server.py": ("fastapi", "uvicorn"),
             "middleware.py": ("starlette",), "dependencies.py": ("fastapi",),
             "errors.py": ("fastapi", "starlette"), "openapi.py": ("fastapi",)}
HTTP_STACK = ("fastapi", "starlette", "uvicorn", "service.routes")


def test_the_service_layer_under_the_routes_is_http_free():
    below = [f for f in py_files("service") if "routes" not in f.relative_to(ROOT / "service").parts
             and f.name not in HTTP_EDGE]
    assert ROOT / "service" / "translation.py" in below and ROOT / "service" / "waiting.py" in below
    assert offenders(below, HTTP_STACK) == []


@pytest.mark.parametrize("name", sorted(HTTP_EDGE))
def test_the_http_edge_imports_only_what_it_is_listed_for(name):
    allowed = HTTP_EDGE[name]
    path = ROOT / "service" / name
    assert offenders([path], tuple(m for m in HTTP_STACK if m not in allowed)) == []
    assert offenders([path], allowed), f"service/{name} no longer needs {allowed}: take it off HTTP_EDGE"


# The placeholder-safe translation sequence is written once, in model/: both of its users
# import it, and a translate request passes each layer once (route -> service.translation ->
# model.text.translate -> engine).
TRANSLATION_DRIVER = "model.text.translate"


def test_one_translation_driver_for_training_and_service():
    driver = ROOT / "model" / "text" / "translate.py"
    assert offenders([driver], ("service", "model.train", "torch")) == []  # plain text logic, a callback
    for user in ("model/train/evaluate.py", "service/translation.py"):
        assert TRANSLATION_DRIVER in imported_modules(ROOT / user), f"{user} does not use {TRANSLATION_DRIVER}"
    # only the driver unmasks and retries; service.translation keeps the streamed case (no retry possible)
    assert "unmask" not in (ROOT / "model" / "train" / "evaluate.py").read_text()
    assert offenders([ROOT / "service" / "translation.py"], HTTP_STACK) == []


def test_schemas_do_not_import_model():
    files = [ROOT / "service" / "schemas.py", ROOT / "service" / "openai_schemas.py"]
    assert offenders(files, ("model",)) == []


# An engine's internals: the tokenizer, the model config and weights, the scheduler. A route
# calls engine methods (tokenize, validate_ids, usage, token_text, ...) instead.
ENGINE_INTERNALS = {"tokenizer", "cfg", "ckpt", "model", "scheduler"}
REQUEST_BODIES = {"body"}  # a request's own `model` field is fine: `body.model`


def internal_accesses(source: str, filename: str = "<source>") -> list[str]:
    """`x.tokenizer`, `x.cfg`, `engine.model`, ... in ``source``, as 'file:line x.attr'."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if not isinstance(node, ast.Attribute) or node.attr not in ENGINE_INTERNALS:
            continue
        base = ast.unparse(node.value)
        if node.attr == "model" and base in REQUEST_BODIES:
            continue
        found.append((node.lineno, f"{filename}:{node.lineno} {base}.{node.attr}"))
    return [hit for _, hit in sorted(found)]


def test_routes_do_not_reach_into_engines():
    found = [hit for f in py_files("service", "routes")
             for hit in internal_accesses(f.read_text(), str(f.relative_to(ROOT)))]
    assert found == []


def test_the_route_check_sees_engine_internals():
    snippet = """
ids = engine.tokenizer.encode(text)
limit = registry.get(None, "decoder", "/x").cfg.vocab_size
weights = engine.model.state_dict()
name = body.model
"""
    assert [hit.split(" ", 1)[1] for hit in internal_accesses(snippet)] == [
        "engine.tokenizer", 'registry.get(None, \'decoder\', \'/x\').cfg', "engine.model"]
