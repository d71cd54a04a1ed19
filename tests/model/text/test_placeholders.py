"""model.text.placeholders: the grammar, masking to sentinels and back, and the partial restore."""

from __future__ import annotations

import pytest

from model.text.mnemonics import add_mnemonic, find_mnemonic
from model.text.placeholders import mask, mask_target, placeholders, restore, same_placeholders, sentinel, unmask


@pytest.mark.parametrize("text,found", [
    ("Delete %s files", ["%s"]),
    ("%(count)d of %(total)d", ["%(count)d", "%(total)d"]),
    ("%1$s of %2$s", ["%1$s", "%2$s"]),
    ("{0} and {name} and {} and {0:>3}", ["{0:>3}", "{0}", "{name}", "{}"]),
    ("Restart %PRODUCTNAME now", ["%PRODUCTNAME"]),
    ("$1 and ${HOME} and $(ARG)", ["$(ARG)", "$1", "${HOME}"]),
    ("100%% sure, %5.2f%%", ["%5.2f"]),
    ("no placeholders here", []),
])
def test_placeholders_found(text, found):
    assert placeholders(text) == sorted(found)


def test_mask_numbers_in_order_and_unmask_restores():
    text = "Copy %s to {dest}: 100%% done"
    masked, found = mask(text)
    assert masked == f"Copy {sentinel(1)} to {sentinel(2)}: 100%% done" and found == ["%s", "{dest}"]
    assert unmask(masked, found) == text


def test_unmask_follows_reordered_sentinels():
    masked, found = mask("%1$s of %2$s")
    assert unmask("⟪2⟫ von ⟪1⟫", found) == "%2$s von %1$s"
    assert same_placeholders("%1$s of %2$s", "%2$s von %1$s")


@pytest.mark.parametrize("output", ["⟪1⟫ Dateien", "⟪1⟫ ⟪1⟫ ⟪2⟫", "⟪1⟫ ⟪2⟫ ⟪3⟫", "⟪2⟫ ⟪3⟫"])
def test_unmask_refuses_lost_repeated_or_invented_sentinels(output):
    assert unmask(output, ["%s", "{0}"]) is None


def test_no_placeholders_round_trip_and_invented_sentinel():
    assert mask("Open the file") == ("Open the file", [])
    assert unmask("Datei öffnen", []) == "Datei öffnen"
    assert unmask("Datei ⟪1⟫ öffnen", []) is None


def test_text_with_a_sentinel_of_its_own_is_not_masked():
    assert mask("a ⟪1⟫ and %s") == ("a ⟪1⟫ and %s", [])


def test_restore_keeps_what_survived():
    assert restore("⟪2⟫ und ⟪2⟫ und ⟪7⟫", ["%s", "%d"]) == "%d und  und "
    assert restore("ohne", ["%s"]) == "ohne"


def test_mask_target_uses_the_source_numbers():
    _, found = mask("%s of %d")
    assert mask_target("%d von %s", found) == "⟪2⟫ von ⟪1⟫"
    assert mask_target("%d von", found) is None


@pytest.mark.parametrize("text,expected", [
    ("_Open", ("Open", "_", "O")), ("Save _As", ("Save As", "_", "A")), ("A_ppearance", ("Appearance", "_", "p")),
    ("&File", ("File", "&", "F")), ("~Save", ("Save", "~", "S")), ("file_name", None), ("Rock &amp; roll", None),
    ("Plain text", None),
])
def test_find_mnemonic(text, expected):
    assert find_mnemonic(text) == expected


@pytest.mark.parametrize("text,marker,key,expected", [
    ("Öffnen", "_", "O", "_Öffnen"), ("Datei speichern", "_", "S", "Datei _speichern"),
    ("%s Dateien", "&", "f", "%s &Dateien"), ("...", "_", "x", "..."),
])
def test_add_mnemonic(text, marker, key, expected):
    assert add_mnemonic(text, marker, key) == expected
