"""Sizes and durations as operators and clients write them (TSERVE_MEMORY_BUDGET, keep_alive)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.settings import Settings
from service.units import parse_duration, parse_size


@pytest.mark.parametrize(("text", "expected"), [
    ("4GiB", 4 * 2**30), ("4 GiB", 4 * 2**30), ("1.5GB", 1_500_000_000), ("800M", 800_000_000),
    ("512mib", 512 * 2**20), ("1024", 1024), (2048, 2048), ("10KB", 10_000), ("0", 0)])
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["4GX", "GiB", "-1GiB", "1e9", "", True, float("inf")])
def test_bad_sizes_say_what_is_accepted(text):
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize(("text", "expected"), [
    ("5m", 300.0), ("30s", 30.0), ("1h30m", 5400.0), ("500ms", 0.5), ("300", 300.0), (300, 300.0),
    (0, 0.0), ("0", 0.0), ("-1", -1.0), (-5, -1.0), ("-1m", -1.0), ("1.5h", 5400.0), ("2h0m1s", 7201.0)])
def test_ollama_durations(text, expected):
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["5x", "", "m", "5 m", "1d", True, "1h-5m", float("nan")])
def test_bad_durations(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_settings_read_them_and_name_the_variable_on_error():
    s = Settings(_env_file=None, memory_budget="2GiB", keep_alive="10m", preload="none")
    assert (s.memory_budget, s.keep_alive, s.preload_names()) == (2 * 2**30, 600.0, [])
    default = Settings(_env_file=None)
    assert (default.memory_budget, default.keep_alive, default.preload_names()) == (None, -1.0, None)
    assert Settings(_env_file=None, preload=" a , b ").preload_names() == ["a", "b"]
    with pytest.raises(ValidationError, match="memory_budget"):
        Settings(_env_file=None, memory_budget="lots")
    with pytest.raises(ValidationError, match="keep_alive"):
        Settings(_env_file=None, keep_alive="forever")
