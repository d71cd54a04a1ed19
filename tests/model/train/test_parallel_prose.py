"""The v3 prose corpus: HTML blocks of an English and a German manual paired by structure,
sentence splitting of long pairs, the filters, DDTP descriptions, and held-out documents."""

from __future__ import annotations

from collections import Counter

from model.train.data.parallel_prose import (
    align_blocks,
    clean_pairs,
    description_parts,
    html_blocks,
    parse_translation,
    sentences,
)

EN = """<html><head><title>Owners</title><style>p {}</style></head><body>
<h2 class="title">9.3.1. Owners and Permissions</h2>
<div class="para">Each file or directory has specific permissions for three categories of users:</div>
<div class="itemizedlist"><ul><li>
<div class="para">its owner (symbolized by <code>u</code>, as in user);</div></li></ul></div>
<pre>chmod u+x file</pre>
<p>Three basic types of rights can be combined.</p>
</body></html>"""
DE = """<html><head><title>Eigentümer</title></head><body>
<h2 class="title">9.3.1. Eigentümer und Berechtigungen</h2>
<div class="para">Jede Datei und jeder Ordner hat spezifische Berechtigungen für drei Kategorien von Benutzern:</div>
<div class="itemizedlist"><ul><li>
<div class="para">seinen Eigentümer (symbolisiert durch <code>u</code> wie in „user“);</div>
</li></ul></div>
<pre>chmod u+x datei</pre>
<p>Three basic types of rights can be combined.</p>
</body></html>"""


def test_blocks_are_innermost_text_blocks_without_code():
    blocks = html_blocks(EN)
    assert [t for t, _ in blocks] == ["title", "h2", "para", "para", "p"]
    assert blocks[3][1] == "its owner (symbolized by u, as in user);"
    assert all("chmod" not in text for _, text in blocks)


def test_same_structure_pairs_in_order_and_untranslated_blocks_are_dropped():
    pairs = align_blocks(html_blocks(EN), html_blocks(DE))
    assert pairs[1] == ("9.3.1. Owners and Permissions", "9.3.1. Eigentümer und Berechtigungen")
    dropped: Counter = Counter()
    kept = [p for en, de in pairs for p in clean_pairs(en, de, dropped)]
    assert ("Three basic types of rights can be combined.",) * 2 not in kept
    assert dropped["untranslated"] == 1
    assert len(kept) == 3  # the title "Owners" is too short


def test_different_structure_keeps_only_long_equal_runs():
    en = [("p", f"English {i}") for i in range(5)]
    de = [("h2", "Titel")] + [("p", f"Deutsch {i}") for i in range(5)]
    assert align_blocks(en, de) == [(f"English {i}", f"Deutsch {i}") for i in range(5)]
    assert align_blocks(en[:2], [("h2", "x"), ("p", "y")]) == []  # a run of one proves nothing


def test_sentences_respect_abbreviations():
    assert sentences("Use a tool, e.g. Foo. It works. Then stop!") == ["Use a tool, e.g. Foo.", "It works.",
                                                                       "Then stop!"]
    # Known limitation (kept, v3's corpus was built with it): the spaced German "z. B." is split
    # after "z."; the sentence counts then differ from the English side and the pair is dropped.
    assert len(sentences("Ein Werkzeug, z. B. Foo. Es geht.")) == 4


def test_long_pairs_split_only_when_sentence_counts_agree():
    en = ("The meeting was moved to Thursday because the manager is ill and cannot attend. " * 4).strip()
    de = ("Die Besprechung wurde auf Donnerstag verschoben, weil der Leiter krank ist und nicht kommen kann. "
          * 4).strip()
    dropped: Counter = Counter()
    assert len(clean_pairs(en, de, dropped)) == 4
    assert clean_pairs(en, de.rsplit(". ", 1)[0] + ".", dropped) == []
    assert dropped["too_long"] == 1


def test_markup_and_code_are_dropped():
    dropped: Counter = Counter()
    assert clean_pairs("Run <command>ls</command> now please", "Führen Sie jetzt ls aus", dropped) == []
    assert clean_pairs("/usr/lib/x86_64/1.2.3/foo.so.6", "/usr/lib/x86_64/1.2.3/foo.so.6 (de)", dropped) == []
    assert dropped["markup_or_code"] == 2


def test_ddtp_descriptions_pair_by_package_and_md5():
    en = ("Package: foo\nDescription-md5: abc\nDescription-en: frobnicate files\n"
          " Foo frobnicates files quickly.\n .\n Features:\n  * fast\n  * small\n")
    de = ("Package: foo\nDescription-md5: abc\nDescription-de: Dateien frobnizieren\n"
          " Foo frobniziert Dateien schnell.\n .\n Funktionen:\n  * schnell\n  * klein\n")
    (p1, m1, d1), = parse_translation(en, "en")
    (p2, m2, d2), = parse_translation(de, "de")
    assert (p1, m1) == (p2, m2) == ("foo", "abc")
    assert description_parts(d1) == ["frobnicate files", "Foo frobnicates files quickly.", "Features:", "fast",
                                     "small"]
    assert len(description_parts(d2)) == 5
