"""The earlier head: ``features`` runs the masked training sentences through the frozen encoder
once and caches the states (resumes); ``train`` fits the head (and ``--unfreeze-top`` layers) on them."""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from model.train.fill_mask_head.batches import MAX_LEN, mask_words, pad_batch
from model.train.fill_mask_head.data import read_jsonl_gz
from model.train.fill_mask_head.head import (
    ENCODER,
    HEAD_FILE,
    encoder_parts,
    head_state,
    new_head,
    run_top,
    write_manifest,
)


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
