"""Every module, class, function, file and setting the docs and the code's prose name exists.

A rename or a move that leaves a doc naming the old thing fails here, with the file and line
of each stale name. The rules are in ``tests/doc_names.py``; what they cannot judge is
allow-listed below, each entry with why.
"""

from __future__ import annotations

import re

import pytest

from tests.doc_names import PACKAGES, Finder, Project, Ref, markdown_files, match_setting, python_prose, settings_named

# CamelCase names of other projects that the docs name in backticks, and whose they are.
EXTERNAL = {
    "InferenceClient": "huggingface_hub's client (the HF Inference drop-in API)",
    "SentenceTransformer": "sentence-transformers' model class (the embeddings reference)",
    "AutoModelForCausalLM": "transformers (the chat benchmark's reference)",
    "AutoTokenizer": "transformers (a GGUF vocabulary checked against it)",
    "Conv1D": "transformers' GPT-2 projection (the importer transposes it)",
    "ChatOpenAI": "langchain-openai's client (structured outputs through it)",
    "LLParserLimits": "llguidance's parser limits",
    "StructuredOutputsParams": "vLLM's structured-outputs parameters (the API it mirrors)",
    "SchedulerOutput": "vLLM v1's scheduler output (our StepPlan's model)",
    "ModelProto": "sentencepiece's protobuf model",
    "SentencePiece": "Google's tokenizer library (model/tokenization/spm.py reads its models)",
    "PyPI": "the Python package index",
    "Gemma3ForConditionalGeneration": "transformers' multimodal Gemma 3, which the importer refuses",
    "VmHWM": "a field of /proc/self/status (peak resident memory)",
    "KiB": "a unit", "MiB": "a unit", "GiB": "a unit", "TiB": "a unit", "NaN": "a float",
    "CreateContainerConfigError": "a Kubernetes container state",
    "RuntimeDefault": "a Kubernetes seccomp profile",
    "ScaledObject": "KEDA's resource", "AverageValue": "a Kubernetes HPA target type",
}

# Names the rules flag that are right where they stand: (file, name) -> why.
ALLOWED = {
    ("docs/models.md", "weights/smollm2-360m"): "the output directory of a convert command",
    ("docs/models.md", "weights/translate-opus-en-de"): "the output directory of a convert command",
    ("model/formats/convert.py", "weights/translate-opus-en-de"): "the output directory of a convert command",
    ("model/formats/convert.py", "weights/smollm2-local"): "the output directory of a convert command",
    ("model/formats/manifest.py", "weights/NAME"): "a placeholder in a usage line",
    ("docs/structured-outputs.md", "OpenAIChatModel"): "pydantic-ai's class, in the agent frameworks' section",
    ("docs/structured-outputs.md", "AsyncOpenAI"): "the openai client's class, in the agent frameworks' section",
    ("docs/structured-outputs.md", "OpenAIChatCompletionsModel"): "openai-agents' class, in the agent frameworks' "
    "section",
}

# llama.cpp is a project, not a C++ file of ours.
NOT_FILES = {"llama.cpp"}

# TSERVE_ variables that are not Settings fields: read by the code itself (variable -> the file
# that reads it, where it is documented), or placeholders.
NON_SETTINGS_ENV = {
    "TSERVE_NATIVE_ISA": "model/decode/csrc/common.h",  # =scalar: the native step's plain loops only
    "TSERVE_WEIGHTS_CACHE": "model/formats/manifest.py",  # where split weights are joined; docs/models.md
    "TSERVE_CONVERTED_CACHE": "model/formats/import_cache.py",  # off: no cache of converted GGUFs
    "TSERVE_GGUF_WEIGHTS": "model/quant/kquant.py",  # stored: GGUF projections as their blocks
    "TSERVE_TEST_ARTIFACTS": "tests/service/test_playground.py",  # where the browser tests write
    "TSERVE_UPDATE_SCREENSHOTS": "tests/service/test_playground.py",  # =1 rewrites docs/screenshots/
    "TSERVE_PUBLISH": "docker-compose.yml",  # host ports of the compose service
    "TSERVE_CACHE_DIR": "deploy/container-smoke.sh",  # the container checks' download cache
    "TSERVE_IMAGE": "deploy/container-smoke.sh",  # the image tag the smoke test builds
}
PLACEHOLDER_SETTINGS = {"TSERVE_X": "benchmarks/pod_memory.py's usage: any setting"}
# Settings removed on purpose, named where a doc says they are gone: (file, name) -> why.
REMOVED_SETTINGS = {
    ("docs/ARCHITECTURE.md", "TSERVE_COMPILE"): "says the compiled decode step was removed",
    ("docs/limits.md", "TSERVE_COMPILE"): "says the compiled decode step was removed",
}

# Names with the metrics' prefix that are no metric.
NOT_METRICS = (
    "tserve_native",  # the native library: its torch namespace and its file names (tserve_native_llama*)
    "tserve_model_leases",  # a ContextVar's name (service/models/registry.py)
)

# Phrases for things that are gone, too plain to be caught as names.
RETIRED = {
    "slot KV cache": "the paged KV cache (model/nn/kv_cache.py PagedKVCache) replaced it",
}
# Files besides the docs and our packages whose comments name code (paths, modules).
CONFIG_FILES = ("pyproject.toml", "Makefile", "Dockerfile", "docker-compose.yml", "docker-compose.gpu.yml")
# The finder's own files hold stale names on purpose (its examples and these tests).
SELF = ("tests/doc_names.py", "tests/test_doc_names.py")
# The files read for settings, metrics and retired terms: all text but C++, whose macros share
# the prefix (TSERVE_AVX512).
TEXT_SUFFIXES = (".py", ".md", ".yml", ".yaml", ".json", ".sh", ".cfg", ".toml", ".env", ".txt", ".html", ".js",
                 "Dockerfile", "Makefile")


@pytest.fixture(scope="module")
def project() -> Project:
    return Project()


def architecture_tree(text: str) -> tuple[int, str]:
    """(first line, text) of the fenced tree under "## Where things live"."""
    start = text.index("## Where things live")
    fence = text.index("```", start)
    body_start = text.index("\n", fence) + 1
    return text.count("\n", 0, body_start) + 1, text[body_start:text.index("```", body_start)]


def find_stale(project: Project) -> list[Ref]:
    finder = Finder(project, set(EXTERNAL))
    for md in markdown_files(project.root):
        rel = md.relative_to(project.root).as_posix()
        text = md.read_text()
        finder.scan(text, rel)
        if rel == "docs/ARCHITECTURE.md":
            line, tree = architecture_tree(text)
            finder.scan_tree(tree, rel, line)
    for path in sorted(project.files):
        if path.split("/")[0] in PACKAGES and path.endswith(".py") and path not in SELF:
            for line, text in python_prose(project, path):
                finder.scan(text, path, line)
    for path in CONFIG_FILES:
        finder.scan((project.root / path).read_text(), path)
    for path in sorted(project.files):  # deploy's scripts and configs name files and modules too
        if path.startswith("deploy/") and path.endswith(".py"):
            for line, text in python_prose(project, path):
                finder.scan(text, path, line)
        elif path.startswith("deploy/") and path.endswith((".sh", ".yml", ".yaml", ".cfg")):
            finder.scan((project.root / path).read_text(), path)
    out = []
    for ref in dict.fromkeys(finder.stale):
        file = ref.where.rsplit(":", 1)[0]
        if (file, ref.name) not in ALLOWED and ref.name not in NOT_FILES:
            out.append(ref)
    return out


def report(refs) -> str:
    return "\n".join(f"  {r}" for r in refs)


def test_every_name_the_docs_give_exists(project):
    stale = find_stale(project)
    assert not stale, ("names in the docs, docstrings or comments that no longer exist (fix the text to name "
                       "what exists now, or allow-list it in tests/test_doc_names.py with why):\n" + report(stale))


def test_every_allowed_name_is_still_named(project):
    """An allow-list entry whose text has been fixed goes too."""
    for file, name in ALLOWED.keys() | REMOVED_SETTINGS.keys():
        assert name in (project.root / file).read_text(), f"{file} no longer names {name}: drop its entry"


def text_files(project: Project):
    for path in sorted(project.files):
        if path.endswith(TEXT_SUFFIXES) and path not in SELF:
            yield path, (project.root / path).read_text()


def _line(path: str, text: str, offset: int) -> str:
    return f"  {path}:{text.count(chr(10), 0, offset) + 1}"


def stale_settings(project: Project) -> list[str]:
    fields = project.setting_fields()
    return [f"{_line(path, text, offset)}: {name}" for path, text in text_files(project)
            for offset, name in settings_named(text)
            if not match_setting(name, fields) and name not in NON_SETTINGS_ENV
            and name not in PLACEHOLDER_SETTINGS and (path, name) not in REMOVED_SETTINGS]


def stale_metrics(project: Project) -> list[str]:
    """tserve_ names that are no metric service/metrics.py defines (with the exposition's
    suffixes; ``tserve_spec_*`` a prefix) and none of the few other things sharing the prefix."""
    source = (project.root / "service/metrics.py").read_text()
    metrics = {"tserve_" + n for n in re.findall(r'name\("(\w+)"\)', source)}
    out = []
    for path, text in text_files(project):
        for m in re.finditer(r"(?<![\w:])tserve_\w+\b(\*?)", text):
            name = m.group(0)
            base = re.sub(r"_(total|bucket|count|sum|created)$", "", name)
            if name in metrics or base in metrics or name.startswith(NOT_METRICS) \
                    or (name.endswith("*") and any(x.startswith(name[:-1]) for x in metrics)):
                continue
            out.append(f"{_line(path, text, m.start())}: {name}")
    return out


def retired_terms(project: Project) -> list[str]:
    return [f"{_line(path, text, m.start())}: {term!r} ({why})" for path, text in text_files(project)
            for term, why in RETIRED.items() for m in re.finditer(re.escape(term), text, re.I)]


def test_every_tserve_variable_is_a_setting_or_read_by_the_code(project):
    stale = stale_settings(project)
    assert not stale, ("TSERVE_ variables that are no Settings field (service/settings.py) and no variable "
                       "the code reads (NON_SETTINGS_ENV):\n" + "\n".join(stale))


def test_non_settings_variables_are_read_where_listed(project):
    for name, path in NON_SETTINGS_ENV.items():
        assert re.search(rf"[\"'{{]{name}\b", (project.root / path).read_text()), f"{path} does not read {name}"


def test_every_setting_is_documented(project):
    doc = (project.root / "docs/configuration.md").read_text()
    missing = sorted(f for f in project.setting_fields() if f"`{f}`" not in doc)
    assert not missing, f"Settings fields docs/configuration.md does not list: {missing}"


def test_every_metric_named_exists(project):
    stale = stale_metrics(project)
    assert not stale, "tserve_ names that are no metric of service/metrics.py:\n" + "\n".join(stale)


def test_retired_terms_are_gone(project):
    found = retired_terms(project)
    assert not found, "retired terms:\n" + "\n".join(found)


# --- the finder itself: a stale name of each kind is caught, a live one is not --------------------

def _write(root, files: dict[str, str]) -> None:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)


@pytest.fixture
def tiny(tmp_path) -> Project:
    _write(tmp_path, {
        ".gitignore": "/runs/\n",
        "model/__init__.py": "from model.engine.core import EngineCore\n",
        "model/engine/__init__.py": "",
        "model/engine/core.py": "class EngineCore:\n    limit = 1\n    def step(self):\n        self.done = True\n",
        "model/decode/csrc/step.cpp": "class StepDecoder {};\n"
                                      "m.class_<StepDecoder>(\"StepDecoder\").def(\"run\", &StepDecoder::run);\n",
        "service/__init__.py": "",
        "service/routes/chat.py": "def chat():\n    pass\n",
        "service/settings.py": "class Settings:\n    port: int = 1\n    max_queue: int = 2\n",
        "service/metrics.py": "requests = Counter(name(\"requests\"), \"HTTP requests.\")\n",
        "tests/test_core.py": "def test_step():\n    pass\n",
    })
    return Project(tmp_path)


LIVE = """`model.engine.core`, `model.engine.core.EngineCore.step`, python -m model.engine,
`EngineCore`, `EngineCore.limit`, `EngineCore.done`, `StepDecoder.run`, model/engine/core.py,
`routes/chat.py`, `core.py`, tests/test_core.py::test_step, runs/any/thing.pt, model.dtype,
text/event-stream, `InferenceClient`,
    from model.engine.core import EngineCore
"""
STALE = {
    "module": "python -m model.engine.gone",
    "import": "from model.engine.core import Gone",
    "path": "model/engine/gone.py",
    "class": "`GoneCache`",
}


def test_the_finder_passes_live_names(tiny):
    finder = Finder(tiny, {"InferenceClient"})
    finder.scan(LIVE, "doc.md")
    assert finder.stale == [] and finder.checked >= 13


@pytest.mark.parametrize("kind, text", [
    *STALE.items(),
    ("module", "`model.engine.core.Gone`"),
    ("class", "EngineCore.gone()"),
    ("class", "`StepDecoder.gone`"),
    ("path", "`routes/gone.py`"),
    ("path", "`gone.py`"),
    ("path", "tests/test_core.py::test_gone"),
])
def test_the_finder_catches_a_stale_name(tiny, kind, text):
    finder = Finder(tiny, set())
    finder.scan("line one\n" + text + "\n", "doc.md")
    assert [(r.kind, r.where) for r in finder.stale] == [(kind, "doc.md:2")], finder.stale


def test_the_finder_reads_comments_and_docstrings(tiny):
    _write(tiny.root, {"model/engine/old.py": '"""See `GoneCache`."""\n\nx = 1  # model/engine/gone.py\n'})
    tiny = Project(tiny.root)
    finder = Finder(tiny, set())
    for line, text in python_prose(tiny, "model/engine/old.py"):
        finder.scan(text, "model/engine/old.py", line)
    assert sorted(str(r) for r in finder.stale) == ["model/engine/old.py:1: class GoneCache",
                                                     "model/engine/old.py:3: path model/engine/gone.py"]


def test_the_finder_reads_the_tree_by_folder(tiny):
    tree = ("model/\n  engine/          core.py (EngineCore), gone.py (GoneCache)\n"
            "service/            settings.py\n  routes/           chat.py, core.py\n")
    finder = Finder(tiny, set())
    finder.scan_tree(tree, "ARCH.md", 10)
    assert sorted(str(r) for r in finder.stale) == [
        "ARCH.md:11: tree GoneCache", "ARCH.md:11: tree model/engine/…/gone.py",
        "ARCH.md:13: tree service/routes/…/core.py"]


def test_a_stale_setting_metric_or_retired_term_is_caught(tiny):
    assert tiny.setting_fields() == {"TSERVE_PORT", "TSERVE_MAX_QUEUE"}
    names = [name for _, name in settings_named("TSERVE_PORT, TSERVE_GONE, TSERVE_DEFAULT_<TASK>_MODEL, TSERVE_MAX_")]
    assert [match_setting(n, tiny.setting_fields()) for n in names] == [True, False, False, True]
    _write(tiny.root, {"docs/x.md": "TSERVE_PORT TSERVE_GONE\ntserve_requests_total tserve_gone_total\n"
                                    "a slot KV cache\n"})
    tiny = Project(tiny.root)
    assert stale_settings(tiny) == ["  docs/x.md:1: TSERVE_GONE"]
    assert stale_metrics(tiny) == ["  docs/x.md:2: tserve_gone_total"]
    assert [r.split(": ")[0] for r in retired_terms(tiny)] == ["  docs/x.md:3"]
