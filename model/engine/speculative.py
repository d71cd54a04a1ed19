"""Speculative decoding: prompt lookup (n-gram drafting, no second model, here) or a draft
model (``model.engine.draft_model``); both are verified here, the same way.

At batch 1 on a CPU a decode step is bound by reading the weights, so a step that feeds a row
five tokens costs little more than one that feeds it one. When the text being written repeats
spans of the prompt or of itself (editing code, extracting fields, rewriting a document), the
tokens that followed the last occurrence of the current suffix are a good guess of what comes
next. The engine feeds those guesses ("drafts") with the real next input token in one step, as
extra rows of the same sequence at the following positions (each row reads the rows before it:
every decode step writes all K/V before any row attends), and keeps the longest run the model
agrees with, plus one token of its own. llama.cpp's lookup decoding, vLLM's ``ngram`` method and
SGLang's lookahead work the same way.

Correctness:
- greedy: a draft is kept only where it equals the model's argmax at that position, and the
  token after the kept run is the argmax there, so the output is the one decoding without drafts
  gives, as far as the logits of a row do not depend on the batch it runs in (float32: equal;
  int8 decode copies quantize activations per batch, so ties may break differently, as batching
  already does: docs/limits.md);
- sampling: the standard accept/reject rule (Leviathan et al., 2023; Chen et al., 2023) with a
  deterministic draft (q puts all its mass on the draft token): draft ``d`` at a position whose
  distribution is ``p`` is accepted with probability ``p(d)``; at the first rejection the token
  is drawn from ``p`` with ``d`` removed and renormalised; after a fully accepted run the token
  is drawn from the next position's ``p``. Each emitted token then has exactly the distribution
  decoding without drafts gives it. Seeded requests do not draft (``drafts_allowed``).

What drafts: greedy and unseeded sampled decoder-only sequences without a grammar and without
repetition, presence or frequency penalties (whose per-token state the rows of one step cannot
see), while at most ``max_batch`` sequences decode. Drafting adapts to what it earns:
- how many: each draft row costs a step about ``ROW_COST`` more (SmolLM2 at batch 1 on the
  native step: 2 rows 1.06x, 3 rows 1.16x, 5 rows 1.37x the time of 1), and a run of drafts
  pays only as far as each is kept; with a sequence's recent share of kept drafts ``a``, k
  drafts give (1 - a^(k+1)) / (1 - a) tokens for 1 + ROW_COST k of the time, so the sequence
  drafts the k that maximises that ratio (1 below a ~ 0.35, 2 to ~0.55, 3 to ~0.65, then 4);
- whether: a sequence whose drafts were all refused waits 1, 3, 7, ... up to 31 steps before
  it drafts again, and any accepted draft resets the wait.
A draft model's drafts cost a draft step each on top (``Drafter.cost``), and it also waits while
even one draft does not pay at the recent rate (``ModelDrafter.pays``).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import Tensor

from model.engine.sampling import SamplingParams, filter_top_k_top_p, greedy_tokens
from model.nn.host_transfer import to_device

SPECULATIVE_METHODS = ("ngram", "draft", "off")
MAX_WAIT = 31  # steps a sequence at most waits to draft again after its drafts were refused
ROW_COST = 0.09  # a decode step's extra time per extra row, relative to one row (measured: module docstring)
MEMORY = 0.8  # per verified step, the weight kept of a sequence's earlier acceptance counts


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: ``ngram`` (prompt lookup), ``draft`` (a draft model: model.engine.draft_model;
    the engine core must be given one) or ``off``; ``tokens``: drafts per step at most;
    ``ngram_min`` / ``ngram_max``: the suffix lengths looked up, longest first;
    ``max_batch``: draft only while at most this many sequences decode (beyond, a step is
    bound by compute, and extra rows cost what they save); ``draft_cost``: see the field."""

    method: str = "ngram"
    tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    max_batch: int = 4
    draft_cost: float | None = None  # a draft model's step time / the target's (None: estimated from their weights)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method {self.method!r}; expected one of {list(SPECULATIVE_METHODS)}")
        if not 1 <= self.tokens <= 16:
            raise ValueError(f"speculative tokens must be in [1, 16], got {self.tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min <= max <= 16, got {self.ngram_min}, "
                             f"{self.ngram_max}")
        if self.max_batch < 1:
            raise ValueError(f"speculative max_batch must be >= 1, got {self.max_batch}")
        if self.draft_cost is not None and self.draft_cost < 0:
            raise ValueError(f"speculative draft_cost must be >= 0, got {self.draft_cost}")

    @property
    def enabled(self) -> bool:
        return self.method != "off"


def drafts_allowed(params: SamplingParams, constrained: bool) -> bool:
    """Whether a request's sequence may draft (see the module docstring). A seeded sampled
    request does not: whether a step drafts depends on how many sequences decode beside it,
    and drafting uses the random stream differently, so its tokens would depend on the batch,
    where a seed promises the same tokens alone or in any batch."""
    seeded = params.seed is not None and not params.greedy
    return not (constrained or seeded or params.beam_size > 1 or params.repetition_penalty != 1.0
                or params.presence_penalty or params.frequency_penalty)


class Drafter:
    """What every drafter shares: how many drafts pay at the sequence's recent rate of kept
    drafts, and the wait after refused runs. ``cost``: a draft's extra time, relative to a
    decode step without drafts."""

    cost = ROW_COST

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.tokens: list[int] = []  # the sequence so far: prompt and output
        self.wait = 0  # steps left before drafting again
        self.backoff = 0  # the wait after the next refused run
        self.kept, self.tried = 1.0, 2.0  # drafts kept / drafts judged, decayed (a prior of one half)

    def extend(self, tokens: Seq[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def waiting(self) -> bool:
        """Whether this step is one of the wait's (and count it down)."""
        if self.wait > 0:
            self.wait -= 1
            return True
        return False

    def best(self) -> tuple[int, float]:
        """The number of drafts that earns most per unit of step time at the recent rate, and
        the tokens per unit of time it earns (1: as decoding without drafts)."""
        a = self.kept / self.tried
        best, best_k = 0.0, 1
        for k in range(1, self.config.tokens + 1):
            gain = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0
            if gain / (1 + self.cost * k) > best:
                best, best_k = gain / (1 + self.cost * k), k
        return best_k, best

    def length(self) -> int:
        return self.best()[0]

    def settle(self, drafted: int, accepted: int) -> None:
        """After a verified step: reset the wait when a draft was kept, lengthen it when none was."""
        if drafted == 0:
            return
        # each kept draft was one trial won; the first refused one (if any) a trial lost
        self.kept = MEMORY * self.kept + accepted
        self.tried = MEMORY * self.tried + accepted + (accepted < drafted)
        if accepted and self.pays():
            self.backoff = 0
        else:
            self.backoff = min(2 * self.backoff + 1, MAX_WAIT)
            self.wait = self.backoff

    def pays(self) -> bool:
        """Whether drafting is worth going on with now (a refused run aside)."""
        return True

    def release(self) -> None:
        """The sequence gave its blocks back (finished, aborted, preempted)."""


class NgramDrafter(Drafter):
    """The tokens of one sequence (prompt and output), indexed by their n-grams: for each
    n-gram, where its latest occurrence ended. ``propose`` looks up the current suffix."""

    def __init__(self, tokens: Seq[int], config: SpeculativeConfig):
        super().__init__(config)
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> index after its latest occurrence
        self.extend(tokens)

    def extend(self, tokens: Seq[int]) -> None:
        lo, hi = self.config.ngram_min, self.config.ngram_max
        for tok in tokens:
            self.tokens.append(int(tok))
            end = len(self.tokens)
            # index the n-grams ending one token back: the ones ending here are the suffix,
            # which must find an earlier occurrence, not itself
            for n in range(lo, hi + 1):
                if end - 1 >= n:
                    self.ends[tuple(self.tokens[end - 1 - n: end - 1])] = end - 1

    def propose(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence of the longest
        suffix found (``ngram_max`` down to ``ngram_min`` tokens); none while waiting."""
        if self.waiting():
            return []
        toks, n_toks = self.tokens, len(self.tokens)
        limit = min(limit, self.length())
        for n in range(min(self.config.ngram_max, n_toks - 1), self.config.ngram_min - 1, -1):
            end = self.ends.get(tuple(toks[n_toks - n:]))
            if end is not None:
                return toks[end: end + limit]
        return []


def verify(logits: Tensor, drafts: list[list[int]], params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[list[int]]:
    """The tokens each drafting sequence emits this step.

    ``logits`` (R, V): for sequence i, ``len(drafts[i]) + 1`` consecutive rows, the logits after
    its fed token and after each of its drafts. Returns, per sequence, the accepted drafts and
    one token of the model's own (1 .. len(drafts) + 1 tokens)."""
    logits = logits.float()
    dev = logits.device
    counts = [len(d) + 1 for d in drafts]
    starts = [sum(counts[:i]) for i in range(len(counts))]
    argmax = greedy_tokens(logits)
    greedy_host = [p.greedy for p, c in zip(params, counts) for _ in range(c)]
    if all(greedy_host):  # greedy needs no distribution: argmax decides every row
        out = []
        argmax_host = argmax.tolist()
        for start, d in zip(starts, drafts):
            kept = 0
            while kept < len(d) and argmax_host[start + kept] == d[kept]:
                kept += 1
            out.append(list(d[:kept]) + [argmax_host[start + kept]])
        return out
    temps = to_device([1.0 if p.greedy else p.temperature for p, c in zip(params, counts) for _ in range(c)],
                      torch.float32, dev)
    scaled = logits / temps[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = to_device([p.top_k for p, c in zip(params, counts) for _ in range(c)], torch.long, dev)
        top_p = to_device([p.top_p for p, c in zip(params, counts) for _ in range(c)], torch.float32, dev)
        scaled = filter_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)  # (R, V): each row's sampling distribution
    flat_drafts = [t for d in drafts for t in d]
    draft_rows = [s + j for s, d in zip(starts, drafts) for j in range(len(d))]
    p_draft = (probs[to_device(draft_rows, torch.long, dev), to_device(flat_drafts, torch.long, dev)].tolist()
               if draft_rows else [])
    argmax_host = argmax.tolist()
    uniforms = _uniforms(counts, params, generators, dev)
    out, finals = [], []  # finals: (row, token refused there or -1) for the token each sequence draws
    k = 0
    for i, d in enumerate(drafts):
        start, kept = starts[i], 0
        for j, tok in enumerate(d):
            row = start + j
            ok = argmax_host[row] == tok if greedy_host[row] else uniforms[i][j] <= p_draft[k + j]
            if not ok:
                break
            kept += 1
        k += len(d)
        out.append(list(d[:kept]))
        refused = d[kept] if kept < len(d) else -1
        finals.append((start + kept, refused))
    # the token after each kept run: argmax (greedy), or a draw from p with the refused draft removed
    rows = to_device([r for r, _ in finals], torch.long, dev)
    chosen = probs[rows]
    refused = to_device([t for _, t in finals], torch.long, dev)
    has_refused = refused >= 0
    chosen = chosen.scatter(1, refused.clamp(min=0)[:, None],
                            torch.where(has_refused[:, None], 0.0, chosen.gather(1, refused.clamp(min=0)[:, None])))
    cdf = chosen.cumsum(dim=-1)
    u = to_device([uniforms[i][-1] for i in range(len(drafts))], torch.float32, dev)[:, None]
    drawn = torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(-1).clamp_(max=cdf.size(-1) - 1).tolist()
    for i, (row, _) in enumerate(finals):
        out[i].append(argmax_host[row] if greedy_host[row] else drawn[i])
    return out


def _uniforms(counts: list[int], params: list[SamplingParams], generators: list[torch.Generator | None],
              dev: torch.device) -> list[list[float]]:
    """Per sequence, one uniform in (0, 1] per draft and one for its last token, from its own
    generator when seeded."""
    out = []
    for c, p, gen in zip(counts, params, generators):
        if p.greedy:
            out.append([1.0] * c)
        else:
            out.append((1.0 - torch.rand(c, device=dev, generator=gen)).tolist())
    return out
