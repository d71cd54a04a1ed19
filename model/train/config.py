"""TrainConfig: one small JSON file per model (architecture, tokenizer, data, schedule).

Copy one of ``model/train/configs/*.json``, point ``data.corpora`` at your own corpus
directories and change ``out_dir``: that is a new model. ``model`` holds ModelConfig
fields; ``vocab_size`` and the special-token ids are filled in from the trained tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.config import ModelConfig

TASKS = {"translation": "encoder-decoder", "causal-lm": "decoder", "masked-lm": "encoder"}
TOKENIZER_TYPES = ("bpe", "wordpiece")
DECAYS = ("inverse_sqrt", "cosine")


class TrainConfigError(ValueError):
    """A training config that cannot be run; the message names the file and field."""


@dataclass
class TokenizerConfig:
    type: str = "bpe"  # byte-level BPE (translation, LM) or WordPiece (masked LM)
    vocab_size: int = 8000
    min_frequency: int = 2
    lowercase: bool = True  # WordPiece only


@dataclass
class DataConfig:
    corpora: list[str] = field(default_factory=list)  # directories written by `model.train.data prepare`
    max_len: int = 128  # tokens per sequence (translation: per side; LM: block length)
    max_train_records: int | None = None  # use only the first N training records (quick trials, tests)
    max_eval_records: int | None = 1000  # cap on held-out records used for metrics
    # corpus directory -> how many times its training records are used (a small corpus mixed
    # into a large one); corpora not named are used once
    repeat: dict[str, int] = field(default_factory=dict)


@dataclass
class ScheduleConfig:
    max_steps: int = 1000
    batch_tokens: int = 4096  # translation / masked LM: tokens per batch per device (padding included)
    batch_size: int = 16  # causal LM: blocks per batch per device
    lr: float = 1e-3  # peak learning rate, reached after warmup
    warmup_steps: int = 200
    decay: str = "inverse_sqrt"  # after warmup: lr * sqrt(warmup / step) (the paper) or cosine to min_lr
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = 1.0
    label_smoothing: float = 0.1  # translation only
    mask_prob: float = 0.15  # masked LM only: 80% [MASK] / 10% random / 10% unchanged
    eval_every: int = 200  # validation loss every N steps
    checkpoint_every: int = 200  # resumable training state every N steps
    log_every: int = 20  # loss-curve resolution
    average_last: int = 0  # >1: export the mean weights of the last N snapshots (checkpoint averaging)
    snapshot_every: int = 1000  # steps between those snapshots
    seed: int = 1234
    threads: int | None = None  # torch CPU threads (None: torch's default)


@dataclass
class EvalConfig:
    beam_size: int = 4  # translation: beam search on the first beam_sentences test sentences
    beam_sentences: int = 200
    max_new_tokens: int = 96
    heldout: bool = False  # translation: also score the corpora's `heldout` split (whole packages)
    # translation: other checkpoints scored on the same test and held-out records, {name: directory}
    compare_with: dict[str, str] = field(default_factory=dict)


@dataclass
class TrainConfig:
    name: str
    task: str  # translation | causal-lm | masked-lm
    model: dict[str, Any]
    tokenizer: TokenizerConfig
    data: DataConfig
    schedule: ScheduleConfig
    eval: EvalConfig = field(default_factory=EvalConfig)
    out_dir: str = ""  # the servable checkpoint directory (weights/<name>)
    work_dir: str = ""  # resumable state, logs, tokenizer during training (runs/<name>)
    source_file: str = ""  # where the config was read from (for the model card)
    # a servable checkpoint directory to start from (its weights and its tokenizer) instead of
    # a random initialisation; ignored when a saved training state is resumed
    init_from: str = ""

    @property
    def family(self) -> str:
        return TASKS[self.task]

    def validate(self) -> None:
        where = self.source_file or "config"

        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise TrainConfigError(f"{where}: {msg}")

        need(self.task in TASKS, f"field 'task' is {self.task!r}; expected one of {list(TASKS)}")
        need(self.tokenizer.type in TOKENIZER_TYPES, f"field 'tokenizer.type' must be one of {TOKENIZER_TYPES}")
        need(self.tokenizer.vocab_size >= 300, "field 'tokenizer.vocab_size' must be >= 300 (bytes + merges)")
        need(bool(self.data.corpora), "field 'data.corpora' must list at least one corpus directory")
        need(self.schedule.decay in DECAYS, f"field 'schedule.decay' must be one of {DECAYS}")
        need(self.schedule.max_steps >= 1, "field 'schedule.max_steps' must be >= 1")
        need(0.0 < self.schedule.mask_prob < 1.0, "field 'schedule.mask_prob' must be in (0, 1)")
        need(self.data.max_len >= 8, "field 'data.max_len' must be >= 8")
        need(bool(self.out_dir) and bool(self.work_dir), "fields 'out_dir' and 'work_dir' are required")
        family = self.model.get("family", self.family)
        need(family == self.family, f"field 'model.family' is {family!r} but task {self.task!r} needs {self.family!r}")
        need(self.data.max_len + 1 <= self.model.get("max_positions", 512),
             f"field 'data.max_len' ({self.data.max_len}) must be below 'model.max_positions'")
        unknown = set(self.model) & {"vocab_size", "pad_token_id", "bos_token_id", "eos_token_id",
                                     "decoder_start_token_id", "mask_token_id"}
        need(not unknown, f"field(s) {sorted(unknown)} in 'model' come from the tokenizer; remove them")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source_file")
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any], source_file: str = "") -> TrainConfig:
        where = source_file or "config"
        sections = {"tokenizer": TokenizerConfig, "data": DataConfig, "schedule": ScheduleConfig, "eval": EvalConfig}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key in sections:
                if not isinstance(value, dict):
                    raise TrainConfigError(f"{where}: field '{key}' must be an object")
                known = {f.name for f in dataclasses.fields(sections[key])}
                bad = sorted(set(value) - known)
                if bad:
                    raise TrainConfigError(f"{where}: unknown field(s) {bad} in '{key}'; known: {sorted(known)}")
                if key == "schedule" and "betas" in value:
                    value = {**value, "betas": tuple(value["betas"])}
                kwargs[key] = sections[key](**value)
            elif key in ("name", "task", "model", "out_dir", "work_dir", "init_from"):
                kwargs[key] = value
            else:
                raise TrainConfigError(f"{where}: unknown field '{key}'")
        for required in ("name", "task", "model", "tokenizer", "data", "schedule"):
            if required not in kwargs:
                raise TrainConfigError(f"{where}: missing field '{required}'")
        kwargs.setdefault("out_dir", f"weights/{kwargs['name']}")
        kwargs.setdefault("work_dir", f"runs/{kwargs['name']}")
        cfg = cls(source_file=source_file, **kwargs)
        cfg.validate()
        return cfg

    @classmethod
    def load(cls, path: str | Path) -> TrainConfig:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise TrainConfigError(f"{path}: cannot read training config: {exc}") from None
        return cls.from_dict(data, source_file=str(path))

    def model_config(self, vocab_size: int, special: dict[str, int | None]) -> ModelConfig:
        """The ModelConfig for the trained tokenizer's vocabulary and special ids."""
        fields = {"family": self.family, **self.model, "vocab_size": vocab_size, **special}
        return ModelConfig.from_dict(fields)
