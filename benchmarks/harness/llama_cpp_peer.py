"""llama.cpp as a benchmark peer, through llama-cpp-python's bindings of its C API.

``LlamaCppBatch`` drives ``llama_decode`` the way llama.cpp's own server does with
``--parallel N``: every running sequence contributes one token to one batch per step (its
continuous batching), each sequence in its own KV-cache sequence id. Greedy choice is an
argmax over each row's logits. No HTTP in between, which flatters the peer slightly
against our numbers measured through the service.

llama-cpp-python is built from its sdist (the ``bench`` extra; ~5-20 minutes on 2 cores).
"""

from __future__ import annotations

import ctypes

import numpy as np

try:
    import llama_cpp
except ImportError:  # pragma: no cover - the bench extra is optional
    llama_cpp = None


def available() -> bool:
    return llama_cpp is not None


class LlamaCppBatch:
    def __init__(self, gguf: str, threads: int, n_ctx: int, n_seq: int, n_batch: int = 2048):
        if llama_cpp is None:
            raise RuntimeError("llama-cpp-python is not installed (pip install -e '.[bench]')")
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(gguf.encode(), mparams)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = n_ctx, n_batch, min(n_batch, 512)
        cparams.n_seq_max, cparams.n_threads, cparams.n_threads_batch = n_seq, threads, threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """items: (token, position, sequence id, wants logits) -> greedy next token of each
        item that wants logits, in order."""
        out: list[int] = []
        for start in range(0, len(items), self.n_batch):
            chunk = items[start: start + self.n_batch]
            b = self.batch
            b.n_tokens = len(chunk)
            for i, (tok, pos, seq, wants) in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, int(wants)
                b.seq_id[i][0] = seq
            if llama_cpp.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
            for i, (_, _, _, wants) in enumerate(chunk):
                if wants:
                    row = llama_cpp.llama_get_logits_ith(self.ctx, i)
                    out.append(int(np.ctypeslib.as_array(ctypes.cast(row, ctypes.POINTER(ctypes.c_float)),
                                                         shape=(self.n_vocab,)).argmax()))
        return out

    def generate(self, prompts: list[list[int]], n_new: int) -> list[list[int]]:
        """Greedy ``n_new`` tokens for every prompt, all sequences decoded together."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        items = [(t, p, s, p == len(prompt) - 1) for s, prompt in enumerate(prompts) for p, t in enumerate(prompt)]
        nxt = self._decode(items)
        outs = [[t] for t in nxt]
        for step in range(1, n_new):
            items = [(outs[s][-1], len(prompts[s]) + step - 1, s, True) for s in range(len(prompts))]
            for s, t in enumerate(self._decode(items)):
                outs[s].append(t)
        return outs
