"""model/decode/support.py: every ModelConfig field is classified for every fast path, and a
value a path does not implement is refused by name by the check and by the construction alike."""

from __future__ import annotations

import dataclasses

import pytest

from model import ModelConfig, build_model
from model.decode import support
from model.decode.native import NativeStep, unsupported_reason, wants_native
from tests.model.nn.test_llama import llama_config


def test_every_config_field_is_classified_for_every_fast_path():
    assert support.unclassified_fields() == []
    assert sorted(support.FIELDS) == sorted(f.name for f in dataclasses.fields(ModelConfig))
    for name, rule in support.FIELDS.items():
        for path in support.FAST_PATHS:
            value = getattr(rule, path)
            assert value in (support.READ, support.IGNORED) or (isinstance(value, tuple) and value), (name, path)


def test_a_new_unclassified_field_turns_every_fast_path_off(monkeypatch):
    """What happens when someone adds a config field (say, soft-capping) and forgets this table."""
    monkeypatch.setattr(support, "config_fields", lambda: [*support.FIELDS, "attn_logit_softcapping"])
    why = support.unsupported_reason(llama_config(), "native")
    assert why is not None and "attn_logit_softcapping" in why and "not classified" in why


def _another_value(name: str, allowed: tuple):
    """A valid config value outside ``allowed`` for ``name``."""
    if isinstance(allowed[0], bool):
        return not allowed[0]
    if name == "type_vocab_size":
        return 2
    others = {"head_dim_override": 16, "sliding_window": 8, "local_rope_theta": 1000.0}
    if name in others:
        return others[name]
    choices = {"family": ("encoder-decoder", "decoder", "encoder"), "activation": ("gelu", "relu"),
               "positional": ("learned", "sinusoidal"), "norm": ("layernorm",), "mlp": ("standard",),
               "norm_placement": ("post",)}
    return next(v for v in choices[name] if v not in allowed)


NATIVE_RESTRICTED = [name for name, rule in support.FIELDS.items()
                     if isinstance(rule.native, tuple) and name != "family"]


@pytest.mark.parametrize("name", NATIVE_RESTRICTED)
def test_each_value_the_native_step_lacks_is_refused_by_name_everywhere(name):
    value = _another_value(name, support.FIELDS[name].native)
    extra = {"max_positions": 64} if name == "positional" else {}
    cfg = llama_config(**{name: value}, **extra)
    model = build_model(cfg).init_weights(0).eval()
    why = unsupported_reason(model)
    assert why is not None and f"'{name}'" in why
    with pytest.raises(ValueError, match=f"'{name}'"):
        wants_native("on", model)
    with pytest.raises(ValueError, match=f"'{name}'"):
        NativeStep(model)
    assert not wants_native("auto", model)


def test_the_triton_kernel_reads_sliding_windows_and_refuses_encoders_by_name():
    assert support.unsupported_reason(llama_config(sliding_window=8, sliding_window_layers=[0]), "triton") is None
    why = support.unsupported_reason(dataclasses.replace(llama_config(), family="encoder"), "triton")
    assert why is not None and "'family'" in why


def test_the_llama_architecture_passes_every_rule():
    assert support.unsupported_reason(llama_config(), "native") is None
    assert support.unsupported_reason(llama_config(), "triton") is None
