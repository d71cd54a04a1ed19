from __future__ import annotations

import json

import pytest

from model import ConfigError, ModelConfig
from tests.conftest import tiny_config


@pytest.mark.parametrize("family", ["decoder", "encoder-decoder", "encoder"])
def test_round_trip_through_json(tmp_path, family):
    cfg = tiny_config(family)
    cfg.save(tmp_path / "config.json")
    assert ModelConfig.load(tmp_path / "config.json") == cfg
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("field,value,needle", [
    ("activation", "tanh", "activation"),
    ("family", "seq2seq", "family"),
    ("n_heads", 5, "divisible"),
    ("norm_placement", "middle", "norm_placement"),
    ("pad_token_id", 99, "pad_token_id"),
    ("dropout", 1.5, "dropout"),
])
def test_invalid_values_name_the_field(field, value, needle):
    data = tiny_config("decoder").to_dict() | {field: value}
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_dict(data)


def test_unknown_field_and_missing_start_token():
    with pytest.raises(ConfigError, match="unknown config field.*'n_layer'"):
        ModelConfig.from_dict(tiny_config("decoder").to_dict() | {"n_layer": 3})
    data = tiny_config("encoder-decoder").to_dict() | {"decoder_start_token_id": None}
    with pytest.raises(ConfigError, match="decoder_start_token_id"):
        ModelConfig.from_dict(data)


def test_unreadable_config_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.load(tmp_path / "config.json")


def test_language_pair_is_validated_and_round_trips(tmp_path):
    assert tiny_config("encoder-decoder").source_language is None  # unknown unless the checkpoint says
    cfg = ModelConfig.from_dict(tiny_config("encoder-decoder").to_dict() | {"source_language": "en",
                                                                           "target_language": "deu"})
    cfg.save(tmp_path / "config.json")
    assert ModelConfig.load(tmp_path / "config.json") == cfg
    assert (cfg.source_language, cfg.target_language) == ("en", "deu")
    for bad, needle in [({"source_language": "EN", "target_language": "de"}, "source_language"),
                        ({"source_language": "en", "target_language": "de-DE"}, "target_language"),
                        ({"source_language": "en"}, "set both or neither"),
                        ({"target_language": 7, "source_language": "en"}, "target_language")]:
        with pytest.raises(ConfigError, match=needle):
            ModelConfig.from_dict(tiny_config("encoder-decoder").to_dict() | bad)
    with pytest.raises(ConfigError, match="encoder-decoder"):
        ModelConfig.from_dict(tiny_config("decoder").to_dict() | {"source_language": "en", "target_language": "de"})
