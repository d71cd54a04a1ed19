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
    (("service", "routes"), ("model", "torch")),  # routes reach the model only through an engine
])
def test_imports_go_one_way(where, forbidden):
    assert offenders(py_files(*where), forbidden) == []


def test_the_encoder_engine_leaves_pytorch_to_the_model_side_core():
    """service/engines/encoder.py keeps the queue, the thread, deadlines, metrics and errors; the
    batching, pooling, normalising and top-k are ``model.encoder.EncoderCore``'s."""
    engine = ROOT / "service" / "engines" / "encoder.py"
    assert offenders([engine], ("torch",)) == []
    assert "model.encoder" in imported_modules(engine)


# The service's sub-packages, each one concern; a module at service/'s top level is shared by all
# of them (settings, metrics, units, logging) or is the entry point.
SERVICE_PACKAGES = {"http", "routes", "engines", "models", "schemas", "chat", "translation", "playground"}
SERVICE_TOP = {"__init__.py", "__main__.py", "settings.py", "metrics.py", "units.py", "logging_config.py"}


def test_service_shows_its_parts_in_folders():
    service = ROOT / "service"
    assert {p.name for p in service.iterdir() if p.is_dir() and p.name != "__pycache__"} == SERVICE_PACKAGES
    assert {p.name for p in service.glob("*.py")} == SERVICE_TOP


# The HTTP edge of the service: service/http/ (the app and its server, the ASGI middleware, the
# dependencies routes declare, the HTTP error handlers, the OpenAPI document), the routes, and the
# drop-in routes' schema beside them. Below them (engines, models, chat, translation, schemas)
# nothing knows about HTTP: a client is a ``client_gone`` callable, an error an ``EngineError``
# with a code.
HTTP_EDGE = {"app.py": ("fastapi", "service.routes"), "server.py": ("fastapi", "uvicorn"),
             "middleware.py": ("starlette",), "dependencies.py": ("fastapi",),
             "errors.py": ("fastapi", "starlette"), "openapi.py": ("fastapi", "service.routes")}
HTTP_STACK = ("fastapi", "starlette", "uvicorn", "service.routes", "service.http")


def test_the_service_layer_under_the_routes_is_http_free():
    below = [f for f in py_files("service")  # the entry point (__main__) starts the HTTP server
             if f.relative_to(ROOT / "service").parts[0] not in ("routes", "http", "__main__.py")]
    assert ROOT / "service" / "translation" / "translate.py" in below
    assert ROOT / "service" / "engines" / "waiting.py" in below
    assert offenders(below, HTTP_STACK) == []


def test_the_http_edge_is_all_listed():
    assert {p.name for p in (ROOT / "service" / "http").glob("*.py")} - {"__init__.py"} == set(HTTP_EDGE)


@pytest.mark.parametrize("name", sorted(HTTP_EDGE))
def test_the_http_edge_imports_only_what_it_is_listed_for(name):
    allowed = HTTP_EDGE[name]
    path = ROOT / "service" / "http" / name
    assert offenders([path], tuple(m for m in HTTP_STACK if m not in allowed and m != "service.http")) == []
    assert offenders([path], allowed), f"service/http/{name} no longer needs {allowed}: take it off HTTP_EDGE"


# The registry (service/models/registry.py) composes its parts: the catalogue of entries, the
# loader, the memory budget, leases and keep-alive, lookup. Its policies (budget, leases, lookup)
# decide on plain records, without torch or a checkpoint; and the rest of the service reaches
# the parts that hold its state only through ``EngineRegistry``.
REGISTRY_POLICIES = ("budget.py", "leases.py", "lookup.py")
REGISTRY_INTERNALS = ("service.models.catalogue", "service.models.loading", "service.models.budget",
                      "service.models.leases")


def test_the_registry_policies_need_no_model():
    models = ROOT / "service" / "models"
    assert offenders([models / name for name in REGISTRY_POLICIES], ("torch", "model")) == []


def test_the_registry_parts_are_reached_through_the_registry():
    models = ROOT / "service" / "models"
    outside = [f for f in py_files("service") if models not in f.parents]
    assert offenders(outside, REGISTRY_INTERNALS) == []

# The placeholder-safe translation sequence is written once, in model/: both of its users
# import it, and a translate request passes each layer once (route -> service.translation.translate ->
# model.text.translate -> engine).
TRANSLATION_DRIVER = "model.text.translate"


def test_one_translation_driver_for_training_and_service():
    driver = ROOT / "model" / "text" / "translate.py"
    assert offenders([driver], ("service", "model.train", "torch")) == []  # plain text logic, a callback
    for user in ("model/train/evaluate.py", "service/translation/translate.py"):
        assert TRANSLATION_DRIVER in imported_modules(ROOT / user), f"{user} does not use {TRANSLATION_DRIVER}"
    # only the driver unmasks and retries; service.translation.translate keeps the streamed case (no retry possible)
    assert "unmask" not in (ROOT / "model" / "train" / "evaluate.py").read_text()
    assert offenders([ROOT / "service" / "translation" / "translate.py"], HTTP_STACK) == []


def test_schemas_do_not_import_model():
    assert offenders(py_files("service", "schemas"), ("model",)) == []


# An engine's internals: the tokenizer, the model config and weights, the scheduler. A route
# calls engine methods (tokenize, validate_ids, usage, token_text, ...) instead.
ENGINE_INTERNALS = {"tokenizer", "cfg", "ckpt", "model", "scheduler"}
REQUEST_BODIES = {"body", "query"}  # a request's own `model` field is fine: `body.model`, `query.model`


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


# --- no import cycles, lazy imports included ---------------------------------------------

def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(*tops: str) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its source (function bodies too).
    ``from pkg import sub`` is an edge to ``pkg.sub`` (and to ``pkg`` only for names that are
    not submodules); a package importing its own submodules is not an edge to itself."""
    files = {module_name(p): p for top in tops for p in py_files(top)}
    graph = {}
    for name, path in files.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in files]
                found.update(subs)
                if len(subs) < len(node.names):
                    found.add(node.module)
        graph[name] = {m for m in found if m in files and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


@pytest.mark.parametrize("top", ["model", "service"])
def test_no_import_cycles(top):
    assert cycles(import_graph(top)) == []


def test_the_cycle_check_finds_a_lazy_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    lazy = "def f():\n    from model.engine.core import EngineCore\n"
    assert "model.engine.core" in {n.module for n in ast.walk(ast.parse(lazy)) if isinstance(n, ast.ImportFrom)}


def test_the_networks_import_nothing_from_decode_formats_or_engine():
    """model/nn/ is the layers and the families; what decodes them, reads their weights or
    schedules them sits above it."""
    assert offenders(py_files("model", "nn"), ("model.decode", "model.formats", "model.engine", "model.quant",
                                                 "model.train")) == []


def test_model_top_level_shows_its_architecture_in_folders():
    modules = sorted(p.name for p in (ROOT / "model").glob("*.py"))
    folders = sorted(p.name for p in (ROOT / "model").iterdir() if (p / "__init__.py").exists())
    assert len(modules) <= 12, modules
    assert {"nn", "decode", "quant", "formats", "tokenization", "engine", "text", "train"} <= set(folders)


def test_importing_the_packages_has_no_side_effects():
    """Registering a torch op, loading a library or importing the compiler stack happens when a
    feature is chosen (``model.decode.prepare``), never on import."""
    import subprocess
    import sys

    probe = ("import sys, torch\n"
             "before = set(torch.ops.loaded_libraries)\n"
             "import model, model.decode, model.decode.native, model.decode.triton_attention, service.http.app\n"
             "print(sorted(set(torch.ops.loaded_libraries) - before), 'torch._dynamo' in sys.modules,"
             " 'triton' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "False", "False"]


# --- benchmarks: harness below sections and studies ------------------------------------------
# benchmarks/harness/ is what every benchmark stands on; a section (python -m benchmarks) or a
# study (python -m benchmarks.studies.NAME) is a leaf that imports the harness only, so one can
# be changed or deleted without touching another. The one exception: the GPU section re-runs
# four CPU sections' measurements on CUDA. Tests import only the harness's server_process,
# which imports nothing else of the benchmarks.
BENCH_LAYERS = ("benchmarks.harness", "benchmarks.sections", "benchmarks.studies")
SECTION_REUSE = {"benchmarks.sections.gpu": {"benchmarks.sections.attention", "benchmarks.sections.decode",
                                             "benchmarks.sections.kv_cache", "benchmarks.sections.translation"},
                 # the divergence probe reads the fidelity study's prompts, reference and systems
                 "benchmarks.studies.fidelity_margins": {"benchmarks.studies.fidelity"},
                 # the activation-rounding simulation runs on the fidelity study's reference and prompts
                 "benchmarks.studies.activation_precision": {"benchmarks.studies.fidelity"}}


def layer_of(module: str) -> str | None:
    return next((layer for layer in BENCH_LAYERS if module == layer or module.startswith(layer + ".")), None)


def benchmark_layer_breaches(graph: dict[str, set[str]]) -> list[str]:
    """Imports that break the benchmarks' layering: the harness importing a section or study;
    a section or study importing another section or study (but SECTION_REUSE)."""
    found = []
    for module, imports in sorted(graph.items()):
        layer = layer_of(module)
        for target in sorted(imports):
            to = layer_of(target)
            if layer is None or to in (None, "benchmarks.harness") or target == to:
                continue  # __main__, the packages, anything importing the harness
            if target not in SECTION_REUSE.get(module, ()):
                found.append(f"{module} imports {target}")
    return found


def test_benchmarks_import_no_cycle():
    assert cycles(import_graph("benchmarks")) == []


def test_benchmarks_sections_and_studies_import_only_the_harness():
    graph = import_graph("benchmarks")
    assert {layer_of(m) for m in graph} >= set(BENCH_LAYERS)
    assert benchmark_layer_breaches(graph) == []
    for module, reused in SECTION_REUSE.items():  # an exception no longer needed goes
        assert reused <= graph[module], f"{module} no longer imports {reused - graph[module]}"


def test_the_benchmark_layer_check_sees_a_breach():
    graph = {"benchmarks.harness.report": {"benchmarks.sections.decode"},
             "benchmarks.studies.soak": {"benchmarks.studies.pod_memory", "benchmarks.harness.report"},
             "benchmarks.sections.kv_cache": {"benchmarks.sections.decode"},
             "benchmarks.sections.gpu": {"benchmarks.sections.decode"},
             "benchmarks.__main__": {"benchmarks.sections.decode"}}
    assert benchmark_layer_breaches(graph) == [
        "benchmarks.harness.report imports benchmarks.sections.decode",
        "benchmarks.sections.kv_cache imports benchmarks.sections.decode",
        "benchmarks.studies.soak imports benchmarks.studies.pod_memory"]


def test_the_server_helper_tests_share_imports_nothing_of_the_benchmarks():
    helper = ROOT / "benchmarks" / "harness" / "server_process.py"
    assert imported_modules(helper) & {m for m in import_graph("benchmarks")} == {"benchmarks.harness"}
    assert offenders([helper], ("model", "service", "torch")) == []
