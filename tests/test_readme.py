"""The README stays true to the code: every setting is documented, and the test command
CI runs is the one the README gives."""

from __future__ import annotations

import re
from pathlib import Path

from service.metrics import Metrics
from service.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_every_setting_is_in_the_configuration_table():
    documented = set(re.findall(r"^\| `(TSERVE_[A-Z_]+)` \|", README, flags=re.M))
    expected = {f"TSERVE_{name.upper()}" for name in Settings.model_fields}
    assert documented == expected


def test_every_metric_is_documented():
    metrics = Metrics()
    names = {m.name for m in metrics.registry.collect()}
    for name in names:
        shown = name + "_total" if any(m.name == name and m.type == "counter" for m in metrics.registry.collect()) \
            else name
        assert f"`{shown}" in README, shown


def test_ci_runs_the_readme_test_command():
    assert "make test" in README
    assert "\nmake test\n" in (ROOT / ".ci" / "run").read_text()
