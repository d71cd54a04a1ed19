"""The README and the pages under docs/ stay true to the code and to each other: every setting
and every metric is documented on its page, the test command CI runs is the one the README
gives, the README stays a short front door that links every page, and no relative link (nor
its #anchor) points nowhere."""

from __future__ import annotations

import re
from pathlib import Path

from service.metrics import Metrics
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()
CONFIGURATION = (DOCS / "configuration.md").read_text()
METRICS = (DOCS / "metrics.md").read_text()
README_MAX_BYTES = 30_000

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", flags=re.M | re.S)
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|<(?:img|a)\b[^>]*?\b(?:src|href)=\"([^\"]+)\"")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def prose(text: str) -> str:
    """The text without its fenced code blocks (a `# comment` there is no heading, a `](x)` no link)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose(path.read_text()), flags=re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    found = [a or b for a, b in LINK.findall(prose(path.read_text()))]
    return [link for link in found if not re.match(r"^[a-z][a-z0-9+.-]*:", link)]  # http:, mailto:, …


def test_every_setting_is_in_the_configuration_table():
    documented = set(re.findall(r"^\| `(TSERVE_[A-Z_]+)` \|", CONFIGURATION, flags=re.M))
    expected = {f"TSERVE_{name.upper()}" for name in Settings.model_fields}
    assert documented == expected


def test_every_metric_is_documented():
    metrics = Metrics()
    names = {m.name for m in metrics.registry.collect()}
    for name in names:
        shown = name + "_total" if any(m.name == name and m.type == "counter" for m in metrics.registry.collect()) \
            else name
        assert f"`{shown}" in METRICS, shown


def test_ci_runs_the_readme_test_command():
    assert "make test" in README
    assert "\nmake test\n" in (ROOT / ".ci" / "run").read_text()


def test_readme_is_a_short_front_door():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move reference material into docs/"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / link.split("#")[0]).resolve() for link in relative_links(ROOT / "README.md")}
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_relative_links_resolve():
    broken = []
    for page in pages():
        for link in relative_links(page):
            target, _, anchor = link.partition("#")
            path = (page.parent / target).resolve() if target else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {link} (no such heading)")
    assert not broken, "\n".join(broken)


def test_slug_follows_github():
    assert slug("Chat with a real model: SmolLM2, GGUF and Llama") == "chat-with-a-real-model-smollm2-gguf-and-llama"
    assert slug("3. The shipped models") == "3-the-shipped-models"
    assert slug("Drop-in APIs: LibreTranslate, DeepL, TGI, TEI, InferenceClient") == \
        "drop-in-apis-libretranslate-deepl-tgi-tei-inferenceclient"
