"""The records a training run reads: every corpus's split, translation pairs masked to
sentinels when the model is trained on masked placeholders. Shared by the loop and the export
(evaluation), so neither imports the other for it."""

from __future__ import annotations

from collections.abc import Sequence

from model.text.placeholders import mask, mask_target
from model.train.config import TrainConfig
from model.train.data.corpus import load_split


def mask_pairs(records: Sequence[dict]) -> list[dict]:
    """Translation pairs with placeholders masked to sentinels on both sides (model.text.placeholders);
    a pair whose sides do not hold the same placeholders is dropped."""
    out = []
    for rec in records:
        source, found = mask(rec["source"])
        target = mask_target(rec["target"], found)
        if target is not None:
            out.append({**rec, "source": source, "target": target})
    return out


def load_records(cfg: TrainConfig, split: str, raw: bool = False) -> list[dict]:
    """The records of ``split`` from every corpus; translation pairs masked when the model is
    trained on masked placeholders, unless ``raw`` (evaluation scores the raw strings)."""
    records: list[dict] = []
    for corpus in cfg.data.corpora:
        recs = load_split(corpus, split)
        cap = cfg.data.max_train_records if split == "train" else None
        recs = recs[:cap] if cap else recs
        records += recs * (cfg.data.repeat.get(corpus, 1) if split == "train" else 1)
    if cfg.task == "translation" and cfg.model.get("mask_placeholders") and not raw:
        records = mask_pairs(records)
    return records
