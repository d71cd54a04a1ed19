"""Executes a ``StepPlan`` on the model: row moves, block copies, the forward passes (decode
rows through the ``DecodeStep`` it holds, prompts through the model's prefill), and the choice
of next tokens. It owns every tensor of the engine: the paged KV cache (whose host half, the
block tables, the scheduler drives) and, per row, the set of tokens already in the sequence
(repetition penalty) and how often each token has been generated (presence and frequency
penalties).

The output is on the host, one entry per sequence: a ``Sample`` for sampled sequences (all
drawn in one batched sampler call) or the (beam_size, V) log-probabilities of a beam search.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from model.decode.step import DecodeStep
from model.engine.block_pool import BlockPool
from model.engine.families import DecoderPrompts, SourcePrompts
from model.engine.generation import split_sample
from model.engine.grammar import allowed_tokens
from model.engine.plan import StepPlan
from model.engine.requests import BeamDecoding, Sample, Sequence
from model.engine.sampling import Sampler
from model.engine.speculative import verify
from model.nn.host_transfer import to_device
from model.nn.kv_cache import blocks_for
from model.nn.transformer import DecoderLM, EncoderDecoder


@dataclass
class StepOutput:
    samples: dict[Sequence, Sample] = field(default_factory=dict)
    beam_logprobs: dict[Sequence, Tensor] = field(default_factory=dict)  # (beam_size, V)
    runs: dict[Sequence, list[Sample]] = field(default_factory=dict)  # drafting sequences: kept drafts + one


class ModelRunner:
    def __init__(self, model: DecoderLM | EncoderDecoder, prompts: DecoderPrompts | SourcePrompts, n_slots: int,
                 max_len: int, step: DecodeStep, max_src_len: int = 0, n_blocks: int | None = None):
        self.model, self.prompts, self.step = model, prompts, step
        self.device = model.device
        # the scheduler's pool (prefix-cache names, eviction) keeps the cache's block tables
        pool = BlockPool(n_blocks if n_blocks is not None else 1 + n_slots * blocks_for(max_len))
        self.cache = model.new_cache(n_slots, max_len, max_src_len if prompts.encodes_source else 0,
                                     dtype=step.kv_dtype, pool=pool)
        self.seen = torch.zeros(n_slots, model.cfg.vocab_size, dtype=torch.bool, device=self.device)
        self.counts = torch.zeros(n_slots, model.cfg.vocab_size, dtype=torch.float32, device=self.device)
        self.sampler = Sampler()

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepOutput:
        self._apply_moves(plan)
        self.cache.zero_fresh()  # blocks the plan allocated, zeroed before anything (a copy on write) fills them
        self.cache.copy_blocks(plan.copies)
        logits, owners = self._forward(plan)
        return self._choose(logits, owners, plan.drafts) if logits is not None else StepOutput()

    def _apply_moves(self, plan: StepPlan) -> None:
        for move in plan.moves:
            self.cache.move_cross(move.src, move.dst)
            self.seen[move.dst] = self.seen[move.src]
            self.counts[move.dst] = self.counts[move.src]
        for seq in plan.admitted:
            if not isinstance(seq.decoding, BeamDecoding):
                slot = seq.slots[0]
                self.seen[slot] = False
                self.counts[slot] = 0.0
                context = self.prompts.context(seq.req.prompt_ids) + seq.output_ids  # a resumed one's output too
                if context:
                    self.seen[slot, torch.as_tensor(context, device=self.device)] = True
                if seq.output_ids:
                    ids = torch.as_tensor(seq.output_ids, device=self.device)
                    self.counts[slot].index_add_(0, ids, torch.ones(len(seq.output_ids), device=self.device))

    def _forward(self, plan: StepPlan) -> tuple[Tensor | None, list[Sequence]]:
        """One decode pass and one prompt pass; logits rows (R, V) and the owner of each row."""
        parts, owners = [], []
        if plan.decode:
            rows = plan.decode
            tokens = to_device([r.token for r in rows], torch.long, self.device)
            parts.append(self.step(self.cache, tokens, [r.slot for r in rows], [r.position for r in rows]))
            owners += [r.seq for r in rows]
        logits, prompt_owners = self.prompts.run(self.cache, plan)
        if logits is not None:
            parts.append(logits)
            owners += prompt_owners
        if not parts:
            return None, []
        return (torch.cat(parts) if len(parts) > 1 else parts[0]), owners

    def _choose(self, logits: Tensor, owners: list[Sequence], drafts: dict[Sequence, list[int]]) -> StepOutput:
        out = StepOutput()
        if drafts:
            out.runs = self._verify(logits, owners, drafts)
        sampled = [i for i, seq in enumerate(owners)
                   if not isinstance(seq.decoding, BeamDecoding) and seq not in drafts]
        if sampled:
            seqs = [owners[i] for i in sampled]
            params = [s.req.params for s in seqs]
            slots = to_device([s.slots[0] for s in seqs], torch.long, self.device)
            seen = self.seen[slots] if any(p.repetition_penalty != 1.0 for p in params) else None
            counts = self.counts[slots] if any(p.presence_penalty or p.frequency_penalty for p in params) else None
            rows = logits if len(sampled) == len(owners) else logits[to_device(sampled, torch.long, self.device)]
            sample = self.sampler(rows, params, [s.decoding.generator for s in seqs], seen, counts,
                                  self._allowed(seqs, rows.size(-1)))
            # Only rows with a penalty read their history (a row without one is left as it is by
            # the penalty's arithmetic whatever it holds), so only theirs is kept up to date:
            # two indexed writes per step were ~4% of a served single stream's engine thread.
            tracked = [i for i, p in enumerate(params)
                       if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty]
            if tracked:
                which = slice(None) if len(tracked) == len(params) else to_device(tracked, torch.long, self.device)
                self.seen[slots[which], sample.tokens[which]] = True
                self.counts[slots[which], sample.tokens[which]] += 1.0  # one token per row: no duplicate indices
            out.samples = dict(zip(seqs, split_sample(sample, params)))
        beams = list(dict.fromkeys(s for s in owners if isinstance(s.decoding, BeamDecoding)))  # never constrained
        if beams:  # one log-softmax over every beam row (per row, as alone); a search's rows are adjacent
            rows = [r for seq in beams for first in (owners.index(seq),) for r in range(first, first + len(seq.slots))]
            picked = logits if rows == list(range(len(owners))) else logits[to_device(rows, torch.long, self.device)]
            logprobs, start = picked.float().log_softmax(dim=-1), 0
            for seq in beams:
                out.beam_logprobs[seq] = logprobs[start: start + len(seq.slots)]
                start += len(seq.slots)
        return out

    def _verify(self, logits: Tensor, owners: list[Sequence], drafts: dict[Sequence, list[int]]
                ) -> dict[Sequence, list[Sample]]:
        """Speculative decoding: each drafting sequence's kept drafts and the token after them
        (model.engine.speculative), with their logprobs where asked."""
        seqs = list(drafts)
        firsts = [owners.index(seq) for seq in seqs]  # a sequence's rows are adjacent, fed token first
        index = to_device([f + j for f, seq in zip(firsts, seqs) for j in range(len(drafts[seq]) + 1)],
                          torch.long, self.device)
        rows = logits[index]
        params = [seq.req.params for seq in seqs]
        tokens = verify(rows, [drafts[seq] for seq in seqs], params, [seq.decoding.generator for seq in seqs])
        # A drafting sequence has no repetition, presence or frequency penalty (drafts_allowed),
        # so its rows of ``seen`` / ``counts`` are never read: nothing to record here.
        runs, at = {}, 0
        for seq, p, toks in zip(seqs, params, tokens):
            lps, tops = [None] * len(toks), [None] * len(toks)
            if p.logprobs is not None:
                ids = torch.as_tensor(toks, device=self.device)
                logp = rows[at: at + len(toks)].float().log_softmax(dim=-1)
                lps = logp.gather(1, ids[:, None]).squeeze(1).tolist()
                if p.logprobs:
                    top_lp, top_ids = logp.topk(p.logprobs, dim=-1)
                    tops = [dict(zip(i, v)) for i, v in zip(top_ids.tolist(), top_lp.tolist())]
            runs[seq] = list(zip(toks, lps, tops))
            at += len(drafts[seq]) + 1
        return runs

    def _allowed(self, seqs: list[Sequence], vocab: int) -> Tensor | None:
        """(B, V) bool of the tokens each row may take, or None when no row follows a grammar.
        Free rows get all-ones bits; the backend fills every constrained row in one call."""
        constrained = [(s.decoding.matcher, i) for i, s in enumerate(seqs) if s.decoding.matcher is not None]
        if not constrained:
            return None
        backend = constrained[0][0].backend
        bitmask = torch.full((len(seqs), backend.words), -1, dtype=torch.int32)  # (B, words), on the host
        backend.fill(constrained, bitmask)
        return allowed_tokens(bitmask.to(self.device, non_blocking=True), vocab)
