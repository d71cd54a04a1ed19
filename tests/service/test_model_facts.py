"""What ``/v1/models`` says a model's weights run in (service/models/facts.py ``quantization``):
the served decoder under the native step's prefill runs prompts and decode steps in int8 (its
float copies are gone); with the float prefill kept, prompts run in float32."""

from __future__ import annotations

import pytest
import torch

from model.decode import DecodeOptions, prepare
from service.models.facts import quantization
from tests.model.decode.test_native_decode import _int8, _model
from tests.model.decode_steps import native_library_or_skip


@pytest.fixture(scope="module", autouse=True)
def library() -> None:
    native_library_or_skip()


@pytest.mark.parametrize("prefill,weights", [("auto", "int8"), ("model", "float32")])
def test_what_prompts_and_decode_steps_run_in(prefill, weights):
    model = _int8(_model(3), 3)
    prepare(model, DecodeOptions(native="on", prefill=prefill))
    assert model.dtype == torch.float32  # the table may be bfloat16; the model computes in float32
    assert quantization(model, "Q4_1") == {"weights": weights, "decode": "int8", "source": "Q4_1"}
    plain = _model(3)
    assert quantization(plain, None) == {"weights": "float32", "decode": "float32", "source": None}
