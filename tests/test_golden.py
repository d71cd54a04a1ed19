"""Today's code against the outputs recorded from the shipped checkpoints before the decode
loop was rebuilt (tests/golden/record.py): greedy, seeded sampling, repetition penalty and
beam search must give the same tokens, and fill-mask the same top-5."""

from __future__ import annotations

import json

import pytest
import torch

from tests.golden import record


@pytest.fixture(scope="module")
def recorded() -> dict[str, list[list[int]]]:
    return json.loads(record.OUT.read_text())


@pytest.fixture(scope="module")
def replayed() -> dict[str, list[list[int]]]:
    with torch.inference_mode():
        return {**record.generation_cases(), **record.fill_mask_cases()}


def test_every_recorded_case_is_replayed(recorded, replayed):
    assert sorted(recorded) == sorted(replayed)


@pytest.mark.parametrize("case", [
    "generate-en/greedy", "generate-en/sampled", "generate-en/penalised",
    "translate-en-de/greedy", "translate-en-de/sampled", "translate-en-de/penalised",
    "translate-en-de/beam2", "translate-en-de/beam4", "fill-mask-en/top5",
])
def test_shipped_model_outputs_unchanged(case, recorded, replayed):
    assert replayed[case] == recorded[case]
