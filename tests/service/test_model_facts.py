"""What ``/v1/models`` says a model's weights run in (service/models/facts.py ``quantization``):
the served decoder under the native step's prefill runs prompts and decode steps in int8 (its
float copies are gone); with the float prefill kept, prompts run in float32; a Q4_0 / Q4_1 file's
projections decode in their own 4-bit weights."""

from __future__ import annotations

import pytest
import torch

from model.decode import DecodeOptions, prepare
from service.models.facts import quantization
from tests.model.decode.test_native_decode import _int8, _model
from tests.model.decode.test_native_q4 import _projections, _q4_float
from tests.model.decode_steps import native_library_or_skip


@pytest.fixture(scope="module", autouse=True)
def library() -> None:
    native_library_or_skip()


@pytest.mark.parametrize("prefill,weights", [("auto", "int8"), ("model", "float32")])
def test_what_prompts_and_decode_steps_run_in(prefill, weights):
    model = _int8(_model(3), 3)
    prepare(model, DecodeOptions(native="on", prefill=prefill))
    assert model.dtype == torch.float32  # the table may be bfloat16; the model computes in float32
    assert quantization(model, "Q4_1") == {"weights": weights, "decode": "int8", "source": "Q4_1", "decode_q4": 0}
    plain = _model(3)
    assert quantization(plain, None) == {"weights": "float32", "decode": "float32", "source": None,
                                         "decode_q4": 0}


def test_a_q4_file_decodes_its_own_4_bit_weights():
    """A Q4_1 file's projections decode in their 4-bit runs as stored (the README's "read as they
    are"), the head int8: the card says both, and how many projections read 4-bit weights."""
    model = _int8(_q4_float(4), 4)
    step = prepare(model, DecodeOptions(native="on", prefill="model"))
    assert step.weights4 == _projections(model) > 0
    assert quantization(model, "Q4_1", step.weights4) == {"weights": "float32", "decode": "q4+int8",
                                                          "source": "Q4_1", "decode_q4": _projections(model)}
    int8_only = prepare(_int8(_q4_float(4), 4), DecodeOptions(native="on", prefill="model", weights="int8"))
    assert int8_only.weights4 == 0
