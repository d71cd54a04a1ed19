"""The three training objectives, each with its tokenizer, data and loss.

- translation: teacher forcing (decoder input ``<s> y``, labels ``y </s>``) with
  label-smoothed cross-entropy;
- causal-lm: next-token cross-entropy over packed ``<s> doc </s>`` blocks;
- masked-lm: BERT masking (15%: 80% [MASK] / 10% random / 10% same), loss on chosen tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.tokenization.tokenizer import BPE_SPECIALS, WORDPIECE_SPECIALS, Tokenizer, train_bpe, train_wordpiece
from model.train.batches import (
    IGNORE,
    BatchOrder,
    encode_documents,
    encode_pairs,
    encode_sentences,
    fixed_batches,
    lm_batch,
    lm_blocks,
    mlm_batch,
    token_batches,
    translation_batch,
)
from model.train.config import TrainConfig

VALID_BATCHES = 12  # validation-loss batches per periodic evaluation


def cross_entropy(logits: Tensor, labels: Tensor, smoothing: float = 0.0) -> Tensor:
    """Mean over labelled tokens; logits (B, T, V), labels (B, T) with IGNORE to skip."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1),
                           ignore_index=IGNORE, label_smoothing=smoothing)


def step_generator(seed: int, step: int, rank: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step * 1_009 + rank) % (2**63))


class Objective:
    """What the training loop needs from a task."""

    special: dict[str, int | None]

    def __init__(self, cfg: TrainConfig, tok: Tokenizer, train: Sequence[dict], valid: Sequence[dict]):
        self.cfg, self.tok = cfg, tok

    @staticmethod
    def tokenizer_texts(records: Sequence[dict]) -> list[str]:
        return [r["text"] for r in records]

    def batch(self, index: int, gen: torch.Generator) -> dict[str, Tensor]:
        raise NotImplementedError

    def valid_batches(self) -> list[dict[str, Tensor]]:
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: dict[str, Tensor], training: bool = True) -> tuple[Tensor, int]:
        """(mean loss over predicted tokens, number of input tokens processed: for tokens/s)."""
        raise NotImplementedError


class TranslationObjective(Objective):
    def __init__(self, cfg: TrainConfig, tok: Tokenizer, train: Sequence[dict], valid: Sequence[dict]):
        super().__init__(cfg, tok, train, valid)
        ids = {t: tok.token_to_id(t) for t in BPE_SPECIALS}
        self.pad, self.bos, self.eos = ids["<pad>"], ids["<s>"], ids["</s>"]
        self.special = {"pad_token_id": self.pad, "bos_token_id": self.bos, "eos_token_id": self.eos,
                        "decoder_start_token_id": self.bos}
        self.train = encode_pairs(tok, train, cfg.data.max_len)
        self.valid = encode_pairs(tok, valid, cfg.data.max_len)
        lengths = self.train.lengths()
        self.order = BatchOrder(lambda g: token_batches(lengths, cfg.schedule.batch_tokens, g), cfg.schedule.seed)

    @staticmethod
    def tokenizer_texts(records: Sequence[dict]) -> list[str]:
        return [x for r in records for x in (r["source"], r["target"])]

    @staticmethod
    def train_tokenizer(cfg: TrainConfig, texts: list[str]) -> Tokenizer:
        return train_bpe(texts, cfg.tokenizer.vocab_size, cfg.tokenizer.min_frequency, template="$A </s>")

    def batch(self, index: int, gen: torch.Generator) -> dict[str, Tensor]:
        return translation_batch(self.train, self.order.batch(index)[1], self.pad, self.bos, self.eos)

    def valid_batches(self) -> list[dict[str, Tensor]]:
        batches = token_batches(self.valid.lengths(), self.cfg.schedule.batch_tokens, torch.Generator().manual_seed(0))
        return [translation_batch(self.valid, b, self.pad, self.bos, self.eos) for b in batches[:VALID_BATCHES]]

    def loss(self, model: nn.Module, batch: dict[str, Tensor], training: bool = True) -> tuple[Tensor, int]:
        logits = model(batch["src"], batch["dec_in"], batch["src_mask"])  # (B, T, V)
        smoothing = self.cfg.schedule.label_smoothing if training else 0.0
        n_tokens = int(batch["src_mask"].sum()) + int((batch["labels"] != IGNORE).sum())
        return cross_entropy(logits, batch["labels"], smoothing), n_tokens


class CausalLMObjective(Objective):
    def __init__(self, cfg: TrainConfig, tok: Tokenizer, train: Sequence[dict], valid: Sequence[dict]):
        super().__init__(cfg, tok, train, valid)
        ids = {t: tok.token_to_id(t) for t in BPE_SPECIALS}
        self.bos, self.eos = ids["<s>"], ids["</s>"]
        self.special = {"pad_token_id": ids["<pad>"], "bos_token_id": self.bos, "eos_token_id": self.eos}
        self.train_stream = encode_documents(tok, self.tokenizer_texts(train), self.bos, self.eos)
        self.blocks = lm_blocks(self.train_stream, cfg.data.max_len)  # (N, max_len + 1)
        self.valid_blocks = lm_blocks(encode_documents(tok, self.tokenizer_texts(valid), self.bos, self.eos),
                                      cfg.data.max_len)
        n, bs = len(self.blocks), cfg.schedule.batch_size
        self.order = BatchOrder(lambda g: fixed_batches(n, bs, g), cfg.schedule.seed)

    @staticmethod
    def train_tokenizer(cfg: TrainConfig, texts: list[str]) -> Tokenizer:
        return train_bpe(texts, cfg.tokenizer.vocab_size, cfg.tokenizer.min_frequency, template="<s> $A")

    def batch(self, index: int, gen: torch.Generator) -> dict[str, Tensor]:
        return lm_batch(self.blocks, self.order.batch(index)[1])

    def valid_batches(self) -> list[dict[str, Tensor]]:
        bs = self.cfg.schedule.batch_size
        return [lm_batch(self.valid_blocks, range(i, min(i + bs, len(self.valid_blocks))))
                for i in range(0, len(self.valid_blocks), bs)][:VALID_BATCHES]

    def loss(self, model: nn.Module, batch: dict[str, Tensor], training: bool = True) -> tuple[Tensor, int]:
        logits = model(batch["ids"])  # (B, T, V)
        return cross_entropy(logits, batch["labels"]), batch["labels"].numel()


class MaskedLMObjective(Objective):
    def __init__(self, cfg: TrainConfig, tok: Tokenizer, train: Sequence[dict], valid: Sequence[dict]):
        super().__init__(cfg, tok, train, valid)
        ids = {t: tok.token_to_id(t) for t in WORDPIECE_SPECIALS}
        self.pad, self.mask = ids["[PAD]"], ids["[MASK]"]
        self.special_ids = sorted(ids.values())
        self.special = {"pad_token_id": self.pad, "bos_token_id": None, "eos_token_id": None,
                        "mask_token_id": self.mask}
        self.train = encode_sentences(tok, self.tokenizer_texts(train), cfg.data.max_len)
        self.valid = encode_sentences(tok, self.tokenizer_texts(valid), cfg.data.max_len)
        lengths = [len(s) for s in self.train]
        self.order = BatchOrder(lambda g: token_batches(lengths, cfg.schedule.batch_tokens, g), cfg.schedule.seed)

    @staticmethod
    def train_tokenizer(cfg: TrainConfig, texts: list[str]) -> Tokenizer:
        return train_wordpiece(texts, cfg.tokenizer.vocab_size, cfg.tokenizer.min_frequency,
                               lowercase=cfg.tokenizer.lowercase)

    def _batch(self, seqs: list[list[int]], idx: Sequence[int], gen: torch.Generator) -> dict[str, Tensor]:
        return mlm_batch(seqs, idx, self.pad, self.special_ids, self.mask, self.tok.vocab_size,
                         self.cfg.schedule.mask_prob, gen)

    def batch(self, index: int, gen: torch.Generator) -> dict[str, Tensor]:
        return self._batch(self.train, self.order.batch(index)[1], gen)

    def valid_batches(self) -> list[dict[str, Tensor]]:
        gen = torch.Generator().manual_seed(0)
        batches = token_batches([len(s) for s in self.valid], self.cfg.schedule.batch_tokens, gen)
        return [self._batch(self.valid, b, gen) for b in batches[:VALID_BATCHES]]

    def loss(self, model: nn.Module, batch: dict[str, Tensor], training: bool = True) -> tuple[Tensor, int]:
        logits = model(batch["ids"], batch["attention_mask"])  # (B, T, V)
        return cross_entropy(logits, batch["labels"]), int(batch["attention_mask"].sum())


OBJECTIVES: dict[str, type[Objective]] = {
    "translation": TranslationObjective,
    "causal-lm": CausalLMObjective,
    "masked-lm": MaskedLMObjective,
}


def batch_to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
