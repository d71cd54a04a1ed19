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
            (f"| baseline: most frequent tokens ({', '.join(b['most_frequent_tokens'])}) | "
             f"{b['most_frequent_top1']:.1%} | {b['most_frequent_top5']:.1%} |"),
            f"\n{ev['masked_tokens']} masked tokens (15% of the held-out test tokens, all replaced by [MASK])."]


MAX_LISTED_SOURCES = 60  # beyond this the card summarises and sources.json lists every one


def _comparison_rows(ev: dict[str, Any]) -> list[str]:
    """Each evaluation set: this model next to the compared checkpoints and copying the source."""
    comp = ev.get("comparison")
    if not comp:
        return []
    rows = ["", "### Next to the previous version, on the same records", ""]
    for name, res in comp.items():
        if name == "systems":
            continue
        rows += [f"**{name}** ({res['sentences']} sentences):", "",
                 "| system | BLEU | chrF | placeholders kept (strings with any) | (all strings) |",
                 "|---|---:|---:|---:|---:|"]
        for system in [k for k in res if k not in ("sentences", "copy_source", "signatures")]:
            r, ph = res[system], res[system]["placeholders"]
            label = "**this model, greedy**" if system == "model_greedy" else f"{system}, greedy"
            kept = f"{ph['preserved']:.1%} of {ph['strings_with_placeholders']}" if ph["preserved"] is not None else "-"
            rows.append(f"| {label} | {r['bleu']} | {r['chrf']} | {kept} | {ph['preserved_all_strings']:.1%} |")
        rows += [f"| copy the source | {res['copy_source']['bleu']} | {res['copy_source']['chrf']} | | |", ""]
        sig = res.get("signatures", {})
        if sig:
            rows += [f"sacreBLEU signatures: BLEU `{sig['bleu']}`, chrF `{sig['chrf']}`", ""]
    systems = comp.get("systems", {})
    if systems:
        rows.append("Systems: " + "; ".join(f"{k} = `{v}`" for k, v in systems.items()) + ".")
    return rows


def _filter_lines(info: dict[str, Any]) -> list[str]:
    f = info.get("filters")
    if not f:
        return []
    drops = ", ".join(f"{k} {v}" for k, v in f["dropped_by_filter"].items())
    after = ", ".join(f"{k} {v}" for k, v in f["after_dedup_and_split"].items())
    held = info.get("splits", {}).get("heldout", {})
    lines = [f"  - corpus size through the filters: {f['catalogue_entries']} catalogue entries; dropped: {drops}; "
             f"{f['pairs']} pairs kept; {info.get('duplicates_removed', 0)} duplicates removed; {after}"]
    if held:
        lines.append(f"  - held out by package ({len(held.get('packages', []))} packages, none of their strings in "
                     f"training; {held.get('removed_as_seen_in_training_packages', 0)} of their pairs dropped because "
                     f"the same source occurs in a training package): {', '.join(held.get('packages', []))}")
    return lines


def _data_lines(cfg: TrainConfig, metrics: dict[str, Any]) -> list[str]:
    unit = "source sentence" if cfg.task == "translation" else "paragraph"
    lines = []
    for corpus, info in metrics["data"].items():
        splits = info.get("splits", {})
        counts = ", ".join(f"{k} {v['records']}" for k, v in splits.items())
        lines.append(f"- `{corpus}` ({counts}); de-duplicated, split by sha256 of the {unit}:")
        sources = [src for src in info.get("sources", []) if "licence" in src]
        if len(sources) > MAX_LISTED_SOURCES:
            licences: dict[str, int] = {}
            for src in sources:
                licences[src["licence"]] = licences.get(src["licence"], 0) + 1
            common = ", ".join(f"{k} ({v})" for k, v in sorted(licences.items(), key=lambda kv: -kv[1])[:8])
            lines.append(f"  - {len(sources)} sources, each with its version and licence in `sources.json`; "
                         f"most common licences: {common}")
        else:
            lines += [f"  - {src['name']} {src.get('version', '')} — licence: {src['licence']}" for src in sources]
        lines += _filter_lines(info)
        if splits:
            hashes = ", ".join(f"{k} `{v['sha256'][:16]}…`" for k, v in splits.items())
            lines.append(f"  - sha256 of the split files: {hashes}")
    return lines


def _model_lines(cfg: TrainConfig, metrics: dict[str, Any], weights_mb: float) -> list[str]:
    m, tk = cfg.model, cfg.tokenizer
    layers = {"translation": f"{m.get('n_encoder_layers')} encoder + {m.get('n_decoder_layers')} decoder layers",
              "causal-lm": f"{m.get('n_decoder_layers')} decoder layers",
              "masked-lm": f"{m.get('n_encoder_layers')} encoder layers"}[cfg.task]
    arch = (f"{metrics['parameters'] / 1e6:.2f}M parameters; d_model {m.get('d_model')}, {layers}, "
            f"{m.get('n_heads')} heads, FFN {m.get('d_ff')}, {m.get('norm_placement', 'post')}-norm, "
            f"{m.get('positional', 'sinusoidal')} positions up to {m.get('max_positions')}")
    kind = "byte-level BPE" if tk.type == "bpe" else "WordPiece"
    return [f"- {arch}",
            f"- tokenizer: {kind}, {tk.vocab_size} tokens requested, trained on the training split",
            f"- `model.safetensors`: {weights_mb:.1f} MB (float32)"]


def _training_lines(cfg: TrainConfig, metrics: dict[str, Any]) -> list[str]:
    s = cfg.schedule
    extras = {"translation": f", label smoothing {s.label_smoothing}",
              "masked-lm": f", masking {s.mask_prob:.0%} (80/10/10)"}.get(cfg.task, "")
    early = " — stopped by its time limit" if metrics["stopped_early"] else ""
    return [(f"- {metrics['train_steps']} steps of AdamW (peak lr {s.lr}, {s.warmup_steps} warmup steps, "
             f"{s.decay.replace('_', '-')} decay, weight decay {s.weight_decay}, gradient clip {s.grad_clip}"
             f"{extras})"),
            (f"- {metrics['train_minutes']} minutes on {metrics['hardware']} (about {metrics['mean_tokens_per_s']} "
             f"tokens/s), world size {metrics['world_size']}{early}"),
            (f"- train loss {metrics['first_train_loss']} -> {metrics['final_train_loss']} (with dropout"
             f"{' and label smoothing' if cfg.task == 'translation' else ''}), validation loss "
             f"{metrics['final_valid_loss']}"),
            *_averaging_lines(metrics), "", "![loss curve](loss_curve.png)"]


def _averaging_lines(metrics: dict[str, Any]) -> list[str]:
    a = metrics.get("averaging")
    if not a:
        return []
    verdict = "exported" if a["kept"] else "not kept: the final weights are exported"
    return [f"- checkpoint averaging: the mean of the snapshots at steps {a['steps']} has validation loss "
            f"{a['valid_loss_averaged']} against {a['valid_loss_final']} for the final weights: {verdict}"]


def _reproduce_lines(cfg: TrainConfig, metrics: dict[str, Any]) -> list[str]:
    note = ""
    if metrics["stopped_early"]:
        note = (f" It stopped at its time limit after {metrics['train_steps']} steps; `--stop-at-step` stops at "
                "the same step with the learning-rate schedule unchanged, so the command above replays the same "
                "batches and learning rates.")
    config = cfg.source_file or "the config"
    return ["```bash",
            "python -m model.train.data prepare   # corpora -> data/corpora (+ manifest.json)",
            metrics["reproduce_command"],
            "```", "",
            f"The run that produced these weights: `{metrics['command']}`.{note}", "",
            (f"To train on your own data, copy `{config}`, point `data.corpora` at directories holding "
             "`train.jsonl.gz`, `valid.jsonl.gz` and `test.jsonl.gz` in the same format, and set `out_dir`.")]


def model_card(cfg: TrainConfig, metrics: dict[str, Any], weights_mb: float) -> str:
    intro = (f"{PURPOSE[cfg.task]}, trained from scratch with this repository's `model.train` on a shared "
             "2-core CPU. A small demonstration model: it exercises the serving stack end to end; it is not "
             "a general-purpose system.")
    lines = [f"# {cfg.name}", "", intro, "", "## Data", "", *_data_lines(cfg, metrics),
             "", "## Model", "", *_model_lines(cfg, metrics, weights_mb),
             "", "## Evaluation (held-out test split)", "", *_metric_rows(cfg.task, metrics["eval"]),
             *_comparison_rows(metrics["eval"])]
    if cfg.task == "translation":
        lines += ["", "Examples (greedy):", ""]
        lines += [f"- `{e['source']}` → `{e['model']}` (reference: `{e['reference']}`)"
                  for e in metrics["eval"]["examples"][:6]]
    if cfg.task == "causal-lm":
        lines += ["", "Samples (temperature 0.8, top-k 40, seed 7):", "", "```"]
        lines += [t.strip() + "\n---" for t in metrics["eval"]["samples"]]
        lines += ["```"]
    licence = ("The weights are derived from the data listed above; use them under the terms of those "
               "licences. The code that produced them is this repository's.")
    lines += ["", "## Training", "", *_training_lines(cfg, metrics),
              "", "## Reproduce / retrain", "", *_reproduce_lines(cfg, metrics),
              "", "## Licence", "", licence, ""]
    return "\n".join(lines)
