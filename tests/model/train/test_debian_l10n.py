"""translate-en-de v2 sources: which Debian packages, the vlc reservation, the held-out split,
and unpacking one real (test-built) .deb without apt."""

from __future__ import annotations

import gzip
import hashlib
import shutil
import subprocess
from pathlib import Path

import polib
import pytest

from model.train.data import debian_l10n
from model.train.data.debian_l10n import (
    HELDOUT_FIXED,
    MAX_DEB_BYTES,
    PACKAGE_LIST,
    V1_PACKAGES,
    discover_packages,
    is_heldout,
    is_reserved,
    read_package_list,
    unpack_catalogues,
)
from model.train.data.sources import SourceError

MO = "usr/share/locale/de/LC_MESSAGES"


def contents(*lines: str) -> bytes:
    return gzip.compress(("\n".join(lines) + "\n").encode())


def test_discover_packages_reads_german_catalogues_only():
    amd64 = contents(
        f"{MO}/foo.mo                                  utils/pkg1,games/pkg2",
        f"{MO}/bar.mo   net/pkg3",
        "usr/share/locale/fr/LC_MESSAGES/foo.mo   utils/french-only",  # another locale
        "usr/share/locale/de_AT/LC_MESSAGES/foo.mo   utils/austrian-only",
        f"{MO}/sub/nested.mo   utils/nested-only",  # not directly in LC_MESSAGES
        f"{MO}/foo.po   utils/po-only",  # not a compiled catalogue
        "usr/share/doc/pkg9/de/LC_MESSAGES/x.mo   doc/wrong-path",
        "usr/bin/pkg1   utils/pkg1",
    )
    all_ = contents(
        f"{MO}/vlc.mo   video/not-vlc-but-vlc-domain",  # the reserved domain, in any package
        f"{MO}/vlc-plugin.mo   video/vlc-plugin-base,video/vlc-l10n",  # vlc* packages
        f"{MO}/baz.mo   libs/pkg2,libs/pkg4",
    )
    assert discover_packages([amd64, all_]) == ["pkg1", "pkg2", "pkg3", "pkg4"]


def test_discover_packages_size_filter():
    blob = contents(f"{MO}/a.mo   x/small,x/exact,x/big,x/unknown,x/empty")
    sizes = {"small": 1_000, "exact": MAX_DEB_BYTES, "big": MAX_DEB_BYTES + 1, "empty": 0}
    assert discover_packages([blob], sizes) == ["exact", "small"]
    assert discover_packages([blob]) == ["big", "empty", "exact", "small", "unknown"]


def test_is_reserved():
    for name in ("vlc", "vlc-l10n", "vlc-plugin-base", "vlcrc"):
        assert is_reserved(name)
        assert is_reserved(name, "anything")
    assert is_reserved("gnome-mines", "vlc")
    for name, domain in (("gnome-mines", None), ("libvlc5", None), ("gnome-mines", "vlc-extra"), ("x", "libvlc")):
        assert not is_reserved(name, domain)


def _bucket(package: str) -> int:
    return int.from_bytes(hashlib.sha256(f"heldout:{package}".encode()).digest()[:8], "big") % 1000


def test_is_heldout():
    assert all(is_heldout(p) for p in HELDOUT_FIXED)
    assert not any(is_heldout(p) for p in V1_PACKAGES)
    assert _bucket("xdg-user-dirs") < debian_l10n.HELDOUT_PER_MILLE  # would be held out if it were not v1's
    packages = read_package_list()
    for p in packages[:200]:  # the same hash rule, computed here independently
        assert is_heldout(p) == (p in HELDOUT_FIXED or (p not in V1_PACKAGES and _bucket(p) < 30)), p
    share = sum(map(is_heldout, packages)) / len(packages)
    assert 0.02 < share < 0.05, share


def test_committed_package_list():
    packages = read_package_list()
    assert len(packages) > 1000 and packages == sorted(set(packages))
    assert not [p for p in packages if is_reserved(p)]
    assert not [ln for ln in PACKAGE_LIST.read_text().splitlines() if "vlc" in ln.split("#")[0]]
    assert set(HELDOUT_FIXED) <= set(packages)


def test_read_package_list_refuses_a_reserved_package(tmp_path):
    path = tmp_path / "list.txt"
    path.write_text("# comment\nfoo\n\n  bar  \n")
    assert read_package_list(path) == ["foo", "bar"]
    path.write_text("foo\nvlc-l10n\nbar\n")
    with pytest.raises(SourceError, match="vlc-l10n"):
        read_package_list(path)


def test_unpack_catalogues_refuses_a_reserved_package_without_running_anything(tmp_path, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError(f"ran {args}")

    monkeypatch.setattr(debian_l10n, "_run", forbidden)
    monkeypatch.setattr(debian_l10n.subprocess, "run", forbidden)
    for name in ("vlc", "vlc-l10n"):
        with pytest.raises(SourceError, match="reserved"):
            unpack_catalogues(name, tmp_path)
    assert list(tmp_path.iterdir()) == []  # not even the cache folders


COPYRIGHT = """Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: tiny

Files: *
Copyright: 2024 Someone
License: GPL-3+

Files: debian/*
Copyright: 2024 Someone Else
License: MIT
"""


def _mo(path: Path, pairs: dict[str, str]) -> None:
    po = polib.POFile()
    po.metadata = {"Content-Type": "text/plain; charset=UTF-8", "Language": "de"}
    for msgid, msgstr in pairs.items():
        po.append(polib.POEntry(msgid=msgid, msgstr=msgstr))
    path.parent.mkdir(parents=True, exist_ok=True)
    po.save_as_mofile(str(path))


def build_deb(tmp: Path, package: str, version: str) -> Path:
    root = tmp / f"{package}-root"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN/control").write_text(
        f"Package: {package}\nVersion: {version}\nArchitecture: all\nMaintainer: Test <t@example.org>\n"
        "Description: test package\n tiny\n")
    _mo(root / MO / "tiny.mo", {"Open file": "Datei öffnen", "Delete %s": "%s löschen"})
    _mo(root / MO / "vlc.mo", {"Play": "Abspielen"})  # the reserved domain inside an ordinary package
    _mo(root / "usr/share/locale/fr/LC_MESSAGES/tiny.mo", {"Open file": "Ouvrir le fichier"})
    (root / "usr/bin").mkdir(parents=True)
    (root / "usr/bin/tiny").write_text("#!/bin/sh\n")
    (root / f"usr/share/doc/{package}").mkdir(parents=True)
    (root / f"usr/share/doc/{package}/copyright").write_text(COPYRIGHT)
    deb = tmp / f"{package}_{version}_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root), str(deb)],
                   check=True, capture_output=True)
    return deb


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
def test_unpack_catalogues_end_to_end(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    (cache / "debs").mkdir(parents=True)
    deb = build_deb(tmp_path, "tiny-l10n", "1.2-3")
    shutil.move(deb, cache / "debs" / deb.name)  # already "downloaded": apt-get is never run

    real_run = debian_l10n._run

    def no_apt(cmd, cwd):
        assert cmd[0] != "apt-get", cmd
        return real_run(cmd, cwd)

    monkeypatch.setattr(debian_l10n, "_run", no_apt)
    got = unpack_catalogues("tiny-l10n", cache)
    assert got.package == "tiny-l10n" and got.version == "1.2-3" and got.licence == "GPL-3+"
    assert list(got.catalogues) == ["tiny"]  # vlc.mo is never returned, fr is not German
    entries = {e.msgid: e.msgstr for e in polib.mofile(str(got.catalogues["tiny"]))}
    assert entries == {"Open file": "Datei öffnen", "Delete %s": "%s löschen"}
    unpacked = cache / "debian-de" / "tiny-l10n"
    files = sorted(str(p.relative_to(unpacked)) for p in unpacked.rglob("*") if p.is_file())
    assert files == [".done", "usr/share/doc/tiny-l10n/copyright", f"{MO}/tiny.mo"]  # no vlc.mo on disk either

    # The second call reads the unpacked tree: the .deb is no longer needed.
    (cache / "debs" / deb.name).unlink()
    again = unpack_catalogues("tiny-l10n", cache)
    assert again.version == "1.2-3" and list(again.catalogues) == ["tiny"]


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb")
def test_a_package_without_a_licence_has_none(tmp_path):
    cache = tmp_path / "cache"
    (cache / "debs").mkdir(parents=True)
    deb = build_deb(tmp_path, "nolicence", "1")
    unpacked_doc = tmp_path / "nolicence-root" / "usr/share/doc/nolicence/copyright"
    unpacked_doc.write_text("Copyright 2024 Someone. All rights reserved.\n")
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(tmp_path / "nolicence-root"),
                    str(cache / "debs" / deb.name)], check=True, capture_output=True)
    got = unpack_catalogues("nolicence", cache)
    assert got.licence is None and list(got.catalogues) == ["tiny"]
