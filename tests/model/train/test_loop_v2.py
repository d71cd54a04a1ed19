"""The training loop's v2 additions: masked placeholder pairs, raw records for evaluation,
checkpoint averaging, and exporting a run already saved at its --stop-at-step."""

from __future__ import annotations

import json

import torch

from model.formats.checkpoint import load
from model.train.loop import (
    STATE_FILE,
    average_snapshots,
    load_records,
    mask_pairs,
    save_snapshot,
    snapshot_paths,
    train,
)
from tests.model.train.tiny_configs import tiny_config

QUIET = {"progress": False, "log": lambda msg: None}


def test_mask_pairs_masks_both_sides_and_drops_mismatches():
    records = [
        {"source": "%1$s of %2$s", "target": "%2$s von %1$s", "origin": "a"},
        {"source": "Delete %s files", "target": "Dateien löschen", "origin": "b"},  # target lost it
        {"source": "Open", "target": "Öffnen %d", "origin": "c"},  # target invented one
        {"source": "Save {name}", "target": "{name} speichern", "origin": "d"},
        {"source": "100%% done", "target": "100%% fertig", "origin": "e"},
        {"source": "Copy %s", "target": "%d kopieren", "origin": "f"},  # a different placeholder
    ]
    out = mask_pairs(records)
    assert out == [
        {"source": "⟪1⟫ of ⟪2⟫", "target": "⟪2⟫ von ⟪1⟫", "origin": "a"},
        {"source": "Save ⟪1⟫", "target": "⟪1⟫ speichern", "origin": "d"},
        {"source": "100%% done", "target": "100%% fertig", "origin": "e"},
    ]
    assert records[0]["source"] == "%1$s of %2$s"  # the input records are not modified


def test_load_records_masks_unless_raw(tmp_path):
    cfg = tiny_config("translation", tmp_path)
    plain = load_records(cfg, "train")
    cfg.model["mask_placeholders"] = True
    masked, raw = load_records(cfg, "train"), load_records(cfg, "train", raw=True)
    assert raw == plain
    with_ph = [r for r in raw if "%PRODUCTNAME" in r["source"]]
    assert with_ph and all("%PRODUCTNAME" in r["target"] for r in with_ph)
    assert any("⟪" in r["source"] for r in masked)
    assert not any("%PRODUCTNAME" in r["source"] or "%PRODUCTNAME" in r["target"] for r in masked)
    assert masked == mask_pairs(raw) and len(masked) <= len(raw)
    cfg.data.max_train_records = 10
    assert len(load_records(cfg, "train", raw=True)) == 10
    assert len(load_records(cfg, "valid", raw=True)) == 30  # the cap is for training records only


def test_snapshots_keep_the_last_n_and_average_to_their_mean(tmp_path):
    cfg = tiny_config("translation", tmp_path, average_last=3)
    (tmp_path / "work").mkdir()
    model = torch.nn.Linear(3, 2)
    saved = {}
    for step in (2, 4, 6, 8, 10):
        with torch.no_grad():
            model.weight.fill_(float(step))
            model.bias.copy_(torch.tensor([step, -step / 2]))
        save_snapshot(cfg, model, step)
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    assert [p.name for p in snapshot_paths(cfg)] == ["snapshot-6.pt", "snapshot-8.pt", "snapshot-10.pt"]
    assert not list((tmp_path / "work").glob("*.tmp"))

    logged = []
    steps = average_snapshots(cfg, model, logged.append)
    assert steps == [6, 8, 10] and "3 snapshots" in logged[0]
    for key in ("weight", "bias"):
        expected = (saved[6][key] + saved[8][key] + saved[10][key]) / 3
        assert torch.allclose(model.state_dict()[key], expected)
    assert torch.allclose(model.weight, torch.full((2, 3), 8.0))
    assert torch.allclose(model.bias, torch.tensor([8.0, -4.0]))


def test_averaging_is_off_or_needs_two_snapshots(tmp_path):
    cfg = tiny_config("translation", tmp_path, average_last=3)
    (tmp_path / "work").mkdir()
    model = torch.nn.Linear(2, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    save_snapshot(cfg, model, 5)
    assert average_snapshots(cfg, model, print) == []  # one snapshot: nothing to average
    cfg.schedule.average_last = 0
    save_snapshot(cfg, torch.nn.Linear(2, 2), 6)
    assert average_snapshots(cfg, model, print) == []
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_training_exports_the_average_of_the_last_snapshots(tmp_path):
    cfg = tiny_config("translation", tmp_path, steps=8, average_last=3, snapshot_every=2, checkpoint_every=4,
                      eval_every=8)
    cfg.eval.beam_sentences = 0
    result = train(cfg, **QUIET)
    paths = snapshot_paths(cfg)
    assert [p.name for p in paths] == ["snapshot-4.pt", "snapshot-6.pt", "snapshot-8.pt"]
    snaps = [torch.load(p, weights_only=True) for p in paths]
    exported = load(tmp_path / "out").model.state_dict()
    last = torch.load(tmp_path / "work" / STATE_FILE, weights_only=True)["model"]
    averaging = result.metrics["averaging"]
    assert averaging["steps"] == [4, 6, 8]
    # The mean is exported only when its validation loss is lower than the final weights'.
    assert averaging["kept"] == (averaging["valid_loss_averaged"] < averaging["valid_loss_final"])
    for key, value in exported.items():
        expected = sum(s[key] for s in snaps) / 3 if averaging["kept"] else last[key]
        assert torch.allclose(value, expected, atol=1e-6), key
    assert result.metrics["averaged_snapshots"] == ([4, 6, 8] if averaging["kept"] else [])
    saved = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert saved["averaged_snapshots"] == result.metrics["averaged_snapshots"]
    assert saved["averaging"] == averaging


def test_a_fresh_run_does_not_average_an_earlier_runs_snapshots(tmp_path):
    cfg = tiny_config("translation", tmp_path, steps=4, average_last=2, snapshot_every=2, eval_every=4)
    cfg.eval.beam_sentences = 0
    (tmp_path / "work").mkdir()
    for step in (6, 8):  # left by an earlier, longer run in the same work_dir
        torch.save({"stale": torch.zeros(1)}, tmp_path / "work" / f"snapshot-{step}.pt")
    result = train(cfg, resume=False, **QUIET)
    assert [p.name for p in snapshot_paths(cfg)] == ["snapshot-2.pt", "snapshot-4.pt"]
    assert result.metrics["averaging"]["steps"] == [2, 4]  # not the stale 6 and 8


def test_resumed_at_the_stop_step_exports_without_another_step(tmp_path):
    cfg = tiny_config("translation", tmp_path, steps=12, checkpoint_every=4, eval_every=4)
    cfg.eval.beam_sentences = 0
    first = train(cfg, stop_after=4, **QUIET)
    assert first.steps == 4 and not (tmp_path / "out").exists()
    state_file = tmp_path / "work" / STATE_FILE
    saved = torch.load(state_file, weights_only=True)
    assert saved["step"] == 4

    done = train(cfg, stop_at_step=4, command="python -m model.train --config c.json --time-limit-min 9", **QUIET)
    assert done.steps == 4 and done.metrics["stopped_early"] is True and done.metrics["train_steps"] == 4
    assert done.metrics["reproduce_command"] == "python -m model.train --config c.json --stop-at-step 4"
    exported = load(tmp_path / "out").model.state_dict()
    for key, value in saved["model"].items():  # the weights saved at step 4, no step taken since
        assert torch.equal(exported[key], value), key
    after = torch.load(state_file, weights_only=True)
    assert after["step"] == 4 and after["history"] == saved["history"]


def test_init_from_starts_with_a_checkpoints_weights_and_tokenizer(tmp_path):
    first = tiny_config("translation", tmp_path / "a", steps=2, eval_every=2)
    first.eval.beam_sentences = 0
    train(first, **QUIET)
    start = load(first.out_dir)
    cfg = tiny_config("translation", tmp_path / "b", steps=1, eval_every=1)
    cfg.eval.beam_sentences = 0
    cfg.init_from = first.out_dir
    cfg.schedule.lr = 0.0  # no update: the exported weights are the starting ones
    train(cfg, **QUIET)
    copied = (tmp_path / "b" / "work" / "tokenizer.json").read_bytes()
    assert copied == (tmp_path / "a" / "out" / "tokenizer.json").read_bytes()
    after = load(cfg.out_dir).model.state_dict()
    for key, value in start.model.state_dict().items():
        assert torch.allclose(after[key], value), key
