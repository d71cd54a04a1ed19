"""``make gpu-check`` (benchmarks.gpu_check) end to end on a few of its tests, so the check
cannot rot on machines without a GPU: the report names each test's outcome, the CUDA-only
parts as skipped, and a failure with its error."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from benchmarks.gpu_check import SECTIONS, TRITON_TESTS, PytestRun, default_runs, run_check, section_peak
from model.decode.triton_attention import triton_available

NO_PLUGINS = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


@pytest.mark.skipif(not triton_available(), reason="triton is not installed (the dev extra has it)")
def test_the_check_runs_what_it_can_and_reports_the_rest_as_skipped(tmp_path):
    # The interpreter run as the check makes it, cut to one kernel test (the interpreter is slow)
    # and without pytest's plugins (loading them takes ~10 s on 2 busy cores; the kernel tests use
    # none). The compiled run's tests skip here by test_triton_attention's own fixture; the next
    # test covers how a skip is reported.
    run = next(run for run in default_runs() if run.name == "interpreter")
    run = dataclasses.replace(run, env={**run.env, **NO_PLUGINS},
                              extra=(*run.extra, "-k", "test_kernel_matches_reference and bf16-gqa4"))
    small = ["decode_attention_batches=1", "decode_attention_histories=128"]
    report = run_check(tmp_path, [run], SECTIONS, small)
    assert report["passed"], report["problems"]
    assert json.loads((tmp_path / "report.json").read_text()) == json.loads(json.dumps(report, default=str))
    assert report["environment"]["triton"] and report["environment"]["torch"] == torch.__version__
    assert [(t["id"], t["outcome"]) for t in report["test_runs"][0]["tests"]] == [
        (f"{TRITON_TESTS}::test_kernel_matches_reference[interpreter-bf16-gqa4]", "passed")]
    sections = report["benchmarks"]["sections"]
    assert set(sections) == {"6. GPU", "9. decode attention (GPU)"}
    markdown = (tmp_path / "report.md").read_text()
    assert markdown.startswith("# GPU check\n\n**PASSED**") and "bfloat16 dot products" in markdown
    if torch.cuda.is_available():
        assert all(s["status"] == "ok" for s in sections.values()) and report["benchmarks"]["rows"]
    else:
        assert all(s["status"].startswith("skipped: ") for s in sections.values())
        assert "| 6. GPU | skipped: no CUDA device" in markdown


def test_a_failing_test_fails_the_check_and_the_report_shows_its_error(tmp_path):
    tests = tmp_path / "test_sample.py"
    tests.write_text("import pytest\n\n\ndef test_fine():\n    pass\n\n\ndef test_wrong():\n"
                     "    assert 1 + 1 == 3, 'arithmetic'\n\n\n"
                     "def test_elsewhere():\n    pytest.skip('no CUDA device')\n")
    runs = [PytestRun("sample", (str(tests),), NO_PLUGINS),
            PytestRun("missing", (str(tmp_path / "test_absent.py"),), NO_PLUGINS)]
    report = run_check(tmp_path / "out", runs, sections=())
    assert not report["passed"]
    sample, missing = report["test_runs"]
    assert [(t["id"].rsplit("::", 1)[1], t["outcome"]) for t in sample["tests"]] == [
        ("test_fine", "passed"), ("test_wrong", "failed"), ("test_elsewhere", "skipped")]
    assert sample["tests"][2]["message"] == "no CUDA device"
    assert "AssertionError: arithmetic" in sample["tests"][1]["message"] and "error" not in sample
    assert missing["error"].startswith("pytest exited with 4")  # usage error: no such file
    assert report["problems"] == ["test (sample) failed: test_sample.py::test_wrong",
                                  f"tests (missing): {missing['error'].splitlines()[0]}"]
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "**FAILED**" in markdown and "AssertionError: arithmetic" in markdown


def test_a_sections_peak_is_its_largest_part_or_the_allocators_and_needs_no_parts():
    # Section 9 records no parts: the first lent H200 run (2026-11-30) crashed here on max(float).
    assert section_peak(3 * 2**20, {}) == 3.0
    assert section_peak(3 * 2**20, {"decode": 1029.8, "kv-cache": 36.9}) == 1029.8
    assert section_peak(2048 * 2**20, {"decode": 10.0}) == 2048.0
