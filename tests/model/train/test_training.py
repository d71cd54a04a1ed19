"""End-to-end training of each family on the fixture corpora, and resume == uninterrupted."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from model.formats.checkpoint import load
from model.train.loop import TOKENIZER_FILE, ResumeError, train
from tests.model.train.tiny_configs import tiny_config

QUIET = {"progress": False, "log": lambda msg: None}


@pytest.mark.parametrize("task", ["translation", "causal-lm", "masked-lm"])
def test_train_end_to_end(task, tmp_path):
    cfg = tiny_config(task, tmp_path, steps=30)
    result = train(cfg, command=f"python -m model.train --config tiny-{task}.json", **QUIET)
    metrics = result.metrics
    assert result.steps == 30
    # masked LM learns from 15% of the tokens only, so its loss falls slowest
    margin = 0.25 if task == "masked-lm" else 0.5
    assert metrics["final_train_loss"] < metrics["first_train_loss"] - margin, metrics

    out = tmp_path / "out"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "metrics.json", "loss_curve.png", "README.md"):
        assert (out / name).is_file(), name
    assert json.loads((out / "metrics.json").read_text())["eval"] == metrics["eval"]
    assert "python -m model.train --config tiny-" in (out / "README.md").read_text()

    ckpt = load(out)
    assert ckpt.config.family == cfg.family
    for key, value in ckpt.model.state_dict().items():  # the served weights are the trained ones
        assert torch.equal(value, result.model.state_dict()[key]), key
    tok, c = ckpt.tokenizer, ckpt.config
    ev = metrics["eval"]
    if task == "translation":
        # contract with the engine: source = "$A </s>", decoding starts from <s>
        assert tok.encode("Open file")[-1] == c.eos_token_id == 2
        assert c.decoder_start_token_id == c.bos_token_id == 1 and c.pad_token_id == 0
        assert set(ev["baselines"]) == {"copy_source", "most_frequent_translation", "word_for_word_glossary"}
        assert ev["baselines"]["copy_source"]["chrf"] > 0 and "chrf" in ev["model_greedy"]
        assert "model_beam2_first5" in ev
    elif task == "causal-lm":
        assert tok.encode("To be")[0] == c.bos_token_id == 1 and c.eos_token_id == 2
        # after 30 steps the model already beats uniform guessing over its vocabulary by far
        assert ev["model_perplexity"] < c.vocab_size / 2
        assert ev["baselines"]["unigram_perplexity"] > 1
        assert len(ev["samples"]) == 4
    else:
        ids = tok.encode("to be or not")
        assert tok.id_to_token(ids[0]) == "[CLS]" and tok.id_to_token(ids[-1]) == "[SEP]"
        assert c.mask_token_id == tok.token_to_id("[MASK]") == 4 and c.pooling == "mean"
        assert 0.0 <= ev["baselines"]["most_frequent_top1"] <= ev["baselines"]["most_frequent_top5"] <= 1.0
        assert ev["model_top1"] <= ev["model_top5"] and ev["masked_tokens"] > 0


@pytest.mark.parametrize("task", ["translation", "masked-lm"])
def test_resume_gives_the_same_weights(task, tmp_path):
    """Stopped after 6 of 12 steps and resumed == 12 steps in one go, bit for bit
    (with dropout and, for the masked LM, random masking)."""
    whole = train(tiny_config(task, tmp_path / "whole", steps=12, checkpoint_every=4), **QUIET)
    cfg = tiny_config(task, tmp_path / "split", steps=12, checkpoint_every=4)
    # The `tokenizers` WordPiece trainer breaks ties differently from run to run, so both runs
    # share the first run's vocabulary (a resumed run always reuses its own from work_dir).
    (tmp_path / "split" / "work").mkdir(parents=True)
    shutil.copy(tmp_path / "whole" / "work" / TOKENIZER_FILE, tmp_path / "split" / "work" / TOKENIZER_FILE)
    first = train(cfg, stop_after=6, **QUIET)
    assert first.steps == 6 and first.metrics is None
    assert not (tmp_path / "split" / "out").exists()
    resumed = train(cfg, **QUIET)
    a, b = whole.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    if task == "translation":  # the comparison names each run's own out_dir, which differ here
        for metrics, run in ((whole.metrics, "whole"), (resumed.metrics, "split")):
            assert metrics["eval"]["comparison"].pop("systems") == {"model_greedy": str(tmp_path / run / "out")}
    assert resumed.metrics["eval"] == whole.metrics["eval"]


def test_resume_refuses_a_different_config(tmp_path):
    train(tiny_config("causal-lm", tmp_path, steps=4), stop_after=2, **QUIET)
    changed = tiny_config("causal-lm", tmp_path, steps=4)
    changed.model["d_model"] = 64
    with pytest.raises(ResumeError, match="model"):
        train(changed, **QUIET)


def test_a_run_stopped_early_is_replayed_by_its_reproduce_command(tmp_path):
    """With a cosine schedule the learning rate depends on max_steps: a run stopped early
    (time limit) is replayed with --stop-at-step, not by shrinking max_steps."""
    cfg = tiny_config("causal-lm", tmp_path / "a", steps=12, decay="cosine")
    stopped = train(cfg, stop_at_step=7, command="python -m model.train --config c.json --time-limit-min 30",
                    **QUIET)
    assert stopped.steps == 7 and stopped.metrics["stopped_early"] is True
    assert stopped.metrics["reproduce_command"] == "python -m model.train --config c.json --stop-at-step 7"
    # the first 7 steps of the full 12-step schedule, as a killed run would have them
    reference = train(tiny_config("causal-lm", tmp_path / "b", steps=12, decay="cosine"), stop_after=7, **QUIET)
    shrunk = train(tiny_config("causal-lm", tmp_path / "c", steps=7, decay="cosine"), **QUIET)
    a, b, c = stopped.model.state_dict(), reference.model.state_dict(), shrunk.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)  # --max-steps 7 would be another schedule
