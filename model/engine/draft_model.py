"""Speculative decoding with a draft model: a small model of the target's vocabulary proposes
the next tokens by greedy decoding, and the target verifies them as it verifies prompt-lookup
drafts (``model.engine.speculative.verify``, unchanged: greedy output equals decoding without
drafts, sampling keeps the target's distribution; a greedy draft is the deterministic draft
that verify's sampling rule assumes).

The draft keeps its own paged KV cache, one row per drafting sequence, run through the decode
step ``model.decode.prepare`` chose for it (the native C++ step where it applies). Per step,
for every sequence that drafts, batched: one call catches each row up on the tokens it has not
seen (the prompt at first, the target's own token after each verified run, anything decoded
while drafting paused: a prefill for rows more than one token behind, a decode step for the
rest), and its argmax is the first draft; then k - 1 decode steps feed each draft and take the
next. After verification a row holds the tokens it was fed up to the first one the target did
not keep: positions past it are simply written over next time. A row's blocks go back to the
draft's pool when its sequence finishes, is aborted or preempted (``ModelDrafter.release``).

Where the pool of the draft runs short, the sequence does not draft this step (drafts are a
bet: never worth taking blocks from anyone). How many drafts: as for n-grams
(``Drafter.best``), each draft also costing a draft step, estimated as the share of the
target's per-token weights the draft reads (``step_weights``); while even one draft does not
pay at the sequence's recent rate of kept drafts, it waits as after a refused run.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence as Seq

import torch

from model.config import ModelConfig
from model.engine.sampling import greedy_tokens
from model.engine.speculative import ROW_COST, Drafter, SpeculativeConfig
from model.nn.host_transfer import to_device
from model.nn.transformer import DecoderLM


class VocabularyMismatchError(ValueError):
    """A draft model whose token ids do not mean what the target's mean."""


def step_weights(cfg: ModelConfig) -> int:
    """Weights one decode step reads per token: the decoder layers' projections and the output head."""
    attn = cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.kv_heads)
    mlp = cfg.d_model * cfg.d_ff * (3 if cfg.mlp == "gated" else 2)
    return cfg.n_decoder_layers * (attn + mlp) + cfg.vocab_size * cfg.d_model


def check_vocabulary(target_name: str, target, draft_name: str, draft) -> None:
    """Refuse a draft whose vocabulary is not the target's: the same logits width and, where
    both have a tokenizer, the same token at every id. ``target`` / ``draft``: checkpoints
    (``config``, ``tokenizer``). The error names both models and the first difference."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise VocabularyMismatchError(f"draft model '{draft_name}' has {dv} token ids and target '{target_name}' "
                                      f"{tv}: a draft must share its target's vocabulary")
    tt, dt = target.tokenizer, draft.tokenizer
    if tt is None or dt is None:
        return
    for i in range(min(tt.vocab_size, dt.vocab_size)):
        a, b = tt.id_to_token(i), dt.id_to_token(i)
        if a != b:
            raise VocabularyMismatchError(f"draft model '{draft_name}' and target '{target_name}' differ at token id "
                                          f"{i}: {b!r} against {a!r}; a draft must share its target's vocabulary")
    if tt.vocab_size != dt.vocab_size:
        raise VocabularyMismatchError(f"draft model '{draft_name}''s tokenizer has {dt.vocab_size} tokens and "
                                      f"target '{target_name}''s {tt.vocab_size}: a draft must share its target's "
                                      "vocabulary")


class ModelDrafter(Drafter):
    """One sequence's row in the draft's cache: the tokens it has seen, the drafts it was fed."""

    batched = True  # proposes in ``DraftModel.propose``, for every drafting sequence at once

    def __init__(self, draft: DraftModel, tokens: Seq[int], config: SpeculativeConfig):
        super().__init__(config)
        self.draft = draft
        self.cost = ROW_COST + draft.cost
        self.slot: int | None = None  # its row in the draft's cache, while it has one
        self.seen = 0  # leading tokens whose K/V the row holds
        self.fed: list[int] = []  # drafts written after them at the last proposal
        self.extend(tokens)

    def extend(self, tokens: Seq[int]) -> None:
        """The sequence moved on: the row's drafts that match the new tokens stay seen."""
        new = [int(t) for t in tokens]
        if self.fed and self.seen == len(self.tokens):
            same = 0
            while same < min(len(self.fed), len(new)) and self.fed[same] == new[same]:
                same += 1
            self.seen += same
        self.fed = []
        self.tokens += new

    def wants(self, limit: int) -> int:
        """Drafts this step: none while waiting, else the number that pays, at most ``limit``."""
        if limit <= 0 or self.waiting():
            return 0
        return min(limit, self.length())

    def pays(self) -> bool:
        return self.best()[1] > 1.0

    def release(self) -> None:
        self.draft.release(self)


class DraftModel:
    """A draft model, its decode step and its paged cache: ``n_slots`` rows (one per sequence
    in flight), ``n_blocks`` blocks (default: every row at ``max_len``). ``cost``: a draft
    step's time relative to a target step (default: the draft's share of ``target_cfg``'s
    per-token weights)."""

    def __init__(self, model: DecoderLM, step, n_slots: int, max_len: int, n_blocks: int | None = None,
                 target_cfg: ModelConfig | None = None, cost: float | None = None, name: str = "draft"):
        if not isinstance(model, DecoderLM):
            raise ValueError(f"a draft model must be decoder-only, got {type(model).__name__}")
        self.model, self.step, self.name = model, step, name
        self.prefill = step.prefill if getattr(step, "prefills", False) else model.prefill
        self.cache = model.new_cache(n_slots, max_len, dtype=step.kv_dtype, n_blocks=n_blocks)
        self.free = list(range(n_slots))  # a heap
        if cost is None:
            cost = step_weights(model.cfg) / step_weights(target_cfg) if target_cfg is not None else 0.0
        self.cost = cost

    def drafter(self, tokens: Seq[int], config: SpeculativeConfig) -> ModelDrafter:
        return ModelDrafter(self, tokens, config)

    def release(self, d: ModelDrafter) -> None:
        if d.slot is not None:
            self.cache.release(d.slot)
            heapq.heappush(self.free, d.slot)
        d.slot, d.seen, d.fed = None, 0, []

    @property
    def rows_used(self) -> int:
        return self.cache.n_slots - len(self.free)

    @torch.inference_mode()
    def propose(self, limits: dict) -> dict:
        """``limits``: sequence -> drafts wanted (each sequence's drafter a ``ModelDrafter``);
        returns sequence -> its drafts (at most that many; sequences without any left out)."""
        rows = []  # (sequence, drafter, drafts wanted)
        for seq, limit in limits.items():
            d = seq.drafter
            if d.slot is None:
                if not self.free:
                    continue
                d.slot = heapq.heappop(self.free)
            # the row holds the sequence's tokens (the last one is the target's fed token) and
            # all drafts but the last
            self.cache.ensure(d.slot, min(len(d.tokens) + limit - 1, self.cache.max_len))
            room = min(self.cache.held(d.slot), self.cache.max_len) - len(d.tokens) + 1
            if room < 1:  # the pool is short: this sequence decodes plainly, its row waits
                continue
            rows.append((seq, d, min(limit, room)))
        if not rows:
            return {}
        drafts = {seq: [] for seq, _, _ in rows}
        # catch up: each row is fed what it has not seen; its logits give the first draft
        behind = [(seq, d) for seq, d, _ in rows if len(d.tokens) - d.seen > 1]
        level = [(seq, d) for seq, d, _ in rows if len(d.tokens) - d.seen == 1]
        for group, logits in ((behind, self._catch_up(behind)), (level, self._decode(level))):
            if group:
                for (seq, d), tok in zip(group, greedy_tokens(logits).tolist()):
                    drafts[seq].append(tok)
                    d.seen = len(d.tokens)
        # then one decode step for every row that wants another draft, feeding its last one
        for _ in range(1, max(n for _, _, n in rows)):
            more = [(seq, d) for seq, d, n in rows if len(drafts[seq]) < n]
            feed = [drafts[seq][-1] for seq, _ in more]
            positions = [len(d.tokens) - 1 + len(drafts[seq]) for seq, d in more]
            logits = self.step(self.cache, to_device(feed, torch.long, self.cache.device),
                               [d.slot for _, d in more], positions)
            for (seq, _), tok in zip(more, greedy_tokens(logits).tolist()):
                drafts[seq].append(tok)
        for seq, d, _ in rows:
            d.fed = drafts[seq][:-1]
        return drafts

    def _catch_up(self, rows: list) -> torch.Tensor | None:
        if not rows:
            return None
        return self.prefill(self.cache, [d.tokens[d.seen:] for _, d in rows], [d.slot for _, d in rows],
                            starts=[d.seen for _, d in rows])

    def _decode(self, rows: list) -> torch.Tensor | None:
        if not rows:
            return None
        tokens = to_device([d.tokens[-1] for _, d in rows], torch.long, self.cache.device)
        return self.step(self.cache, tokens, [d.slot for _, d in rows], [len(d.tokens) - 1 for _, d in rows])
