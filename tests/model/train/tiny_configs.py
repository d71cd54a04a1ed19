"""Tiny training configs over the committed fixture corpora (seconds per run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model.train.config import TrainConfig

FIXTURES = Path(__file__).parent / "fixtures"

_MODELS = {
    "translation": {"d_model": 32, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 1, "d_ff": 64,
                    "max_positions": 256, "norm_placement": "pre", "final_norm": True, "scale_embedding": True},
    "causal-lm": {"d_model": 32, "n_heads": 2, "n_decoder_layers": 2, "d_ff": 64, "max_positions": 512,
                  "norm_placement": "pre", "final_norm": True, "positional": "learned"},
    "masked-lm": {"d_model": 32, "n_heads": 2, "n_encoder_layers": 2, "d_ff": 64, "max_positions": 256,
                  "positional": "learned", "mlm_transform": True, "lm_head_bias": True},
}
_CORPORA = {"translation": ["translation"], "causal-lm": ["literature"], "masked-lm": ["literature", "python-docs"]}


def tiny_config(task: str, tmp: Path, steps: int = 30, dropout: float = 0.1, **schedule: Any) -> TrainConfig:
    data = {
        "name": f"tiny-{task}",
        "task": task,
        "model": {**_MODELS[task], "dropout": dropout},
        "tokenizer": {"type": "wordpiece" if task == "masked-lm" else "bpe", "vocab_size": 400},
        "data": {"corpora": [str(FIXTURES / c) for c in _CORPORA[task]], "max_len": 32, "max_eval_records": 20},
        "schedule": {"max_steps": steps, "batch_tokens": 600, "batch_size": 8, "lr": 3e-3, "warmup_steps": 5,
                     "eval_every": 10, "checkpoint_every": 10, "log_every": 5, "seed": 7, "threads": 1, **schedule},
        "eval": {"beam_size": 2, "beam_sentences": 5, "max_new_tokens": 12},
        "out_dir": str(tmp / "out"),
        "work_dir": str(tmp / "work"),
    }
    return TrainConfig.from_dict(data, source_file=f"tiny-{task}.json")
