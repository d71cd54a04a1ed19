"""The README.md model card written beside each exported checkpoint."""

from __future__ import annotations

from typing import Any

from model.train.config import TrainConfig

PURPOSE = {
    "translation": "English -> German translation of short software/UI-style sentences (encoder-decoder, "
                   "the 2017 paper's architecture)",
    "causal-lm": "English text generation in the style of Shakespeare's and Milton's works (decoder-only, "
                 "GPT style)",
    "masked-lm": "English masked-token fill and sentence embeddings (encoder-only, BERT style)",
}


def _metric_rows(task: str, ev: dict[str, Any]) -> list[str]:
    b = ev["baselines"]
    if task == "translation":
        rows = ["| system | BLEU | chrF |", "|---|---:|---:|",
                f"| **this model, greedy** | **{ev['model_greedy']['bleu']}** | **{ev['model_greedy']['chrf']}** |"]
        for key, label in (("copy_source", "baseline: copy the source"),
                           ("most_frequent_translation", "baseline: most frequent training translation"),
                           ("word_for_word_glossary", "baseline: word-for-word glossary")):
            rows.append(f"| {label} | {b[key]['bleu']} | {b[key]['chrf']} |")
        beam = [k for k in ev if k.startswith("model_beam")]
        for k in beam:
            n = k.rsplit("first", 1)[1]
            g = ev[f"model_greedy_first{n}"]
            rows.append(f"| this model, beam {k[10:].split('_')[0]} (first {n} sentences; greedy there: "
                        f"{g['bleu']} / {g['chrf']}) | {ev[k]['bleu']} | {ev[k]['chrf']} |")
        rows.append(f"\n{ev['test_sentences']} held-out test sentences, sacreBLEU defaults (13a tokenisation).")
        return rows
    if task == "causal-lm":
        return ["| system | test perplexity (per BPE token) |", "|---|---:|",
                f"| **this model** | **{ev['model_perplexity']}** |",
                f"| baseline: unigram token frequencies | {b['unigram_perplexity']} |",
                f"\n{ev['test_tokens']} held-out test tokens."]
    return ["| system | top-1 | top-5 |", "|---|---:|---:|",
            f"| **this model** | **{ev['model_top1']:.1%}** | **{ev['model_top5']:.1%}** |",
            f"| baseline: most frequent tokens ({', '.join(b['most_frequent_tokens'])}) | "
            f"{b['most_frequent_top1']:.1%} | {b['most_frequent_top5']:.1%} |",
            f"\n{ev['masked_tokens']} masked tokens (15% of the held-out test tokens, all replaced by [MASK])."]


def model_card(cfg: TrainConfig, metrics: dict[str, Any], weights_mb: float) -> str:
    m, tk, s = cfg.model, cfg.tokenizer, cfg.schedule
    layers = {"translation": f"{m.get('n_encoder_layers')} encoder + {m.get('n_decoder_layers')} decoder layers",
              "causal-lm": f"{m.get('n_decoder_layers')} decoder layers",
              "masked-lm": f"{m.get('n_encoder_layers')} encoder layers"}[cfg.task]
    lines = [f"# {cfg.name}", "", f"{PURPOSE[cfg.task]}, trained from scratch with this repository's "
             "`model.train` on a 2-core CPU. A small demonstration model: it shows the serving stack "
             "end to end; it is not a general-purpose system.", "", "## Data", ""]
    for corpus, info in metrics["data"].items():
        splits = info.get("splits", {})
        counts = ", ".join(f"{k} {v['records']}" for k, v in splits.items())
        lines.append(f"- `{corpus}` ({counts}); records de-duplicated and split by sha256 of the "
                     f"{'source sentence' if cfg.task == 'translation' else 'paragraph'}:")
        for src in info.get("sources", []):
            if "licence" in src:
                lines.append(f"  - {src['name']} {src.get('version', '')} — licence: {src['licence']}")
        if splits:
            lines.append("  - sha256 of the splits: " + ", ".join(f"{k} `{v['sha256'][:16]}…`"
                                                                     for k, v in splits.items()))
    lines += ["", "## Model", "",
              f"- {metrics['parameters'] / 1e6:.2f}M parameters; d_model {m.get('d_model')}, {layers}, "
              f"{m.get('n_heads')} heads, FFN {m.get('d_ff')}, {m.get('norm_placement', 'post')}-norm, "
              f"{m.get('positional', 'sinusoidal')} positions, max {m.get('max_positions')} positions",
              f"- tokenizer: {'byte-level BPE' if tk.type == 'bpe' else 'WordPiece'}, "
              f"{metrics['train_config']['tokenizer']['vocab_size']} requested vocabulary, trained on the training split",
              f"- `model.safetensors`: {weights_mb:.1f} MB (float32)", "",
              "## Evaluation (held-out test split)", ""]
    lines += _metric_rows(cfg.task, metrics["eval"])
    if cfg.task == "translation":
        lines += ["", "Examples (greedy):", ""]
        lines += [f"- `{e['source']}` → `{e['model']}` (reference: `{e['reference']}`)"
                  for e in metrics["eval"]["examples"][:5]]
    if cfg.task == "causal-lm":
        lines += ["", "Samples (temperature 0.8, top-k 40, seed 7):", ""]
        lines += ["```", *[t.strip() + "\n---" for t in metrics["eval"]["samples"]], "```"]
    lines += ["", "## Training", "",
              f"- {metrics['train_steps']} steps of AdamW (peak lr {s.lr}, {s.warmup_steps} warmup steps, "
              f"{s.decay.replace('_', '-')} decay, weight decay {s.weight_decay}, gradient clip {s.grad_clip})"
              + (f", label smoothing {s.label_smoothing}" if cfg.task == "translation" else "")
              + (f", masking {s.mask_prob:.0%} (80/10/10)" if cfg.task == "masked-lm" else ""),
              f"- {metrics['train_minutes']} minutes on {metrics['hardware']} "
              f"(about {metrics['mean_tokens_per_s']} tokens/s), world size {metrics['world_size']}"
              + (" — stopped early at the time limit" if metrics["stopped_early"] else ""),
              f"- final train loss {metrics['final_train_loss']}, validation loss {metrics['final_valid_loss']}; "
              "curve: `loss_curve.png`", "",
              "![loss curve](loss_curve.png)", "",
              "## Reproduce / retrain", "",
              "```bash",
              "python -m model.train.data prepare            # corpora -> data/corpora (+ manifest.json)",
              metrics["reproduce_command"],
              "```", "",
              f"The run that produced these weights: `{metrics['command']}`"
              + (f" (stopped by its time limit after {metrics['train_steps']} steps; the inverse-sqrt schedule "
                 "does not depend on max_steps, so the command above gives the same weights)"
                 if metrics["stopped_early"] else "") + ".", "",
              f"To train on your own data, copy `{cfg.source_file or 'the config'}`, point `data.corpora` at "
              "directories holding `train/valid/test.jsonl.gz` in the same format, and set `out_dir`.", "",
              "## Licence", "",
              "The weights are derived from the data listed above; use them under the terms of those "
              "licences (the strictest applies). The code that produced them is this repository's.", ""]
    return "\n".join(lines)
