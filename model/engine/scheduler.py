"""Which sequences run in the next step, in which slots: admission, chunked prefill, slot
compaction, deadlines and aborts. Host-side bookkeeping only; it never touches a tensor.

Each step's plan holds, in this order of execution:
  1. moves of sequences from high slots into holes left by finished ones (so the occupied
     slots stay 0..used-1 and the runner reads the cache through views, not gathers),
  2. beam reorders decided by the previous step,
  3. one decode row per running slot (the token chosen last step, at its next position),
  4. prompt work: newly admitted and still-prefilling requests, within a token budget.

With a prefix cache (decoder-only), admission also copies the longest cached run of the
prompt's blocks into the new slot (``PrefixLoad``) and starts the prefill after it, and the
prompt blocks each chunk completes are offered to the cache (``PrefixStore``). A request
whose prompt is mostly blocks that a sequence already prefilling is computing waits for them
(other requests are admitted past it), so a burst sharing a system prompt computes it once.
"""

from __future__ import annotations

import heapq
import time
from collections import deque

from model.engine.families import DecoderPrompts, SourcePrompts
from model.engine.plan import BeamReorder, DecodeRow, PrefixLoad, PrefixStore, SlotMove, StepPlan
from model.engine.prefix_cache import PrefixIndex, block_hashes
from model.engine.requests import BeamDecoding, EngineRequest, SampledDecoding, Sequence
from model.tokenization.tokenizer import Tokenizer


class Scheduler:
    def __init__(self, prompts: DecoderPrompts | SourcePrompts, tokenizer: Tokenizer | None, eos_id: int | None,
                 n_slots: int, max_prefill_tokens: int, prefix: PrefixIndex | None = None):
        self.prompts, self.tokenizer, self.eos_id = prompts, tokenizer, eos_id
        self.prefix = prefix if not prompts.encodes_source else None
        self.n_slots, self.max_prefill_tokens = n_slots, max_prefill_tokens
        self.free: list[int] = list(range(n_slots))  # a heap: lowest slots first keeps batches contiguous
        self.waiting: deque[EngineRequest] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []

    # --- bookkeeping -------------------------------------------------------------------
    @property
    def slots_used(self) -> int:
        return self.n_slots - len(self.free)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def add(self, req: EngineRequest) -> None:
        self.waiting.append(req)

    def remove(self, request_id: str) -> EngineRequest | None:
        """Forget a request wherever it is; its slots are free for the next step."""
        for i, req in enumerate(self.waiting):
            if req.request_id == request_id:
                del self.waiting[i]
                return req
        for group in (self.prefilling, self.running):
            for i, seq in enumerate(group):
                if seq.req.request_id == request_id:
                    del group[i]
                    self.release(seq)
                    return seq.req
        return None

    def release(self, seq: Sequence) -> None:
        for s in seq.slots:
            heapq.heappush(self.free, s)
        seq.slots = []

    def retire(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.release(seq)

    def all_requests(self) -> list[EngineRequest]:
        return list(self.waiting) + [s.req for s in self.prefilling + self.running]

    # --- planning ------------------------------------------------------------------------
    def schedule(self, device) -> StepPlan:
        if self.prefix is not None:
            self.prefix.end_step()
        plan = StepPlan(moves=self._compact())
        for seq in self.running:
            if seq.beam_moves and seq.beam_moves[0]:
                src, dst = seq.beam_moves
                plan.reorders.append(BeamReorder([seq.slots[i] for i in src], [seq.slots[i] for i in dst],
                                                 length=seq.next_pos))
            seq.beam_moves = None
        plan.admitted = self._admit(device, plan.prefix_loads)
        self.prefilling += plan.admitted
        plan.decode = [DecodeRow(seq, slot, seq.next_tokens[j], seq.next_pos)
                       for seq in sorted(self.running, key=lambda s: s.slots[0]) for j, slot in enumerate(seq.slots)]
        if self.prefilling:
            self.prompts.plan(plan, self.prefilling, self.max_prefill_tokens)
        if self.prefix is not None:
            plan.prefix_stores = self._stores(plan)
        return plan

    def _admit(self, device, loads: list[PrefixLoad]) -> list[Sequence]:
        admitted: list[Sequence] = []
        budget = self.max_prefill_tokens - sum(s.prompt_left for s in self.prefilling)
        pending = self._pending_blocks()
        deferred: list[EngineRequest] = []
        while self.waiting:
            req = self.waiting[0]
            width = req.params.beam_size
            hashes, hit, waits = self._match(req, pending)
            if waits:  # its next block is being computed by a sequence prefilling: wait for it
                deferred.append(self.waiting.popleft())
                continue
            if width > len(self.free) or not self.prompts.can_admit(req.prompt_ids, not admitted, budget):
                break
            self.waiting.popleft()
            decoding = (BeamDecoding(req, self.tokenizer, self.eos_id) if width > 1 else
                        SampledDecoding(req, self.tokenizer, self.eos_id, self.prompts.context(req.prompt_ids), device))
            slots = [heapq.heappop(self.free) for _ in range(width)]
            seq = Sequence(req, slots, decoding, admitted_at=time.monotonic())
            if self.prefix is not None:
                seq.prefix_hashes, seq.blocks_stored = hashes, hit
                blocks = self.prefix.take(hashes, hit, len(req.prompt_ids))
                if blocks:
                    loads.append(PrefixLoad(slots[0], blocks))
                seq.prefilled = seq.cached_tokens = hit * self.prefix.block
                pending.update(hashes[hit:])
            admitted.append(seq)
            budget -= seq.prompt_left
        self.waiting.extendleft(reversed(deferred))
        return admitted

    def _match(self, req: EngineRequest, pending: set[bytes]) -> tuple[list[bytes], int, bool]:
        """The prompt's block hashes, how many leading blocks the prefix cache holds, and
        whether to wait: when the blocks that follow, up to half the prompt or more, are being
        computed right now by a sequence prefilling (``pending``), waiting a step for them
        saves more than it costs; a block or two is cheaper to compute again."""
        if self.prefix is None:
            return [], 0, False
        hashes = block_hashes(req.prompt_ids, self.prefix.block)
        hit = self.prefix.match(hashes, len(req.prompt_ids))
        usable = min(len(hashes), (len(req.prompt_ids) - 1) // self.prefix.block)  # the last token is computed
        coming = hit
        while coming < usable and hashes[coming] in pending:
            coming += 1
        return hashes, hit, coming > hit and 2 * (coming - hit) * self.prefix.block >= len(req.prompt_ids)

    def _pending_blocks(self) -> set[bytes]:
        """Blocks that sequences still prefilling will store."""
        return {h for seq in self.prefilling for h in seq.prefix_hashes[seq.blocks_stored:]}

    def _stores(self, plan: StepPlan) -> list[PrefixStore]:
        """Offer the prompt blocks this step's chunks complete to the prefix cache."""
        stores: list[PrefixStore] = []
        for chunk in plan.chunks:
            seq = chunk.seq
            done = min((chunk.start + len(chunk.tokens)) // self.prefix.block, len(seq.prefix_hashes))
            if done <= seq.blocks_stored:
                continue
            for i, block in self.prefix.insert(seq.prefix_hashes, seq.blocks_stored, done):
                last = stores[-1] if stores else None
                if last is not None and last.slot == seq.slots[0] and last.first + len(last.blocks) == i:
                    last.blocks.append(block)
                    last.hashes.append(seq.prefix_hashes[i])
                else:
                    stores.append(PrefixStore(seq.slots[0], i, [block], [seq.prefix_hashes[i]]))
            seq.blocks_stored = done
        return stores

    def _compact(self) -> list[SlotMove]:
        """Move the sequences in the highest slots into holes left by finished ones.

        With the occupied slots kept at 0..used-1, a decode batch reads the cache through a
        slice (a view); holes would make every layer of every step gather each sequence's
        whole history. A move copies one history, once.
        """
        if not self.free or self.free[0] >= self.slots_used:
            return []  # no holes (the common case)
        owners = {slot: (seq, j) for seq in self.prefilling + self.running for j, slot in enumerate(seq.slots)}
        moves = []
        while self.free[0] < self.slots_used:
            hole, src = heapq.heappop(self.free), max(owners)
            seq, j = owners.pop(src)
            moves.append(SlotMove(src, hole, seq.history))
            seq.slots[j] = hole
            owners[hole] = (seq, j)
            heapq.heappush(self.free, src)
        return moves

    # --- applying a step's outcome -------------------------------------------------------
    def advance(self, plan: StepPlan) -> None:
        """Positions after the forward passes: decode rows moved one on; prompt work done."""
        for seq in dict.fromkeys(row.seq for row in plan.decode):
            seq.next_pos += 1
        for chunk in plan.chunks:
            chunk.seq.prefilled += len(chunk.tokens)
        for seq in plan.sources:
            seq.prefilled = len(seq.req.prompt_ids)
        for seq in [s for s in self.prefilling if s.prompt_left == 0]:
            seq.next_pos = self.prompts.first_position(seq)
            self.prefilling.remove(seq)
            self.running.append(seq)

    def expired(self, now: float) -> list[EngineRequest]:
        return [r for r in self.all_requests() if r.deadline is not None and now > r.deadline]
