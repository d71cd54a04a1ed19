"""Which sequences run in the next step, in which rows, over which blocks: admission by free
blocks, chunked prefill, preemption, row compaction, deadlines and aborts. Host-side
bookkeeping only: it drives the host half of the paged cache (block tables, reference
counts, names) and never touches a K/V tensor.

Each step's plan holds, in this order of execution:
  1. moves of sequences from high rows into holes left by finished ones (so the occupied
     rows stay 0..used-1 and per-row state is read through views, not gathers),
  2. beam forks decided by the previous step (by reference: the hypotheses share blocks),
  3. one decode row per running row (the token chosen last step, at its next position),
     each with the block that position lies in (a new one at a block boundary; a private
     copy of a shared one, copy on write),
  4. prompt work: newly admitted and still-prefilling requests, within a token budget.

Memory. A request is admitted when a row and the blocks of its input are free (a cached
prefix's blocks are shared, not counted). When a decode step needs a block and none is free,
the most recently admitted preemptible sequence gives all of its blocks back (recompute, as
vLLM v1 does: on this host a block's recomputation is cheaper than a copy out and back): a
sampled sequence is queued first in line with its output so far, which its prefill replays
before it samples on, so its output is the same as if it had never stopped (greedy: equal;
seeded sampling: the generator's state is kept); a beam search, which has said nothing yet,
starts again. A request that could never fit the pool is refused.

With the prefix cache (decoder-only), admission starts the new sequence's block table with
the longest cached run of its prompt's blocks, read in place, and the full blocks each chunk
completes are named for later requests. A request whose prompt is mostly blocks that a
sequence already prefilling is computing waits for them (other requests are admitted past
it), so a burst sharing a system prompt computes it once.
"""

from __future__ import annotations

import heapq
import time
from collections import deque

from model.engine.families import DecoderPrompts, SourcePrompts
from model.engine.plan import DecodeRow, SlotMove, StepPlan
from model.engine.prefix_cache import PrefixCache, block_hashes
from model.engine.requests import BeamDecoding, EngineRequest, SampledDecoding, Sequence
from model.engine.speculative import Drafter, NgramDrafter, SpeculativeConfig, drafts_allowed
from model.nn.kv_cache import PagedKVCache, blocks_for
from model.tokenization.tokenizer import Tokenizer


class Scheduler:
    def __init__(self, prompts: DecoderPrompts | SourcePrompts, tokenizer: Tokenizer | None, eos_id: int | None,
                 cache: PagedKVCache, max_prefill_tokens: int, prefix: PrefixCache | None = None,
                 release_window: int = 0, speculative: SpeculativeConfig | None = None, draft=None):
        """``release_window`` > 0: every layer attends inside that sliding window, so blocks
        behind it are given back as a sequence moves on. ``speculative``: draft tokens by prompt
        lookup (decoder-only; model.engine.speculative), or by ``draft`` (a ``DraftModel``, under
        the method ``draft``: the plan says how many drafts each sequence wants, ``plan.draft_limits``,
        and the engine core has the draft model propose them before the step runs)."""
        self.prompts, self.tokenizer, self.eos_id = prompts, tokenizer, eos_id
        self.cache = cache
        self.prefix = prefix if not prompts.encodes_source else None
        self.n_slots, self.max_prefill_tokens = cache.n_slots, max_prefill_tokens
        self.release_window = release_window
        self.speculative = speculative if speculative is not None and speculative.enabled \
            and not prompts.encodes_source else None
        self.draft = draft if self.speculative is not None and self.speculative.method == "draft" else None
        self.free: list[int] = list(range(cache.n_slots))  # a heap: lowest rows first keeps batches contiguous
        self.waiting: deque[EngineRequest] = deque()
        self.preempted: deque[Sequence] = deque()  # resume first, oldest first
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.reserve = max(1, cache.n_blocks // 100)  # admission leaves this many for running sequences to grow

    # --- bookkeeping -------------------------------------------------------------------
    @property
    def slots_used(self) -> int:
        return self.n_slots - len(self.free)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.preempted or self.prefilling or self.running)

    def add(self, req: EngineRequest) -> None:
        self.waiting.append(req)

    def remove(self, request_id: str) -> EngineRequest | None:
        """Forget a request wherever it is; its rows and blocks are free for the next step."""
        for i, req in enumerate(self.waiting):
            if req.request_id == request_id:
                del self.waiting[i]
                return req
        for i, seq in enumerate(self.preempted):
            if seq.req.request_id == request_id:
                del self.preempted[i]
                return seq.req
        for group in (self.prefilling, self.running):
            for i, seq in enumerate(group):
                if seq.req.request_id == request_id:
                    del group[i]
                    self.release(seq)
                    return seq.req
        return None

    def release(self, seq: Sequence) -> None:
        if seq.drafter is not None:
            seq.drafter.release()
        for s in seq.slots:
            self.cache.release(s)
            heapq.heappush(self.free, s)
        seq.slots = []

    def retire(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.release(seq)

    def all_requests(self) -> list[EngineRequest]:
        return (list(self.waiting) + [s.req for s in self.preempted]
                + [s.req for s in self.prefilling + self.running])

    def capacity_tokens(self) -> int:
        """Positions the whole pool holds (the null block aside)."""
        return (self.cache.n_blocks - 1) * self.cache.block_len

    # --- planning ------------------------------------------------------------------------
    def schedule(self, device) -> StepPlan:
        plan = StepPlan(moves=self._compact())
        for seq in self.running:
            if seq.beam_moves and seq.beam_moves[0]:
                src, dst = seq.beam_moves
                self.cache.fork([seq.slots[i] for i in src], [seq.slots[i] for i in dst])
            seq.beam_moves = None
        self._plan_decode(plan)
        plan.admitted = self._admit(device, plan)
        self.prefilling += plan.admitted
        if self.prefilling:
            self.prompts.plan(plan, self.prefilling, self.max_prefill_tokens)
        if self.prefix is not None:
            self._name_blocks(plan)
        return plan

    def _plan_decode(self, plan: StepPlan) -> None:
        """A decode row per running row, each with its block; preempts to find blocks."""
        for seq in sorted(self.running, key=lambda s: s.req.arrival):
            if seq not in self.running:  # preempted to make room for an older one
                continue
            while not self._blocks_for_step(seq, plan):
                victim = self._victim()
                if victim is None:  # nobody can make room for it (it cannot go on): refuse it
                    self.running.remove(seq)
                    self.release(seq)
                    plan.rejected.append(seq.req)
                    break
                self._preempt(victim, plan)
                if victim is seq:
                    break
        if self.speculative is not None and len(self.running) <= self.speculative.max_batch:
            for seq in self.running:
                if seq.drafter is None:
                    continue
                if self.draft is not None:
                    wanted = self._draft_room(seq, seq.drafter.wants(self._draft_limit(seq)))
                    if wanted:
                        plan.draft_limits[seq] = wanted
                    continue
                drafts = self._drafts(seq)
                if drafts:
                    plan.drafts[seq] = drafts
        self.decode_rows(plan)

    def decode_rows(self, plan: StepPlan) -> None:
        """``plan.decode``: each running row's fed token, then its sequence's drafts, by row."""
        plan.decode = [DecodeRow(seq, slot, tok, seq.next_pos + i)
                       for seq in sorted(self.running, key=lambda s: s.slots[0]) for j, slot in enumerate(seq.slots)
                       for i, tok in enumerate([seq.next_tokens[j], *plan.drafts.get(seq, ())])]

    def _draft_limit(self, seq: Sequence) -> int:
        """Drafts ``seq`` may feed this step: its tokens left (the step's own token included) and
        its context's positions, less one."""
        left = min(seq.req.params.max_new_tokens - seq.generated, self.cache.max_len - seq.next_pos) - 1
        return max(0, min(self.speculative.tokens, left))

    def _draft_room(self, seq: Sequence, n: int) -> int:
        """How many of ``n`` drafts the pool has blocks for, without preempting anyone (see
        ``_drafts``)."""
        for i in range(n):
            if not self.cache.ensure(seq.slots[0], seq.next_pos + i + 2):
                return i
        return n

    def _drafts(self, seq: Sequence) -> list[int]:
        """Draft tokens for ``seq`` this step, with the blocks their positions need (as many as
        the pool gives without preempting anyone: drafts are a bet, never worth a preemption).
        No copy on write: the fed token's block was made the row's own (``_blocks_for_step``),
        and every block after it was allocated to this row alone (shared blocks are prompt
        blocks, behind it; beams never draft)."""
        left = self._draft_limit(seq)
        drafts = seq.drafter.propose(left) if left > 0 else []
        return drafts[:self._draft_room(seq, len(drafts))]

    def _blocks_for_step(self, seq: Sequence, plan: StepPlan) -> bool:
        """Make the block of ``seq.next_pos`` writable in each of its rows: allocated, and its
        own (copy on write). False when the pool ran out."""
        for slot in seq.slots:
            if not self.cache.ensure(slot, seq.next_pos + 1):
                return False
            copy = self.cache.private(slot, seq.next_pos)
            if copy is False:
                return False
            if copy is not None:
                plan.copies.append(copy)
            if self.release_window:
                self.cache.drop_before(slot, seq.next_pos + 1 - self.release_window)
        return True

    def _victim(self) -> Sequence | None:
        """The preemptible sequence that arrived last (a resumed one keeps its place)."""
        candidates = [s for s in self.running + self.prefilling if self.prompts.preemptible(s)]
        return max(candidates, key=lambda s: s.req.arrival, default=None)

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Give back every block of ``seq``; it waits first in line, to resume or start again."""
        for group in (self.running, self.prefilling):
            if seq in group:
                group.remove(seq)
        self.release(seq)
        self.preemptions += 1
        plan.preempted.append(seq)
        plan.copies = [c for c in plan.copies if self.cache.pool.refs[c[1]] > 0]
        if isinstance(seq.decoding, SampledDecoding) and seq.output_ids:
            seq.resumed, seq.prefilled, seq.cached_tokens, seq.blocks_named = True, 0, 0, 0
            seq.prefix_hashes = []
            self.preempted.append(seq)
        else:  # nothing said yet: start again from the request
            self.waiting.appendleft(seq.req)

    def _admit(self, device, plan: StepPlan) -> list[Sequence]:
        admitted: list[Sequence] = []
        budget = self.max_prefill_tokens - sum(s.prompt_left for s in self.prefilling)
        pending = self._pending_blocks()
        deferred: list[EngineRequest] = []
        if plan.preempted:  # memory is short this step: admit nothing new
            return admitted
        while self.preempted or self.waiting:
            resumed = self.preempted[0] if self.preempted else None
            req = resumed.req if resumed is not None else self.waiting[0]
            width = req.params.beam_size
            seq = resumed or Sequence(req, [], None)  # its decoding state is made once it is admitted
            if resumed is None and self._never_fits(seq):
                plan.rejected.append(self.waiting.popleft())
                continue
            hashes, hit, waits = self._match(seq, pending)
            if waits:  # its next blocks are being computed by a sequence prefilling: wait for them
                deferred.append(self.waiting.popleft())
                continue
            if width > len(self.free) or not self.prompts.can_admit(seq.input_ids, not admitted, budget):
                break
            positions = self.prompts.positions_needed(seq, self.cache.max_len)
            rows = width if self.prompts.encodes_source else 1  # a decoder's beams fork from the prompt's row
            need = rows * blocks_for(positions, self.cache.block_len) - len(hit)
            if need + self.reserve > self.cache.pool.available and (admitted or self.running or self.prefilling):
                break  # it waits for blocks (alone, it may take the reserve)
            (self.preempted if resumed is not None else self.waiting).popleft()
            seq.slots = [heapq.heappop(self.free) for _ in range(width)]
            seq.admitted_at = time.monotonic()
            if seq.decoding is None:
                seq.decoding = self._decoding(req, device)
                seq.drafter = self._drafter(seq)
            if self.prefix is not None:
                self.cache.adopt(seq.slots[0], hit)
                self.prefix.count(len(seq.input_ids), len(hit))
                seq.prefix_hashes, seq.blocks_named = hashes, len(hit)
                seq.prefilled = seq.cached_tokens = len(hit) * self.cache.block_len
                pending.update(hashes[len(hit):])
            if not all(self.cache.ensure(s, positions) for s in seq.slots[:rows]):
                self.release(seq)  # the reserve was short after all: wait
                seq.prefilled = seq.cached_tokens = 0
                (self.preempted if resumed is not None else self.waiting).appendleft(seq if resumed else req)
                break
            admitted.append(seq)
            budget -= seq.prompt_left
        self.waiting.extendleft(reversed(deferred))
        return admitted

    def _decoding(self, req: EngineRequest, device) -> SampledDecoding | BeamDecoding:
        if req.params.beam_size > 1:
            return BeamDecoding(req, self.tokenizer, self.eos_id)
        return SampledDecoding(req, self.tokenizer, self.eos_id, self.prompts.context(req.prompt_ids), device)

    def _drafter(self, seq: Sequence) -> Drafter | None:
        if self.speculative is None or not drafts_allowed(seq.req.params, seq.req.grammar is not None):
            return None
        if self.draft is not None:
            return self.draft.drafter(seq.req.prompt_ids + seq.output_ids, self.speculative)
        return NgramDrafter(seq.req.prompt_ids + seq.output_ids, self.speculative)

    def _never_fits(self, seq: Sequence) -> bool:
        """Its input and output together need more blocks than the whole pool has."""
        start = 1 if self.prompts.encodes_source else len(seq.input_ids)  # a source is not in the decoder's cache
        total = min(start + seq.req.params.max_new_tokens, self.cache.max_len)
        return seq.req.params.beam_size * blocks_for(total, self.cache.block_len) > self.cache.n_blocks - 1

    def _match(self, seq: Sequence, pending: set[bytes]) -> tuple[list[bytes], list[int], bool]:
        """The input's block hashes, the cached blocks of its longest cached prefix, and whether
        to wait: when the blocks that follow, up to half the prompt or more, are being computed
        right now by a sequence prefilling (``pending``), waiting a step for them saves more
        than it costs; a block or two is cheaper to compute again."""
        if self.prefix is None:
            return [], [], False
        ids = seq.input_ids
        # A resumed sequence names (and finds) its prompt's blocks only: its output's K/V were
        # written as decode steps write them, which a prompt computed afresh would not match.
        hashes = block_hashes(seq.req.prompt_ids if seq.resumed else ids, self.prefix.block)
        hit = self.prefix.match(hashes, len(ids))
        if seq.resumed:
            return hashes, hit, False
        usable = min(len(hashes), (len(ids) - 1) // self.prefix.block)  # the last token is computed
        coming = len(hit)
        while coming < usable and hashes[coming] in pending:
            coming += 1
        return hashes, hit, coming > len(hit) and 2 * (coming - len(hit)) * self.prefix.block >= len(ids)

    def _pending_blocks(self) -> set[bytes]:
        """Blocks that sequences still prefilling will name."""
        return {h for seq in self.prefilling for h in seq.prefix_hashes[seq.blocks_named:]}

    def _name_blocks(self, plan: StepPlan) -> None:
        """Name the full input blocks this step's chunks complete, for requests to come."""
        for chunk in plan.chunks:
            seq = chunk.seq
            done = min((chunk.start + len(chunk.tokens)) // self.prefix.block, len(seq.prefix_hashes))
            row = self.cache.rows[seq.slots[0]]
            for i in range(seq.blocks_named, done):
                if seq.prefix_hashes[i] not in self.cache.pool.named and row[i] not in self.cache.pool.name_of:
                    self.cache.pool.name(seq.prefix_hashes[i], row[i])
                    plan.named.append(row[i])
            seq.blocks_named = max(seq.blocks_named, done)

    def _compact(self) -> list[SlotMove]:
        """Move the sequences in the highest rows into holes left by finished ones.

        With the occupied rows kept at 0..used-1, per-row state (the penalties' token sets,
        an encoder-decoder's cross-attention memory) is read through a slice (a view). A move
        moves a block table (here) and that per-row state (the runner), never the K/V."""
        if not self.free or self.free[0] >= self.slots_used:
            return []  # no holes (the common case)
        owners = {slot: (seq, j) for seq in self.prefilling + self.running for j, slot in enumerate(seq.slots)}
        moves = []
        while self.free[0] < self.slots_used:
            hole, src = heapq.heappop(self.free), max(owners)
            seq, j = owners.pop(src)
            self.cache.move_table(src, hole)
            moves.append(SlotMove(src, hole))
            seq.slots[j] = hole
            owners[hole] = (seq, j)
            heapq.heappush(self.free, src)
        return moves

    # --- applying a step's outcome -------------------------------------------------------
    def advance(self, plan: StepPlan) -> None:
        """Positions after the forward passes: decode rows moved one on (a drafting sequence
        moves on by its kept drafts too, once they are known: ``EngineCore._update``); prompt
        work done."""
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
