"""The one direction of imports (shared/DESIGN.md), checked on the source, not by convention."""

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
    (("service", "routes"), ("model",)),  # routes reach the model only through the engine
])
def test_imports_go_one_way(where, forbidden):
    assert offenders(py_files(*where), forbidden) == []


def test_schemas_do_not_import_model():
    files = [ROOT / "service" / "schemas.py", ROOT / "service" / "openai_schemas.py"]
    assert offenders(files, ("model",)) == []
