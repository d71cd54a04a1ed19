"""English prose as paragraphs: plain-text books and HTML documentation.

A paragraph is the unit of de-duplication and of the train/validation/test split. In a
play it is one speech (speaker line + verse), in a book one blank-line separated block,
in HTML one ``<p>`` element.
"""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

MIN_PARAGRAPH_CHARS = 12
MAX_PARAGRAPH_CHARS = 4000


def text_paragraphs(text: str, keep_lines: bool = True) -> list[str]:
    """Blank-line separated blocks; inner line breaks kept (verse) or joined (prose)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in block.strip("\n").split("\n") if ln.strip()]
        if not lines:
            continue
        para = "\n".join(lines) if keep_lines else " ".join(lines)
        if MIN_PARAGRAPH_CHARS <= len(para) <= MAX_PARAGRAPH_CHARS:
            out.append(para)
    return out


def read_book(path: str | Path) -> list[str]:
    """Paragraphs of a plain-text (Gutenberg) book, verse line breaks kept."""
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")  # older Gutenberg files
    return text_paragraphs(text)


class _ParagraphParser(HTMLParser):
    """Collects the text of every <p> element, skipping code blocks inside it."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self._depth = 0  # > 0 while inside a <p>
        self._skip = 0  # > 0 while inside <pre>/<script>/<style>
        self._parts: list[str] = []

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag in ("pre", "script", "style"):
            self._skip += 1
        elif tag == "p":
            self._depth += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("pre", "script", "style"):
            self._skip = max(0, self._skip - 1)
        elif tag == "p" and self._depth:
            self._depth -= 1
            if not self._depth:
                para = " ".join("".join(self._parts).split())
                self._parts = []
                if MIN_PARAGRAPH_CHARS <= len(para) <= MAX_PARAGRAPH_CHARS:
                    self.paragraphs.append(para)

    def handle_data(self, data: str) -> None:
        if self._depth and not self._skip:
            self._parts.append(data)


def html_paragraphs(html: str) -> list[str]:
    parser = _ParagraphParser()
    parser.feed(html)
    parser.close()
    # Sphinx puts a pilcrow link after headings and a "¶" can leak into paragraphs.
    return [p.replace("\u00b6", "").strip() for p in parser.paragraphs]


def read_html(path: str | Path) -> list[str]:
    return html_paragraphs(Path(path).read_text(encoding="utf-8", errors="replace"))
