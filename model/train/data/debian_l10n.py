"""German gettext catalogues from a broad set of Debian packages (translate-en-de v2).

- Which packages: every package of Debian bookworm/main whose files include
  ``usr/share/locale/de/LC_MESSAGES/*.mo``, read from the archive's ``Contents-*``
  indexes (``discover_packages``), less those whose ``.deb`` is larger than
  ``MAX_DEB_BYTES`` (mostly program binaries carrying a handful of strings). The list is
  committed as ``debian-de-packages.txt`` so a rebuild reads the same set.
- **Reserved for independent evaluation, never fetched or read**: every package whose name
  starts with ``vlc`` and every catalogue whose domain is ``vlc`` (``is_reserved``).
- Held out by package: ``HELDOUT_FIXED`` plus the packages whose name hashes into the
  first ``HELDOUT_PER_MILLE`` of 1000 buckets form a second test set; none of their strings
  is used for training, validation or tuning.
- Each ``.deb`` is fetched with ``apt-get download`` and only its German ``.mo`` files and
  its copyright file are unpacked (``dpkg-deb --fsys-tarfile``); a package whose copyright
  file states no licence is recorded as skipped and not used.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import re
import subprocess
import tarfile
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from model.train.data.sources import SourceError, _run, debian_licence, fetch_deb

PACKAGE_LIST = Path(__file__).with_name("debian-de-packages.txt")
CONTENTS_URLS = ("http://deb.debian.org/debian/dists/bookworm/main/Contents-amd64.gz",
                 "http://deb.debian.org/debian/dists/bookworm/main/Contents-all.gz")
MO_PATH = re.compile(r"^(usr/share/locale/de/LC_MESSAGES/([^/\s]+)\.mo)\s+(\S+)$")
MO_FILE = re.compile(r"usr/share/locale/de/LC_MESSAGES/[^/]+\.mo")
MAX_DEB_BYTES = 20_000_000
HELDOUT_PER_MILLE = 30
# Named for the .po endpoint's tests (they use a real catalogue that no model here trained on).
HELDOUT_FIXED = ("gnome-sudoku", "gnome-mines", "quadrapassel", "ristretto", "mousepad")
# v1's training packages can never be held out: v1 would be scored on its own training data.
V1_PACKAGES = frozenset("""adduser apparmor appstream apt at-spi2-common bash coreutils diffutils dpkg findutils
git gnupg-l10n grep gsettings-desktop-schemas iso-codes libapt-pkg6.0 libdpkg-perl libelf1
libgdk-pixbuf2.0-common libglib2.0-data libgnutls30 libgstreamer1.0-0 libgtk2.0-common libidn2-0
libpam-runtime libpopt0 libpq5 login make man-db needrestart net-tools packagekit polkitd postgresql-15
postgresql-client-15 procps psmisc python-apt-common sed shared-mime-info software-properties-common
systemd tar xdg-user-dirs xz-utils libreoffice-l10n-de""".split())


def is_reserved(package: str, domain: str | None = None) -> bool:
    """Reserved for independent evaluation: never downloaded, read or trained on."""
    return package.startswith("vlc") or domain == "vlc"


def is_heldout(package: str) -> bool:
    if package in V1_PACKAGES:
        return False
    if package in HELDOUT_FIXED:
        return True
    bucket = int.from_bytes(hashlib.sha256(f"heldout:{package}".encode()).digest()[:8], "big") % 1000
    return bucket < HELDOUT_PER_MILLE


def discover_packages(contents: Iterable[bytes], sizes: dict[str, int] | None = None) -> list[str]:
    """Packages holding a German .mo according to Contents indexes (gzip bytes), reserved
    ones left out, and (when ``sizes`` is given) those over ``MAX_DEB_BYTES`` too."""
    found: set[str] = set()
    for blob in contents:
        for line in gzip.decompress(blob).decode("utf-8", "replace").splitlines():
            m = MO_PATH.match(line)
            if not m:
                continue
            for qualified in m.group(3).split(","):
                package = qualified.rsplit("/", 1)[-1]
                if not is_reserved(package, m.group(2)):
                    found.add(package)
    if sizes is not None:
        found = {p for p in found if 0 < sizes.get(p, 0) <= MAX_DEB_BYTES}
    return sorted(found)


def apt_sizes(packages: list[str]) -> dict[str, int]:
    """The .deb size of each package as apt's index states it."""
    out = subprocess.run(["apt-cache", "show", "--no-all-versions", *packages], capture_output=True, text=True).stdout
    sizes, current = {}, None
    for line in out.splitlines():
        if line.startswith("Package: "):
            current = line.split(": ", 1)[1]
        elif line.startswith("Size: ") and current:
            sizes[current] = int(line.split(": ", 1)[1])
    return sizes


def refresh_package_list(path: Path = PACKAGE_LIST) -> list[str]:
    """Re-read the archive's Contents indexes and rewrite the committed package list."""
    blobs = [urllib.request.urlopen(url, timeout=120).read() for url in CONTENTS_URLS]
    candidates = discover_packages(blobs)
    packages = discover_packages(blobs, apt_sizes(candidates))
    path.write_text("# Debian bookworm packages with German gettext catalogues "
                    "(python -m model.train.data packages); vlc* reserved, never listed\n"
                    + "\n".join(packages) + "\n")
    return packages


def read_package_list(path: Path = PACKAGE_LIST) -> list[str]:
    names = [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    reserved = [n for n in names if is_reserved(n)]
    if reserved:
        raise SourceError(f"{path} lists packages reserved for evaluation: {reserved}")
    return names


@dataclass
class DebCatalogues:
    package: str
    version: str
    licence: str | None
    catalogues: dict[str, Path] = field(default_factory=dict)  # domain -> unpacked .mo


def unpack_catalogues(package: str, cache: Path) -> DebCatalogues:
    """Fetch one package and unpack only its German catalogues and its copyright file."""
    if is_reserved(package):
        raise SourceError(f"{package} is reserved for independent evaluation and is never fetched")
    debs = (cache / "debs").resolve()
    debs.mkdir(parents=True, exist_ok=True)
    root = cache.resolve() / "debian-de" / package
    done = root / ".done"
    if not done.is_file():
        deb = fetch_deb(package, debs)
        version = _run(["dpkg-deb", "-f", str(deb), "Version"], debs).strip()
        tar_bytes = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
        root.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:") as tf:
            for member in tf.getmembers():
                name = member.name.lstrip("./")
                # A reserved catalogue (vlc.mo in any package) is not even written to the cache.
                keep = ((MO_FILE.fullmatch(name) is not None and not is_reserved(package, Path(name).stem))
                        or re.fullmatch(r"usr/share/doc/[^/]+/copyright", name) is not None)
                if keep and member.isfile():
                    target = root / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(tf.extractfile(member).read())
        done.write_text(version)
    version = done.read_text()
    mo_dir = root / "usr/share/locale/de/LC_MESSAGES"
    catalogues = {mo.stem: mo for mo in sorted(mo_dir.glob("*.mo")) if not is_reserved(package, mo.stem)}
    return DebCatalogues(package, version, debian_licence(package, root / "usr/share/doc"), catalogues)


def unpack_all(packages: list[str], cache: Path, workers: int = 4) -> list[DebCatalogues]:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda p: unpack_catalogues(p, cache), packages))
