"""The sentences: Debian's fortunes, handbook, Python docs and WordNet read into training
sentences, and the held-out set (one whole word masked per sentence of files kept out of training)."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
from html.parser import HTMLParser
from pathlib import Path

from model.train.data.prose import html_paragraphs
from model.train.data.sources import debian_package
from model.train.fill_mask_head.head import ENCODER

OUT = Path("data/fill-mask-head")
CACHE = Path("data/cache")
FORTUNES = "usr/share/games/fortunes"
# Everyday topics kept out of training entirely: the evaluation sentences come from these files only.
HELDOUT_FORTUNE_FILES = ("education", "food", "kids", "love", "people", "pets", "sports", "work")
SKIP_FORTUNE_FILES = ("ascii-art", "translate-me")  # pictures, and non-English text
SOURCES = {"fortunes": "BSD (fortune-mod, Debian copyright file); quotations by their authors",
           "fortunes-min": "BSD (fortune-mod, Debian copyright file); quotations by their authors",
           "fortune-anarchism": "public domain (BLAG Fortune Assortment Project); packaging GPL-3+",
           "debian-handbook": "GPL-2.0+ or CC-BY-SA-3.0",
           "python3.11-doc": "PSF-2.0",
           "wordnet-base": "WordNet 3.0 licence (Princeton; BSD-like: use, copy, modify, distribute with the notice)"}
WORDNET = "usr/share/wordnet"
MIN_WORDS, MAX_WORDS = 5, 40
WORD = re.compile(r"(?<![\w'\-])[A-Za-z]+(?![\w'\-])")


def fortune_entries(path: Path) -> list[str]:
    """A fortune file's entries (``%`` lines separate them), attribution lines dropped, lines joined."""
    text = path.read_bytes().decode("utf-8", errors="replace")
    out = []
    for entry in re.split(r"^%\s*$", text, flags=re.M):
        lines = [ln.strip() for ln in entry.splitlines()]
        lines = [ln for ln in lines if ln and not ln.startswith("--") and not ln.startswith("-- ")]
        if lines:
            out.append(" ".join(lines))
    return out


def sentences(text: str) -> list[str]:
    """Plain prose sentences: split after . ! ? before a capital, kept when 5-40 words of mostly letters."""
    out = []
    for s in re.split(r"(?<=[.!?])\s+(?=[\"'(]?[A-Z])", " ".join(text.split())):
        words = s.split()
        if not MIN_WORDS <= len(words) <= MAX_WORDS or not s.isascii():
            continue
        letters = sum(c.isalpha() for c in s)
        if letters < 0.7 * len(s.replace(" ", "")) or not s[0].isupper() or s[-1] not in ".!?\"'":
            continue  # code, tables, lists, half sentences
        out.append(s)
    return out


class _BlockText(HTMLParser):
    """Text of an HTML page as blocks (a paragraph per block element), code and scripts skipped:
    the handbook's DocBook HTML puts its paragraphs in ``<div class="para">``, not ``<p>``."""

    BLOCKS = {"p", "div", "li", "dt", "dd", "td", "th", "tr", "table", "h1", "h2", "h3", "h4", "h5", "h6",
              "title", "br", "ul", "ol", "dl", "section", "blockquote"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[str] = []
        self._parts: list[str] = []
        self._skip = 0

    def _flush(self) -> None:
        text = " ".join("".join(self._parts).split())
        if text:
            self.blocks.append(text)
        self._parts = []

    def handle_starttag(self, tag, attrs) -> None:
        if tag in ("pre", "script", "style"):
            self._skip += 1
        if tag in self.BLOCKS:
            self._flush()

    def handle_endtag(self, tag) -> None:
        if tag in ("pre", "script", "style"):
            self._skip = max(0, self._skip - 1)
        if tag in self.BLOCKS:
            self._flush()

    def handle_data(self, data) -> None:
        if not self._skip:
            self._parts.append(data)


def html_blocks(html: str) -> list[str]:
    parser = _BlockText()
    parser.feed(html)
    parser.close()
    parser._flush()
    return parser.blocks


def norm_key(s: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", s.lower()))


def gather_sources(cache: Path, vocab: dict[str, int] | None = None
                   ) -> tuple[dict[str, list[str]], dict[str, list[str]], list[dict]]:
    """(train sentences by document, held-out sentences by document, source records). ``vocab``
    selects WordNet's noun glosses (``wordnet_sentences``); without it only its examples are read."""
    train: dict[str, list[str]] = {}
    heldout: dict[str, list[str]] = {}
    records = []
    for package in ("fortunes", "fortunes-min", "fortune-anarchism"):
        fetched = debian_package(package, cache)
        records.append({"name": fetched.name, "version": fetched.version, "licence": SOURCES[package]})
        for path in sorted((fetched.root / FORTUNES).iterdir()):
            if path.suffix in (".dat", ".u8") or path.is_dir() or path.name in SKIP_FORTUNE_FILES:
                continue
            sents = [s for e in fortune_entries(path) for s in sentences(e)]
            (heldout if path.name in HELDOUT_FORTUNE_FILES else train)[f"{package}:{path.name}"] = sents
    fetched = debian_package("debian-handbook", cache)
    records.append({"name": fetched.name, "version": fetched.version, "licence": SOURCES["debian-handbook"]})
    for path in sorted(fetched.root.glob("usr/share/doc/debian-handbook/html/en-US/*.html")):
        paras = html_blocks(path.read_text(encoding="utf-8", errors="replace"))
        train[f"debian-handbook:{path.name}"] = [s for p in paras for s in sentences(p)]
    fetched = debian_package("python3.11-doc", cache)
    records.append({"name": fetched.name, "version": fetched.version, "licence": SOURCES["python3.11-doc"]})
    for path in sorted(fetched.root.glob("usr/share/doc/python3.11/html/**/*.html")):
        paras = html_paragraphs(path.read_text(encoding="utf-8", errors="replace"))
        train[f"python3.11-doc:{path.relative_to(fetched.root)}"] = [s for p in paras for s in sentences(p)]
    fetched = debian_package("wordnet-base", cache)
    records.append({"name": fetched.name, "version": fetched.version, "licence": SOURCES["wordnet-base"]})
    train.update(wordnet_sentences(fetched.root, vocab))
    for record in records:  # sentences per source, before the de-duplication of split_sets
        prefix = record["name"].removeprefix("debian:") + ":"
        record["sentences"] = sum(len(v) for k, v in train.items() if k.startswith(prefix))
    return train, heldout, records


def wordnet_sentences(root: Path, vocab: dict[str, int] | None = None) -> dict[str, list[str]]:
    """WordNet 3.0's prose from its ``data.<pos>`` files (a synset per line, ``| gloss; "example"; ...``):

    - ``examples.<pos>``: the quoted example sentences of every synset (``"he drank a cup of
      coffee"``), first letter capitalised and a full stop added where missing;
    - ``glosses.noun``: a noun synset's first gloss as a definition sentence, "A cup is a small open
      container ...", "Paris is the capital ...": only for nouns whose every word is one wordpiece of
      ``vocab`` (everyday nouns and well-known names, not the taxonomy), and, for a common noun, a
      gloss that starts with "a"/"an".

    Each goes through ``sentences`` like every other source."""
    out: dict[str, list[str]] = {}
    for pos in ("noun", "verb", "adj", "adv"):
        examples, glosses = [], []
        for line in (root / WORDNET / f"data.{pos}").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("  ") or " | " not in line:
                continue  # the licence header
            head, _, gloss = line.partition(" | ")
            for quote in re.findall(r'"([^"]+)"', gloss):
                q = quote.strip()
                if q and q[-1] not in ".!?":
                    q += "."
                examples += sentences(q[:1].upper() + q[1:])
            if pos != "noun" or vocab is None:
                continue
            lemma = re.sub(r"\(\w+\)$", "", head.split()[4]).replace("_", " ")
            definition = gloss.split(";")[0].strip().rstrip(".")
            if not definition or '"' in definition or not all(w.lower() in vocab for w in lemma.split()):
                continue
            if lemma[0].isupper():
                glosses += sentences(f"{lemma} is {definition}.")
            elif re.match(r"an? ", definition):
                glosses += sentences(f"{'An' if lemma[0] in 'aeiou' else 'A'} {lemma} is {definition}.")
        out[f"wordnet-base:examples.{pos}"] = examples
        if glosses:
            out[f"wordnet-base:glosses.{pos}"] = glosses
    return out


def masked_word(sentence: str, vocab: dict[str, int]) -> tuple[str, str] | None:
    """(text with one whole word replaced by [MASK], that word lower-cased), the word chosen at
    random (seeded by the sentence) among the words that are one wordpiece of the vocabulary."""
    spans = [m for m in WORD.finditer(sentence) if m.group().lower() in vocab]
    if not spans:
        return None
    rng = random.Random(hashlib.sha256(sentence.encode()).hexdigest())
    m = rng.choice(spans)
    return sentence[: m.start()] + "[MASK]" + sentence[m.end():], m.group().lower()


def write_jsonl_gz(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_jsonl_gz(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def split_sets(train_docs: dict[str, list[str]], heldout_docs: dict[str, list[str]],
               vocab: dict[str, int]) -> tuple[list[dict], list[dict], int]:
    """(training sentences, held-out masked sentences, training sentences dropped). A held-out
    sentence is kept once; any sentence whose normalised text is held out (or already taken) is
    dropped from training, so the two sets share no sentence even where documents repeat quotes."""
    heldout, seen = [], set()
    for doc, sents in sorted(heldout_docs.items()):
        for s in sents:
            key = norm_key(s)
            if key in seen:
                continue
            seen.add(key)
            picked = masked_word(s, vocab)
            if picked:
                heldout.append({"doc": doc, "sentence": s, "text": picked[0], "answer": picked[1]})
    train, dropped = [], 0
    for doc, sents in sorted(train_docs.items()):
        for s in sents:
            key = norm_key(s)
            if key in seen:
                dropped += 1
                continue
            seen.add(key)
            train.append({"doc": doc, "text": s})
    return train, heldout, dropped


def cmd_data(args) -> None:
    from model import load_model

    vocab = load_model(ENCODER).tokenizer.tk.get_vocab()
    train_docs, heldout_docs, records = gather_sources(Path(args.cache), vocab)
    train, heldout, dropped = split_sets(train_docs, heldout_docs, vocab)
    for record in records:  # training sentences per source, after it
        prefix = record["name"].removeprefix("debian:") + ":"
        record["train_sentences"] = sum(r["doc"].startswith(prefix) for r in train)
    out = Path(args.out)
    write_jsonl_gz(out / "train.jsonl.gz", train)
    write_jsonl_gz(out / "heldout.jsonl.gz", heldout)
    manifest = {"sources": records, "heldout_documents": sorted(heldout_docs), "train_documents": len(train_docs),
                "train_sentences": len(train), "heldout_sentences": len(heldout),
                "dropped_from_train_as_duplicates_or_heldout": dropped,
                "train_words": sum(len(r["text"].split()) for r in train)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))
