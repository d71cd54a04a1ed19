"""Beam search for the encoder-decoder: the per-step bookkeeping, over any cache.

Each source owns ``beam_size`` consecutive rows (slots). A step scores every
(beam, token) pair of every live source in one batched top-k, then the host keeps
the best ``beam_size`` continuations per source and tells the caller which cache
rows to copy where. Finished hypotheses are scored ``sum logprob / length ** length_penalty``.
The engine core (model.engine) runs one ``BeamSearch`` per request; ``model.beam_search``
drives it offline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from model.engine.generation import FINISH_EOS, FINISH_LENGTH


@dataclass
class BeamStep:
    copy_src: list[int]  # slots (source * k + beam) to copy ...
    copy_dst: list[int]  # ... onto these slots, before the next decode step
    tokens: list[int]  # next input token of every row of every still-live source


class BeamSearch:
    def __init__(self, n_sources: int, beam_size: int, length_penalty: float, max_new_tokens: int,
                 eos_id: int | None):
        self.beam_size, self.length_penalty = beam_size, length_penalty
        self.max_new_tokens, self.eos_id = max_new_tokens, eos_id
        self.live = list(range(n_sources))
        self.steps = 0
        self.sum_logprobs = [[0.0] + [float("-inf")] * (beam_size - 1) for _ in range(n_sources)]
        self.beams: list[list[list[int]]] = [[[] for _ in range(beam_size)] for _ in range(n_sources)]
        self.finished: list[list[tuple[float, list[int], str]]] = [[] for _ in range(n_sources)]

    def _norm(self, score: float, length: int) -> float:
        return score / (max(length, 1) ** self.length_penalty)

    def _add_finished(self, src: int, score: float, tokens: list[int], reason: str) -> None:
        hyps = self.finished[src]
        hyps.append((self._norm(score, len(tokens) + (reason == FINISH_EOS)), tokens, reason))
        hyps.sort(key=lambda h: -h[0])
        del hyps[self.beam_size:]

    def step(self, logprobs: Tensor) -> BeamStep:
        """logprobs (len(live) * k, V) for the live sources in order -> the cache moves and
        next tokens. Updates ``live``."""
        return steps_together([self], [logprobs])[0]

    def _advance(self, top_scores: list[list[float]], top_idx: list[list[int]], vocab: int) -> BeamStep:
        """The host's part of a step: each live source's 2k best (score, flat index) candidates."""
        k = self.beam_size
        self.steps += 1
        copy_src, copy_dst, tokens, still_live = [], [], [], []
        for row, src in enumerate(self.live):
            chosen: list[tuple[float, int, int]] = []
            for rank, (score, flat) in enumerate(zip(top_scores[row], top_idx[row])):
                parent, tok = divmod(flat, vocab)
                if score == float("-inf"):
                    break
                if tok == self.eos_id:
                    if rank < k:  # an EOS ranked below the beam width would not have been kept
                        self._add_finished(src, score, self.beams[src][parent], FINISH_EOS)
                    continue
                chosen.append((score, parent, tok))
                if len(chosen) == k:
                    break
            self.beams[src] = [self.beams[src][p] + [t] for _, p, t in chosen]
            self.sum_logprobs[src] = [s for s, _, _ in chosen] + [float("-inf")] * (k - len(chosen))
            self.beams[src] += [[] for _ in range(k - len(chosen))]
            if self._is_done(src, chosen):
                continue
            still_live.append(src)
            base = src * k
            for j, (_, parent, _tok) in enumerate(chosen):
                if parent != j:
                    copy_src.append(base + parent)
                    copy_dst.append(base + j)
            tokens += [t for _, _, t in chosen] + [self.eos_id or 0] * (k - len(chosen))
        self.live = still_live
        return BeamStep(copy_src, copy_dst, tokens)

    def _is_done(self, src: int, chosen: list[tuple[float, int, int]]) -> bool:
        if self.steps >= self.max_new_tokens or not chosen:
            for j, (score, _, _) in enumerate(chosen):
                self._add_finished(src, score, self.beams[src][j], FINISH_LENGTH)
            return True
        hyps = self.finished[src]
        if len(hyps) < self.beam_size:
            return False
        best_running = self._norm(chosen[0][0], self.steps)
        return hyps[-1][0] >= best_running

    def best(self, src: int) -> tuple[float, list[int], str]:
        return self.finished[src][0]


def steps_together(searches: list[BeamSearch], logprobs: list[Tensor]) -> list[BeamStep]:
    """``search.step(lp)`` for each pair, with one top-k for all the live sources of the searches
    of each beam width (the engine runs one search per request: at batch 32 that was 32 top-k
    calls a step). Each row's scores are the same sums as alone and top-k picks per row, so
    every search takes the steps it would take alone."""
    steps: list[BeamStep | None] = [None] * len(searches)
    for k in dict.fromkeys(s.beam_size for s in searches):
        group = [i for i, s in enumerate(searches) if s.beam_size == k]
        vocab = logprobs[group[0]].size(-1)
        prior = torch.tensor([searches[i].sum_logprobs[src] for i in group for src in searches[i].live],
                             device=logprobs[group[0]].device)  # (sources, k)
        stacked = torch.cat([logprobs[i] for i in group]) if len(group) > 1 else logprobs[group[0]]
        scores = (prior[:, :, None] + stacked.view(len(prior), k, vocab)).view(len(prior), k * vocab)
        top_scores, top_idx = scores.topk(2 * k, dim=-1)  # (sources, 2k): enough for k non-EOS candidates
        top_scores, top_idx = top_scores.tolist(), top_idx.tolist()
        row = 0
        for i in group:
            n = len(searches[i].live)
            steps[i] = searches[i]._advance(top_scores[row: row + n], top_idx[row: row + n], vocab)
            row += n
    return steps
