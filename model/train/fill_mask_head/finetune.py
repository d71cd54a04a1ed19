"""``finetune``: every encoder layer, the head and the [MASK] row trained together, masks drawn
on the fly (resumes from the saved state); ``export``: the head file from that state."""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from model.train.fill_mask_head.batches import MAX_LEN, epoch_batches, finetune_rows, mask_for_training, pad_batch
from model.train.fill_mask_head.data import masked_word, read_jsonl_gz
from model.train.fill_mask_head.head import (
    ENCODER,
    HEAD_FILE,
    embedding_params,
    encode_states,
    export_finetuned,
    init_from_head_file,
    new_head,
)


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
