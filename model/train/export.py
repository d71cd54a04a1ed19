"""After training: held-out evaluation, the servable checkpoint, loss curve and model card."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from model.formats.checkpoint import WEIGHTS_FILE, save
from model.formats.checkpoint import load as load_checkpoint
from model.nn.transformer import TransformerModel
from model.tokenization.tokenizer import Tokenizer
from model.train.config import TrainConfig
from model.train.evaluate import (
    eval_subset,
    heldout_metrics,
    lm_metrics,
    mlm_metrics,
    sample_text,
    translation_metrics,
)
from model.train.model_card import MAX_LISTED_SOURCES, model_card
from model.train.objectives import Objective
from model.train.records import load_records

LOSS_CURVE_FILE = "loss_curve.png"
LM_PROMPTS = ("To be, or not to be", "KING.\n", "The Python interpreter", "O Romeo,")


def corpus_manifest(corpus_dir: str) -> dict[str, Any]:
    """This corpus's entry of the manifest written by `model.train.data prepare` (if present)."""
    path = Path(corpus_dir).parent / "manifest.json"
    if not path.is_file():
        return {}
    entry = json.loads(path.read_text()).get(Path(corpus_dir).name, {})
    keep = ("name", "version", "licence", "heldout", "pairs")
    out = {"splits": entry.get("splits", {}), "duplicates_removed": entry.get("duplicates_removed"),
           "sources": [{k: s[k] for k in keep if k in s} for s in entry.get("sources", [])]}
    if "filters" in entry:
        out["filters"] = entry["filters"]
    return out


def plot_loss_curve(history: dict[str, list], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: render straight to a file
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    if history["train"]:
        steps, losses = zip(*history["train"])
        ax.plot(steps, losses, label="train (mean per log interval; dropout on)", linewidth=1.2)
    if history["valid"]:
        steps, losses = zip(*history["valid"])
        ax.plot(steps, losses, "o-", label="validation", linewidth=1.2, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def task_metrics(cfg: TrainConfig, model: TransformerModel, tok: Tokenizer, objective: Objective,
                 train_records: Sequence[dict]) -> dict[str, Any]:
    if cfg.task == "translation":
        return translation_eval(cfg, model, tok, train_records)
    test = load_records(cfg, "test")[: cfg.data.max_eval_records or None]
    texts = [r["text"] for r in test]
    if cfg.task == "causal-lm":
        out = lm_metrics(model, tok, texts, objective.train_stream, cfg.data.max_len)
        out["samples"] = sample_text(model, tok, LM_PROMPTS)
        return out
    return mlm_metrics(model, tok, texts, objective.train, cfg.data.max_len, cfg.schedule.mask_prob)


def translation_eval(cfg: TrainConfig, model: TransformerModel, tok: Tokenizer,
                     train_records: Sequence[dict]) -> dict[str, Any]:
    """The test split (and the package-held-out split), raw strings, next to the checkpoints
    named in ``eval.compare_with``."""
    test = eval_subset(load_records(cfg, "test", raw=True), cfg.data.max_eval_records)
    out = translation_metrics(model, tok, test, train_records, cfg.eval.max_new_tokens,
                              cfg.eval.beam_size, cfg.eval.beam_sentences)
    others = {}
    for name, path in cfg.eval.compare_with.items():
        ckpt = load_checkpoint(path)
        others[name] = (ckpt.model, ckpt.tokenizer)
    sets = {"test": test}
    if cfg.eval.heldout:
        sets["heldout_packages"] = eval_subset(load_records(cfg, "heldout", raw=True), cfg.data.max_eval_records)
    out["comparison"] = {name: heldout_metrics(model, tok, recs, cfg.eval.max_new_tokens, others)
                         for name, recs in sets.items()}
    out["comparison"]["systems"] = {"model_greedy": cfg.out_dir, **cfg.eval.compare_with}
    return out


def export(cfg: TrainConfig, model: TransformerModel, tok: Tokenizer, objective: Objective,
           history: dict[str, list], train_records: Sequence[dict], command: str, train_seconds: float,
           stopped_early: bool, log: Callable[[str], None], steps_done: int | None = None) -> dict[str, Any]:
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if steps_done is None:  # the last logged step (may lag the true count by < log_every)
        steps_done = history["train"][-1][0] if history["train"] else 0
    model.eval()
    log(f"[{cfg.name}] evaluating on the test split")
    evaluation = task_metrics(cfg, model, tok, objective, train_records)
    metrics = {
        "name": cfg.name,
        "task": cfg.task,
        "parameters": model.num_parameters(),
        "train_steps": steps_done,
        "stopped_early": stopped_early,
        "averaged_snapshots": history.get("averaged_snapshots", []),  # steps whose mean weights were exported
        "averaging": history.get("averaging"),  # validation loss of the mean and of the final weights
        "train_minutes": round(train_seconds / 60, 1),
        "hardware": f"{platform.machine()} CPU x{torch.get_num_threads()} threads" if model.device.type == "cpu"
        else torch.cuda.get_device_name(model.device),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "first_train_loss": round(history["train"][0][1], 4) if history["train"] else None,
        "final_train_loss": round(history["train"][-1][1], 4) if history["train"] else None,
        "final_valid_loss": round(history["valid"][-1][1], 4) if history["valid"] else None,
        "mean_tokens_per_s": round(sum(r for _, r in history["tokens_per_s"]) / max(1, len(history["tokens_per_s"]))),
        "eval": evaluation,
        "data": {c: corpus_manifest(c) for c in cfg.data.corpora},
        "command": command,
        # Stopped early: the same command with --stop-at-step (schedule unchanged) gives the same weights.
        "reproduce_command": _reproduce(cfg, command, steps_done, stopped_early),
        "train_config": cfg.to_dict(),
    }
    save(out, model.float().cpu(), tok, metrics)
    sources = [src for info in metrics["data"].values() for src in info.get("sources", []) if "licence" in src]
    if len(sources) > MAX_LISTED_SOURCES:  # the card summarises; every package, version and licence here
        (out / "sources.json").write_text(json.dumps(sources, indent=1, ensure_ascii=False) + "\n")
    plot_loss_curve(history, out / LOSS_CURVE_FILE, f"{cfg.name}: training loss")
    size_mb = (out / WEIGHTS_FILE).stat().st_size / 1e6
    (out / "README.md").write_text(model_card(cfg, metrics, size_mb))
    log(f"[{cfg.name}] wrote {out} ({size_mb:.1f} MB weights): {json.dumps(_headline(evaluation))}")
    return metrics


def _reproduce(cfg: TrainConfig, command: str, steps: int, stopped_early: bool) -> str:
    """The command with the time limit replaced by a stop at the steps actually run."""
    base = command or f"python -m model.train --config {cfg.source_file}"
    if not stopped_early:
        return base
    words, kept = base.split(), []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in ("--time-limit-min", "--stop-at-step"):
            skip = True
        else:
            kept.append(word)
    return " ".join(kept + ["--stop-at-step", str(steps)])


def _headline(evaluation: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in evaluation.items() if k not in ("examples", "samples")}
