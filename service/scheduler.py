"""Continuous-batching scheduler for one generative model (decoder or encoder-decoder).

Synchronous and single-threaded by design: the engine calls ``step()`` from its worker
thread, tests call it directly. Each step is
  1. admit waiting requests into free KV-cache slots (prompt tokens bounded per step;
     a long decoder prompt is prefilled in chunks over several steps),
  2. one batched decode pass over every running sequence, one prefill pass for the new
     ones (each at its own position),
  3. choose next tokens (one batched sampler call; beam requests step their beams),
  4. retire finished sequences, whose slots are free for the next step.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from model import BeamSearch, EncoderDecoder, SamplingParams, SequenceTracker, Tokenizer
from model.generation import split_sample
from model.host_transfer import to_device
from model.sampling import Sampler, make_generator
from model.transformer import DecoderLM


@dataclass
class EngineRequest:
    request_id: str
    prompt_ids: list[int]  # the prompt (decoder) or the source sentence (encoder-decoder)
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    deadline: float | None = None


@dataclass
class EngineEvent:
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None  # "timeout", "aborted", "internal", "shutdown"
    message: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(eq=False)  # identity semantics: sequences live in lists and dicts
class _Sequence:
    req: EngineRequest
    slots: list[int]
    tracker: SequenceTracker | None = None  # sampling / greedy
    beam: BeamSearch | None = None  # beam search (encoder-decoder)
    generator: torch.Generator | None = None
    prefilled: int = 0  # prompt tokens already written to the cache (decoder)
    next_pos: int = 0  # cache position of the next input token
    next_tokens: list[int] = field(default_factory=list)  # one per slot
    generated: int = 0
    admitted_at: float = 0.0


@dataclass
class StepResult:
    events: list[EngineEvent]
    admitted: list[EngineRequest]
    batch_size: int  # sequences (rows) in this step's forward passes
    prompt_tokens: int  # prompt tokens written this step


class GenerationScheduler:
    def __init__(self, model: DecoderLM | EncoderDecoder, tokenizer: Tokenizer | None, n_slots: int,
                 max_len: int, max_src_len: int = 0, max_prefill_tokens: int = 2048):
        self.model, self.tokenizer = model, tokenizer
        self.encdec = isinstance(model, EncoderDecoder)
        self.n_slots, self.max_len, self.max_src_len = n_slots, max_len, max_src_len
        self.max_prefill_tokens = max_prefill_tokens
        self.cache = model.new_cache(n_slots, max_len, max_src_len if self.encdec else 0)
        self.seen = torch.zeros(n_slots, model.cfg.vocab_size, dtype=torch.bool, device=model.device)
        self.sampler = Sampler()
        self.free: list[int] = list(range(n_slots))  # a heap: lowest slots first keeps batches contiguous
        self.waiting: deque[EngineRequest] = deque()
        self.prefilling: list[_Sequence] = []
        self.running: list[_Sequence] = []

    # --- bookkeeping -------------------------------------------------------------------
    @property
    def slots_used(self) -> int:
        return self.n_slots - len(self.free)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def add(self, req: EngineRequest) -> None:
        self.waiting.append(req)

    def _release(self, seq: _Sequence) -> None:
        for s in seq.slots:
            heapq.heappush(self.free, s)
        seq.slots = []

    def _remove(self, request_id: str) -> EngineRequest | None:
        for i, req in enumerate(self.waiting):
            if req.request_id == request_id:
                del self.waiting[i]
                return req
        for group in (self.prefilling, self.running):
            for i, seq in enumerate(group):
                if seq.req.request_id == request_id:
                    self._release(seq)
                    del group[i]
                    return seq.req
        return None

    def abort(self, request_id: str) -> bool:
        """Forget a request (client gone); its slots are free for the next step."""
        return self._remove(request_id) is not None

    def expire(self, now: float) -> list[EngineEvent]:
        """Fail every request past its deadline."""
        late = [r for r in self.waiting if r.deadline is not None and now > r.deadline]
        late += [s.req for s in self.prefilling + self.running if s.req.deadline is not None and now > s.req.deadline]
        events = []
        for req in late:
            self._remove(req.request_id)
            events.append(EngineEvent(req.request_id, error="timeout", message="request timed out",
                                      prompt_tokens=len(req.prompt_ids)))
        return events

    def fail_all(self, error: str, message: str) -> list[EngineEvent]:
        reqs = list(self.waiting) + [s.req for s in self.prefilling + self.running]
        for req in reqs:
            self._remove(req.request_id)
        return [EngineEvent(r.request_id, error=error, message=message) for r in reqs]

    # --- admission -------------------------------------------------------------------------
    def _admit(self) -> list[_Sequence]:
        admitted, budget = [], self.max_prefill_tokens - sum(len(s.req.prompt_ids) - s.prefilled
                                                              for s in self.prefilling)
        while self.waiting:
            req = self.waiting[0]
            width = req.params.beam_size if self.encdec else 1
            if width > len(self.free):
                break
            if self.encdec and admitted and len(req.prompt_ids) > budget:
                break  # sources are encoded whole; keep the step bounded
            if not self.encdec and budget <= 0:
                break
            self.waiting.popleft()
            seq = _Sequence(req, [heapq.heappop(self.free) for _ in range(width)], admitted_at=time.monotonic())
            if req.params.beam_size > 1:
                seq.beam = BeamSearch(1, width, req.params.length_penalty, req.params.max_new_tokens,
                                      None if req.params.ignore_eos else self.model.cfg.eos_token_id)
            else:
                context = () if self.encdec else req.prompt_ids
                seq.tracker = SequenceTracker(req.params, self.tokenizer, self.model.cfg.eos_token_id, context)
                seq.generator = make_generator(req.params.seed, self.model.device)
                slot = seq.slots[0]
                self.seen[slot] = False
                if not self.encdec:
                    self.seen[slot, torch.as_tensor(req.prompt_ids, device=self.model.device)] = True
            budget -= len(req.prompt_ids)
            admitted.append(seq)
        return admitted

    # --- one step ------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> StepResult:
        self._compact()  # holes from last step's retirements, aborts and timeouts
        admitted = self._admit()
        self.prefilling += admitted
        decode_rows = [(seq, j) for seq in sorted(self.running, key=lambda s: s.slots[0])
                       for j in range(len(seq.slots))]
        logits_parts, row_owner = [], []  # row_owner[i]: the sequence that logits row i belongs to
        if decode_rows:
            tokens = to_device([seq.next_tokens[j] for seq, j in decode_rows], torch.long, self.model.device)
            logits_parts.append(self.model.decode_step(
                self.cache, tokens, [seq.slots[j] for seq, j in decode_rows], [seq.next_pos for seq, _ in decode_rows]))
            row_owner += [seq for seq, _ in decode_rows]
            for seq in dict.fromkeys(seq for seq, _ in decode_rows):
                seq.next_pos += 1  # the fed tokens now sit in the cache
        prompt_tokens = prefill_rows = 0
        if self.prefilling:
            logits, owners, prompt_tokens, prefill_rows = self._prefill()
            if logits is not None:
                logits_parts.append(logits)
                row_owner += owners
        events = self._choose(torch.cat(logits_parts) if logits_parts else None, row_owner)
        return StepResult(events, [s.req for s in admitted], len(decode_rows) + prefill_rows, prompt_tokens)

    def _prefill(self) -> tuple[torch.Tensor | None, list[_Sequence], int, int]:
        """Write prompt tokens of prefilling sequences; return the logits rows of those whose
        prompt is now complete (they join the running set)."""
        if self.encdec:
            seqs, self.prefilling = self.prefilling, []
            slots = [s for seq in seqs for s in seq.slots]
            logits = self.model.prefill(self.cache, [s.req.prompt_ids for s in seqs], slots,
                                        group_sizes=[len(s.slots) for s in seqs])
            owners = [seq for seq in seqs for _ in seq.slots]
            for seq in seqs:
                seq.next_pos = 1
            self.running += seqs
            return logits, owners, sum(len(s.req.prompt_ids) for s in seqs), len(slots)
        budget, chunks = self.max_prefill_tokens, []
        for seq in self.prefilling:
            take = min(len(seq.req.prompt_ids) - seq.prefilled, max(budget, 0))
            if take <= 0 and chunks:
                break
            take = max(take, 1)
            chunks.append((seq, seq.req.prompt_ids[seq.prefilled: seq.prefilled + take]))
            budget -= take
        logits = self.model.prefill(self.cache, [c for _, c in chunks], [seq.slots[0] for seq, _ in chunks],
                                    starts=[seq.prefilled for seq, _ in chunks])
        done_rows, owners = [], []
        for row, (seq, chunk) in enumerate(chunks):
            seq.prefilled += len(chunk)
            if seq.prefilled == len(seq.req.prompt_ids):
                seq.next_pos = seq.prefilled
                done_rows.append(row)
                owners.append(seq)
                self.prefilling.remove(seq)
                self.running.append(seq)
        written = sum(len(c) for _, c in chunks)
        if not done_rows:
            return None, [], written, len(chunks)
        return logits[to_device(done_rows, torch.long, logits.device)], owners, written, len(chunks)

    def _choose(self, logits: torch.Tensor | None, owners: list[_Sequence]) -> list[EngineEvent]:
        if logits is None:
            return []
        events: list[EngineEvent] = []
        sample_rows = [i for i, seq in enumerate(owners) if seq.tracker is not None]
        if sample_rows:
            seqs = [owners[i] for i in sample_rows]
            params = [s.req.params for s in seqs]
            rows_t = to_device(sample_rows, torch.long, logits.device)
            slots_t = to_device([s.slots[0] for s in seqs], torch.long, logits.device)
            seen = self.seen[slots_t] if any(p.repetition_penalty != 1.0 for p in params) else None
            out = self.sampler(logits[rows_t], params, [s.generator for s in seqs], seen)
            self.seen[slots_t, out.tokens] = True
            for seq, (tok, lp, top) in zip(seqs, split_sample(out, params)):
                event = seq.tracker.add(tok, lp, top)
                seq.generated += 1
                seq.next_tokens = [tok]
                events.append(EngineEvent(
                    seq.req.request_id, event.text, [tok], [lp] if lp is not None else [], [top] if top else [],
                    event.finish_reason, prompt_tokens=len(seq.req.prompt_ids), completion_tokens=seq.generated))
                if event.finish_reason is not None:
                    self._retire(seq)
        beam_seqs = list(dict.fromkeys(seq for seq in owners if seq.beam is not None))
        for seq in beam_seqs:
            rows = [i for i, s in enumerate(owners) if s is seq]
            logp = logits[rows[0]: rows[-1] + 1].float().log_softmax(dim=-1)  # (k, V): a beam's rows are adjacent
            events += self._beam_step(seq, logp)
        return events

    def _beam_step(self, seq: _Sequence, logp: torch.Tensor) -> list[EngineEvent]:
        step = seq.beam.step(logp)
        seq.generated += 1
        if not seq.beam.live:
            score, tokens, reason = seq.beam.best(0)
            text = self.tokenizer.decode(tokens) if self.tokenizer is not None else ""
            self._retire(seq)
            return [EngineEvent(seq.req.request_id, text, tokens, finish_reason=reason,
                                prompt_tokens=len(seq.req.prompt_ids), completion_tokens=len(tokens))]
        if step.copy_src:
            self.cache.copy_slots([seq.slots[i] for i in step.copy_src], [seq.slots[i] for i in step.copy_dst],
                                  length=seq.next_pos)
        seq.next_tokens = step.tokens
        return []

    def _compact(self) -> None:
        """Move the sequences in the highest slots into holes left by finished ones.

        With the occupied slots kept at 0..used-1, a decode batch reads the cache through a
        slice (a view); slots with holes between them would make every layer of every step
        gather (copy) each sequence's whole history. A move copies one history, once.
        """
        if not self.free or self.free[0] >= self.slots_used:
            return  # no holes (the common case)
        owners = {slot: (seq, j) for seq in self.prefilling + self.running for j, slot in enumerate(seq.slots)}
        while self.free[0] < self.slots_used:
            hole, src = heapq.heappop(self.free), max(owners)
            seq, j = owners.pop(src)
            self.cache.move_slot(src, hole, max(seq.next_pos, seq.prefilled))
            self.seen[hole] = self.seen[src]
            seq.slots[j] = hole
            owners[hole] = (seq, j)
            heapq.heappush(self.free, src)

    def _retire(self, seq: _Sequence) -> None:
        self._release(seq)
        if seq in self.running:
            self.running.remove(seq)

