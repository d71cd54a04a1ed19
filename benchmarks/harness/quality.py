"""Quality measures several benchmarks share: a fixed held-out English text and the
perplexity a decode step gives it."""

from __future__ import annotations

import torch

from model.decode import PythonStep


def heldout_text() -> str:
    """Docstrings of a few standard-library modules: fixed for a Python version, English
    technical prose unlike the calibration text."""
    import argparse
    import collections
    import inspect
    import json

    return "\n\n".join(inspect.getdoc(m) or "" for m in (json, argparse, collections))


def decode_perplexity(model, ids: list[int], step=None) -> float:
    """exp(mean NLL) of ``ids[1:]``, each token scored by a decode step (``step``, default the
    model's Python step) over the cache."""
    import math

    step = step or PythonStep(model)
    cache = model.new_cache(1, len(ids) + 1, dtype=step.kv_dtype)
    nll = 0.0
    with torch.inference_mode():
        for i in range(len(ids) - 1):
            logits = step(cache, torch.tensor([ids[i]]), [0], [i]).float()
            nll -= float(logits.log_softmax(-1)[0, ids[i + 1]])
    return math.exp(nll / (len(ids) - 1))
