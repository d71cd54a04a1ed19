"""Fetching raw sources into a cache directory with the ordinary package clients.

Everything comes from a package registry by name and pinned version where the registry
allows it (PyPI), so a rebuild on another machine reads the same bytes; Debian packages
are recorded with the version apt served. Nothing is fetched when the cache has it.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

SYSTEM_LOCALE_DIR = Path("/usr/share/locale/de/LC_MESSAGES")


class SourceError(RuntimeError):
    """A source that cannot be fetched or unpacked; the message says which and how to fix it."""


@dataclass
class Fetched:
    name: str  # e.g. "debian:libreoffice-l10n-de"
    version: str
    root: Path  # unpacked tree


def _run(cmd: list[str], cwd: Path) -> str:
    try:
        done = subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise SourceError(f"'{cmd[0]}' is not installed; it is needed to fetch {cmd[-1]}") from None
    except subprocess.CalledProcessError as exc:
        raise SourceError(f"{' '.join(cmd)} failed ({exc.returncode}): {exc.stderr.strip()[-500:]}") from None
    return done.stdout


def fetch_deb(package: str, cache: Path) -> Path:
    """The package's .deb in ``cache``, fetched with ``apt-get download`` when not there yet."""
    found = sorted(cache.glob(f"{package}_*.deb"))
    if not found:
        _run(["apt-get", "download", package], cache)
        found = sorted(cache.glob(f"{package}_*.deb"))
        if not found:
            raise SourceError(f"apt-get download {package} produced no .deb in {cache}")
    return found[-1]


def debian_package(package: str, cache: Path) -> Fetched:
    """``apt-get download`` a .deb (once) and unpack it with ``dpkg-deb -x``."""
    cache = cache.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    deb = fetch_deb(package, cache)
    version = _run(["dpkg-deb", "-f", str(deb), "Version"], cache).strip()
    root = cache / f"{package}-unpacked"
    if not (root / ".done").is_file():
        root.mkdir(exist_ok=True)
        _run(["dpkg-deb", "-x", str(deb), str(root)], cache)
        (root / ".done").write_text(version)
    return Fetched(f"debian:{package}", version, root)


def pypi_distribution(requirement: str, cache: Path, binary: bool) -> Fetched:
    """``pip download --no-deps`` a pinned distribution (wheel or sdist) and unpack it."""
    name, _, version = requirement.partition("==")
    if not version:
        raise SourceError(f"PyPI source '{requirement}' must be pinned as name==version")
    cache = cache.resolve()
    cache.mkdir(parents=True, exist_ok=True)
    stem = f"{name.lower().replace('-', '_')}-{version}"
    pattern = f"{stem}-*.whl" if binary else f"{stem}.tar.gz"

    def matching() -> list[Path]:  # wheel/sdist names are normalised to lower case with '_'
        return sorted(p for p in cache.iterdir() if fnmatch.fnmatch(p.name.lower(), pattern))

    found = matching()
    if not found:
        kind = ["--only-binary", ":all:"] if binary else ["--no-binary", ":all:"]
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *kind, "-d", str(cache), requirement],
             cache)
        found = matching()
        if not found:
            raise SourceError(f"pip download {requirement} produced nothing matching {pattern} in {cache}")
    archive = found[0]
    root = cache / f"{name}-{version}-unpacked"
    if not (root / ".done").is_file():
        root.mkdir(exist_ok=True)
        if archive.suffix == ".whl":
            import zipfile

            with zipfile.ZipFile(archive) as zf:
                zf.extractall(root)
        else:
            with tarfile.open(archive) as tf:
                tf.extractall(root, filter="data")
        (root / ".done").write_text(version)
    return Fetched(f"pypi:{name}", version, root)


def debian_owner(path: Path) -> tuple[str, str] | None:
    """(package, version) that installed ``path``, or None when dpkg does not know it."""
    try:
        out = subprocess.run(["dpkg", "-S", str(path)], capture_output=True, text=True, check=True).stdout
        package = out.split(":", 1)[0].strip()
        version = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True,
                                 text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return package, version


def _free_text_licence(text: str) -> str | None:
    """Best guess from a copyright file that is not machine-readable: the GNU licence it cites."""
    if "Lesser General Public" in text or "Library General Public" in text:
        name = "LGPL"
    elif "General Public License" in text:
        name = "GPL"
    else:
        return None
    version = re.search(r"General Public License,?\s+(?:as published by[^,.]*,?\s+)?(?:either\s+)?"
                        r"[Vv]ersion (\d(?:\.\d)?)", text)
    plus = "+" if re.search(r"any\s+later\s+version", text) else ""
    return f"{name}-{version.group(1) if version else '?'}{plus} (from a free-text copyright file)"


def debian_licence(package: str, doc_root: Path = Path("/usr/share/doc")) -> str | None:
    """The main licence of an installed Debian package from its copyright file, or None when
    the file declares no ``License:`` field (such packages are not used). For the
    machine-readable (DEP-5) format: the ``License:`` of the ``Files: *`` stanza; for a
    free-text file: the GNU licence its text cites, else its first ``License:`` line."""
    copyright_file = doc_root / package / "copyright"
    if not copyright_file.is_file():
        return None
    text = copyright_file.read_text(errors="replace")
    first = re.search(r"^License:\s*(\S[^\n]*)", text, re.MULTILINE)
    if first is None:
        return None
    if not text.startswith("Format:"):
        return _free_text_licence(text) or first.group(1).strip()
    for stanza in re.split(r"\n\s*\n", text):
        if re.search(r"^Files:\s*\*\s*$", stanza, re.MULTILINE):
            found = re.search(r"^License:\s*(\S[^\n]*)", stanza, re.MULTILINE)
            if found:
                return found.group(1).strip()
    return first.group(1).strip()
