"""The names the docs and the code's prose give, and whether each still exists.

Read by ``tests/test_doc_names.py``. Everything is read from the files (listings, patterns,
the ASTs of the modules a check needs); no project module is imported, so checking the docs
costs no torch import and about two seconds.

Kinds of reference, each with its own rule (``Ref.kind``):

- ``module``: a dotted path rooted in one of our packages (``model.engine.core``,
  ``python -m benchmarks.decode``, ``model.decode.prepare``, ``service.settings.Settings.port``):
  the longest prefix that is a module file names the module; the next part must be a name its
  AST defines or imports, and a part after a class must be one of that class's attributes.
  ``model.<x>`` where x is neither a submodule nor exported by model/__init__ is a variable
  named model (``model.dtype``) and not checked.
- ``import``: ``from model.engine import EngineCore`` in a doc's code: every imported name.
- ``path``: a file or folder path. Rooted at a top-level entry of the repo (``model/...``,
  ``docs/x.md``) it must exist there, unless .gitignore names its root (outputs: ``runs/``);
  a relative one (``routes/chat.py``) must be the tail of some path in the repo (checked only
  when its first folder is one of ours and it ends in ``/`` or a file suffix); a bare source
  file name (``support.py``) must be some file's name. ``file.py::test_name`` needs the function.
- ``class``: a CamelCase name in backticks (``SlotKVCache``): a class, function or module-level
  name of the project, a C++ class of the native library, or a CamelCase string our code holds
  (an importer's ``"LlamaForCausalLM"``). ``Class.attr`` (in backticks, or in prose when
  ``Class`` is a project class) needs the attribute, its bases' included.
- ``tree``: ARCHITECTURE's "Where things live" tree: a source file or folder named on a
  folder's lines exists somewhere under that folder; a CamelCase word exists as above.

Settings (``TSERVE_*``) and metrics (``tserve_*``) are checked by the test itself.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("model", "service", "benchmarks", "tests")
SKIP_DIRS = {".git", ".venv", ".venv-deploy", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache",
             "node_modules"}
SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".sh", ".md")
TRACKED_SUFFIXES = {".py", ".cpp", ".h", ".md", ".json", ".yaml", ".yml", ".sh", ".txt", ".toml", ".cfg",
                    ".po", ".env", ".jinja", ".safetensors", ".png", ".html", ".js", ".css"}


@dataclass(frozen=True)
class Ref:
    kind: str
    name: str
    where: str  # "file:line"

    def __str__(self) -> str:
        return f"{self.where}: {self.kind} {self.name}"


# --- the project, read without importing it ------------------------------------------------------

def _statements(body):
    """Every statement under a body, nested ones included, without walking expressions (fast)."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            children = getattr(node, field, None)
            if isinstance(children, list):
                yield from _statements(children)


def _top_level(body):
    """Statements at module level, looking into if/try blocks (optional imports)."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            yield from _top_level(node.body + node.orelse + getattr(node, "finalbody", [])
                                  + [s for h in getattr(node, "handlers", []) for s in h.body])


def _targets(node) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return node.targets
    return [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []


class ModuleInfo:
    def __init__(self, tree: ast.Module):
        self.names: set[str] = set()
        self.imported: dict[str, str] = {}  # local name -> "module.name" it comes from
        for node in _top_level(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.names.add(node.name)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    self.names.add(alias.asname or alias.name)
                    self.imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                self.names.update(alias.asname or alias.name.split(".")[0] for alias in node.names)
            for target in _targets(node):
                self.names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        self.classes: list[tuple[str, ClassInfo]] = []
        self.defined: set[str] = set()
        for node in _statements(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defined.add(node.name)
            if isinstance(node, ast.ClassDef):
                self.classes.append((node.name, ClassInfo(node)))


class ClassInfo:
    def __init__(self, node: ast.ClassDef):
        self.bases = [_last_name(b) for b in node.bases]
        self.attrs: set[str] = set()
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.attrs.add(item.name)
            self.attrs.update(t.id for t in _targets(item) if isinstance(t, ast.Name))
        for item in _statements(node.body):  # self.x = ... in any method
            for target in _targets(item):
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        self.attrs.add(sub.attr)


def _last_name(expr: ast.expr) -> str:
    if isinstance(expr, ast.Subscript):
        expr = expr.value
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return expr.id if isinstance(expr, ast.Name) else ""


class Project:
    def __init__(self, root: Path = ROOT):
        self.root = root
        self.ignored_roots = self._ignored_roots()
        self.files: set[str] = set()
        self.dirs: set[str] = set()
        for top, dirnames, filenames in os.walk(root):
            rel = Path(top).relative_to(root).as_posix()
            prefix = "" if rel == "." else rel + "/"
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not self.ignored(prefix + d)]
            self.dirs.update(prefix + d for d in dirnames)
            self.files.update(prefix + f for f in filenames)
        self.top_level = {p.split("/")[0] for p in self.files | self.dirs}
        self.basenames = {p.rsplit("/", 1)[-1] for p in self.files | self.dirs}
        self.dir_names = {p.rsplit("/", 1)[-1] for p in self.dirs}
        self.all_paths = sorted(self.files | self.dirs)
        self._infos: dict[str, ModuleInfo | None] = {}
        self._classes: dict[str, list[ClassInfo]] = {}

    def _ignored_roots(self) -> set[str]:
        """Folders .gitignore names (outputs: data/, runs/, build/): neither listed nor checked."""
        roots = set()
        gitignore = self.root / ".gitignore"
        for line in gitignore.read_text().splitlines() if gitignore.exists() else []:
            line = line.strip()
            if line.endswith("/"):
                roots.add(line.strip("/"))
        return roots

    def ignored(self, path: str) -> bool:
        path = path.rstrip("/")
        return any(path == r or path.startswith(r + "/") or ("*" in r and fnmatch.fnmatch(path.split("/")[0], r))
                   for r in self.ignored_roots)

    @cached_property
    def modules(self) -> dict[str, str]:
        """Dotted module name -> file, for every .py file of our packages (and deploy's scripts)."""
        out = {}
        for path in self.files:
            if path.endswith(".py") and path.split("/")[0] in PACKAGES + ("deploy",):
                dotted = path[:-3].replace("/", ".")
                out[dotted.removesuffix(".__init__")] = path
        return out

    @cached_property
    def sources(self) -> dict[str, str]:
        """Module file -> its text, for every module (read once; parsed only where a check needs it)."""
        return {path: (self.root / path).read_text() for path in self.modules.values()}

    def info(self, dotted: str) -> ModuleInfo | None:
        """The module's AST facts, parsed on first use (parsing every file would cost seconds)."""
        if dotted not in self._infos:
            path = self.modules.get(dotted)
            try:
                self._infos[dotted] = ModuleInfo(ast.parse(self.sources[path], path)) if path else None
            except SyntaxError:  # a fixture, not ours to check
                self._infos[dotted] = None
        return self._infos[dotted]

    def classes(self, name: str) -> list[ClassInfo]:
        """Every project class of that name (the files that define one are parsed)."""
        if name not in self._classes:
            pattern = re.compile(rf"^\s*class\s+{re.escape(name)}\b", re.M)
            found = []
            for dotted, path in self.modules.items():
                if pattern.search(self.sources[path]) and self.info(dotted) is not None:
                    found += [cls for n, cls in self.info(dotted).classes if n == name]
            self._classes[name] = found
        return self._classes[name]

    @cached_property
    def names(self) -> set[str]:
        """Every class and function defined anywhere in the project, and each module-level name."""
        out = set()
        for text in self.sources.values():
            out.update(re.findall(r"^\s*(?:async\s+def|def|class)\s+(\w+)", text, re.M))
            out.update(re.findall(r"^(\w+)\s*(?::[^=\n]*)?=", text, re.M))
        return out

    @cached_property
    def cpp_classes(self) -> dict[str, set[str]]:
        """C++ classes of the native library (csrc) -> the members its sources name (``X::m``,
        ``.def("m"``): ``LlamaDecoder.prefill`` in the docs is one of these."""
        text = "\n".join((self.root / p).read_text() for p in sorted(self.files)
                         if p.startswith("model/") and p.endswith((".cpp", ".h")))
        out = {m.group(1): set() for m in re.finditer(r"\b(?:class|struct)\s+(\w+)", text)}
        for cls, members in out.items():
            members.update(re.findall(rf"\b{cls}::(\w+)", text))
            members.update(re.findall(r'\.def\("(\w+)", &' + cls + r"::", text))
        return out

    @cached_property
    def quoted_names(self) -> set[str]:
        """CamelCase strings our code holds ("LlamaForCausalLM" in an importer's table, an alert
        name in deploy's rules): a doc naming one names something the project knows."""
        out = set()
        for text in self.sources.values():
            out.update(re.findall(r"[\"']([A-Z]\w+)[\"']", text))
        for path in self.files:
            if path.startswith("deploy/") and path.endswith((".yml", ".yaml")):
                out.update(re.findall(r"\balert:\s*(\w+)", (self.root / path).read_text()))
        return out

    def name_exists(self, name: str) -> bool:
        return name in self.names or name in self.cpp_classes or name in self.quoted_names

    def class_has(self, cls: str, attr: str, seen: frozenset = frozenset()) -> bool:
        """Whether some project class of that name has the attribute, itself or through its bases."""
        if cls in self.cpp_classes and not self.classes(cls):
            return attr in self.cpp_classes[cls]
        for info in self.classes(cls):
            if attr in info.attrs:
                return True
            if any(b not in seen and self.class_has(b, attr, seen | {cls}) for b in info.bases):
                return True
        return False

    def function_in(self, path: str, name: str) -> bool:
        info = self.info(path[:-3].replace("/", ".").removesuffix(".__init__"))
        return info is not None and name in info.defined

    # --- the checks -----------------------------------------------------------------------------

    def dotted_exists(self, name: str) -> bool:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in self.modules:
                break
        else:
            return False
        rest, module = parts[i:], ".".join(parts[:i])
        if not rest:
            return True
        info = self.info(module)
        if info is None or rest[0] not in info.names:
            return False
        if len(rest) > 1:
            origin = info.imported.get(rest[0], "").rsplit(".", 1)[-1] or rest[0]
            if self.classes(origin):
                return self.class_has(origin, rest[1])
        return True

    def path_exists(self, path: str) -> bool:
        path, _, test = path.partition("::")
        bare = path.rstrip("/")
        if path.split("/")[0] in self.top_level or "/" not in bare:
            if "/" not in bare:
                found = bare in self.basenames
            else:
                found = bare in self.files or bare in self.dirs
        else:
            found = any(p.endswith("/" + bare) for p in self.all_paths)
            bare = next((p for p in self.files if p.endswith("/" + bare)), bare)
        if found and test:
            return self.function_in(bare, test.split("::")[-1].split("[")[0])
        return found

    def setting_fields(self) -> set[str]:
        tree = ast.parse((self.root / "service/settings.py").read_text())
        cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Settings")
        return {"TSERVE_" + n.target.id.upper() for n in cls.body  # fields are annotated; model_config is not
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


# --- finding references in text ------------------------------------------------------------------

_PKG = "|".join(PACKAGES)
DOTTED = re.compile(rf"(?<![\w.$/-])(?:{_PKG})(?:\.[A-Za-z_]\w*)+")
FROM_IMPORT = re.compile(rf"^\s*from ((?:{_PKG})(?:\.\w+)*) import \(?([\w, ]+)\)?\s*$", re.M)
PATH = re.compile(r"(?<![\w/.:~$@=-])((?:[\w.-]+/)+[\w.-]*(?:::[\w\[\]-]+)*)")
BARE_FILE = re.compile(r"(?<![\w/.:~$@=<*-])([\w-]+(?:" + "|".join(map(re.escape, SOURCE_SUFFIXES)) + r"))\b(?![/.\w])")
SPAN = re.compile(r"(`+)([^`\n]+?)\1")
CAMEL = re.compile(r"[A-Z][A-Za-z0-9]*[a-z][A-Za-z0-9]*[A-Z][A-Za-z0-9]*|[A-Z]+[a-z][a-z0-9]*[A-Z][A-Za-z0-9]*")
CLASS_SPAN = re.compile(rf"^({CAMEL.pattern})(?:\.(\w+))?(?:\(.*\))?(?:$|\s*/\s*\w)")
CLASS_ATTR = re.compile(rf"(?<![\w.])({CAMEL.pattern}|[A-Z][a-z]+)\.([a-z_]\w*)\b")
SETTING = re.compile(r"\bTSERVE_(?:[A-Z0-9_*]|<\w+>)+")
PLACEHOLDER_AFTER = tuple("<*{…[")
FILE_SUFFIXES = {"md", "py", "json", "txt", "toml", "yml", "yaml", "cpp", "sh"}  # benchmarks.md is a file


class Finder:
    """Collects the references of one text; ``where`` turns an offset into ``file:line``."""

    def __init__(self, project: Project, external: set[str]):
        self.project = project
        self.external = external
        self.stale: list[Ref] = []
        self.checked = 0

    def _check(self, kind: str, name: str, where: str, ok: bool) -> None:
        self.checked += 1
        if not ok:
            self.stale.append(Ref(kind, name, where))

    def scan(self, text: str, file: str, first_line: int = 1) -> None:
        def where(offset: int) -> str:
            return f"{file}:{first_line + text.count(chr(10), 0, offset)}"

        for m in DOTTED.finditer(text):
            name = m.group(0)
            last = name.rsplit(".", 1)[-1]
            # ``benchmarks.studies.NAME``: an upper-case last part is a placeholder, not a module
            if last in FILE_SUFFIXES or (last.isupper() and len(last) > 1) or _ambiguous_variable(name, self.project):
                continue
            self._check("module", name, where(m.start()), self.project.dotted_exists(name))
        for m in FROM_IMPORT.finditer(text):
            for name in filter(None, (n.strip() for n in m.group(2).split(","))):
                dotted = f"{m.group(1)}.{name}"
                self._check("import", dotted, where(m.start()), self.project.dotted_exists(dotted))
        for m in PATH.finditer(text):
            self._path(m.group(1), text, m.end(1), where(m.start()))
        for m in BARE_FILE.finditer(text):
            self._check("path", m.group(1), where(m.start()), self.project.path_exists(m.group(1)))
        for m in SPAN.finditer(text):
            self._span(m.group(2).strip(), where(m.start()))
        for m in CLASS_ATTR.finditer(text):
            cls, attr = m.groups()
            if cls in self.project.names and self.project.classes(cls) and not _in_span(text, m.start()):
                self._check("class", f"{cls}.{attr}", where(m.start()), self.project.class_has(cls, attr))

    def _path(self, path: str, text: str, end: int, where: str) -> None:
        if text[end:end + 1] in PLACEHOLDER_AFTER or text[end:end + 1] == "(" or "//" in path:
            return
        path = path.rstrip(".")
        first, _, rest = path.partition("/")
        if not rest and not path.endswith("/"):
            return
        if first in self.project.top_level or first in self.project.ignored_roots:
            if self.project.ignored(path) or first.startswith("."):
                return
        elif first not in self.project.dir_names:
            return  # not a repo path: a MIME type, an image name, a URL's tail
        else:
            last = path.rstrip("/").rsplit("/", 1)[-1].split("::")[0]
            if not path.endswith("/") and Path(last).suffix not in TRACKED_SUFFIXES:
                return  # text/event-stream, overlays/cpu: too like other things to judge
        self._check("path", path, where, self.project.path_exists(path))

    def _span(self, span: str, where: str) -> None:
        m = CLASS_SPAN.match(span)
        if not m:
            return
        cls, attr = m.group(1), m.group(2)
        if cls in self.external:
            return
        if attr and (self.project.classes(cls) or cls in self.project.cpp_classes):
            self._check("class", f"{cls}.{attr}", where, self.project.class_has(cls, attr))
        else:
            self._check("class", cls, where, self.project.name_exists(cls))

    def scan_tree(self, text: str, file: str, first_line: int) -> None:
        """ARCHITECTURE's tree: names on a folder's lines live under that folder."""
        folders: list[str] = []
        for n, line in enumerate(text.splitlines(), first_line):
            stripped = line.lstrip(" ")
            indent = len(line) - len(stripped)
            token = stripped.split(" ", 1)[0]
            if token.endswith("/") and indent <= 4:
                folders = folders[:indent // 2] + [token]
                rest = stripped[len(token):]
            else:
                rest = line
            base = "".join(folders)
            for m in re.finditer(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+(?:\.[a-z]+|/))(?![\w/<])", rest):
                name = m.group(1)
                if not name.endswith(("/", ".py", ".cpp", ".h", ".txt", ".md")):
                    continue  # config.json "beside the weights": a checkpoint's file, not ours
                ok = any(p.startswith(base) and (p + "/").endswith("/" + name.rstrip("/") + "/")
                         for p in self.project.all_paths)
                self._check("tree", base + "…/" + name, f"{file}:{n}", ok)
            for m in CAMEL.finditer(rest):
                if m.group(0) not in self.external:
                    self._check("tree", m.group(0), f"{file}:{n}", self.project.name_exists(m.group(0)))


def _in_span(text: str, offset: int) -> bool:
    line_start = text.rfind("\n", 0, offset) + 1
    return text.count("`", line_start, offset) % 2 == 1


def _ambiguous_variable(name: str, project: Project) -> bool:
    """``model.dtype``: a variable named model, not our package. Our package's second part is a
    submodule or a name its __init__ exports; anything else is read as a variable."""
    parts = name.split(".")
    if len(parts) < 2 or parts[0] != "model":
        return False
    info = project.info("model")
    return f"model.{parts[1]}" not in project.modules and (info is None or parts[1] not in info.names)


# --- where the prose is --------------------------------------------------------------------------

def markdown_files(root: Path = ROOT) -> list[Path]:
    files = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "deploy").rglob("*.md")),
             *sorted((root / "weights").glob("*/*.md"))]
    return [f for f in files if f.exists()]


COMMENT = re.compile(r"(?:^|\s)(#(?:\s.*)?)$", re.M)
TRIPLE_QUOTED = re.compile(r'(\"\"\"|\'\'\')(.*?)\1', re.S)


def python_prose(project: Project, path: str) -> list[tuple[int, str]]:
    """(first line, text) of each comment and triple-quoted string (docstrings, and texts such as
    the API's description) of one of our Python files. Read by pattern, not by tokenizing or
    parsing every file (seconds): a comment is a # at a line's start or after a space, so the
    rare string holding " # " is read as prose too, which only costs a check."""
    source = project.sources.get(path) or (project.root / path).read_text()
    out = [(source.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in COMMENT.finditer(source)]
    return out + [(source.count("\n", 0, m.start(2)) + 1, m.group(2)) for m in TRIPLE_QUOTED.finditer(source)]


def settings_named(text: str) -> list[tuple[int, str]]:
    """(offset, pattern) of each TSERVE_ name: ``TSERVE_DEFAULT_<TASK>_MODEL`` and ``TSERVE_GRAMMAR_*``
    become wildcards, as does a trailing ``_`` (a prefix, as in a regex)."""
    out = []
    for m in SETTING.finditer(text):
        name = re.sub(r"<\w*>?", "*", m.group(0))
        out.append((m.start(), name + "*" if name.endswith("_") else name))
    return out


def match_setting(name: str, fields: set[str]) -> bool:
    return any(fnmatch.fnmatchcase(f, name) for f in fields) if "*" in name else name in fields
