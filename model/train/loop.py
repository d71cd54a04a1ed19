"""The training loop shared by the three families: AdamW, warmup + decay, clipping,
periodic validation, resumable state, DDP, then evaluation and export to ``out_dir``.

Determinism: the batch of each step is a function of the step (model.train.batches),
and dropout / masking randomness is re-seeded from (seed, step, rank) at every step, so
a run stopped at any checkpoint and resumed produces the same weights bit for bit.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from model.nn.transformer import TransformerModel, build_model
from model.tokenization.tokenizer import Tokenizer
from model.train.config import ScheduleConfig, TrainConfig
from model.train.distributed import Distributed
from model.train.objectives import OBJECTIVES, Objective, batch_to, step_generator
from model.train.records import load_records, mask_pairs  # noqa: F401 - mask_pairs: part of this module's API

STATE_FILE = "train_state.pt"
TOKENIZER_FILE = "tokenizer.json"
# Changing any of these makes an old training state meaningless for the new run.
RESUME_KEYS = ("task", "model", "tokenizer", "data")


@dataclass
class TrainResult:
    model: TransformerModel  # this rank's model, in training mode
    tokenizer: Tokenizer
    steps: int  # steps completed
    metrics: dict[str, Any] | None  # None when stopped before the end (stop_after) or on ranks > 0


class ResumeError(RuntimeError):
    """The saved training state belongs to a different configuration."""


def lr_at(step: int, s: ScheduleConfig) -> float:
    """Linear warmup to ``lr``, then inverse-sqrt (the 2017 paper) or cosine decay."""
    warm = max(1, s.warmup_steps)
    if step < warm:
        return s.lr * (step + 1) / warm
    if s.decay == "inverse_sqrt":
        return s.lr * math.sqrt(warm / (step + 1))
    progress = min(1.0, (step - warm) / max(1, s.max_steps - warm))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: nn.Module, s: ScheduleConfig) -> torch.optim.AdamW:
    """AdamW; no weight decay on biases and LayerNorm gains (1-d tensors)."""
    params = list(model.parameters())  # tied tensors appear once
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": s.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=s.lr, betas=s.betas, eps=1e-8)


def snapshot_paths(cfg: TrainConfig) -> list[Path]:
    """Saved weight snapshots for checkpoint averaging, oldest first."""
    found = Path(cfg.work_dir).glob("snapshot-*.pt")
    return sorted(found, key=lambda p: int(p.stem.split("-")[1]))


def save_snapshot(cfg: TrainConfig, model: nn.Module, step: int) -> None:
    """Keep the weights of the last ``schedule.average_last`` snapshots (float32, no optimizer)."""
    path = Path(cfg.work_dir) / f"snapshot-{step}.pt"
    torch.save({k: v.detach().float().clone() for k, v in model.state_dict().items()}, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)
    for old in snapshot_paths(cfg)[:-cfg.schedule.average_last]:
        old.unlink()


def average_snapshots(cfg: TrainConfig, model: nn.Module, log: Callable[[str], None]) -> list[int]:
    """Load the mean of the kept snapshots into ``model``; returns their steps ([] when none)."""
    paths = snapshot_paths(cfg)[-cfg.schedule.average_last:] if cfg.schedule.average_last > 1 else []
    if len(paths) < 2:
        return []
    total: dict[str, torch.Tensor] = {}
    for path in paths:
        for k, v in torch.load(path, map_location="cpu", weights_only=True).items():
            total[k] = total[k] + v if k in total else v.clone()
    current = model.state_dict()
    model.load_state_dict({k: (v / len(paths)).to(current[k].dtype) for k, v in total.items()})
    steps = [int(p.stem.split("-")[1]) for p in paths]
    log(f"[{cfg.name}] exporting the average of {len(paths)} snapshots (steps {steps})")
    return steps


def init_weights(path: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of the servable checkpoint at ``path``, checked against ``model``'s shapes."""
    from model.formats.checkpoint import load as load_checkpoint

    start = load_checkpoint(path).model.state_dict()
    want = model.state_dict()
    wrong = sorted(k for k in want if k not in start or start[k].shape != want[k].shape)
    if wrong or set(start) - set(want):
        raise ValueError(f"init_from {path}: its architecture differs from the config's (e.g. {wrong[:3]})")
    return {k: v.to(want[k].dtype) for k, v in start.items()}


def prepare_tokenizer(cfg: TrainConfig, objective_cls: type[Objective], train: Sequence[dict],
                      dist: Distributed) -> Tokenizer:
    """Rank 0 trains the tokenizer once (kept in work_dir for resumes); the others load it."""
    path = Path(cfg.work_dir) / TOKENIZER_FILE
    if dist.is_main and not path.is_file():
        tok = objective_cls.train_tokenizer(cfg, objective_cls.tokenizer_texts(train))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tok.save(tmp)
        tmp.replace(path)
    dist.barrier()
    return Tokenizer.from_file(path)


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def validation_loss(model: nn.Module, objective: Objective, batches: list[dict], device: torch.device) -> float:
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        with _autocast(device):
            loss, n = objective.loss(model, batch_to(batch, device), training=False)
        total += float(loss) * n
        count += n
    model.train(was_training)
    return total / max(1, count)


def save_state(path: Path, model: TransformerModel, optimizer: torch.optim.Optimizer, step: int,
               history: dict[str, list], cfg: TrainConfig) -> None:
    """Our own resumable state (trusted; torch.save). Served weights never use this format."""
    state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "history": history, "config": cfg.to_dict()}
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # a kill mid-write leaves the previous state intact


def load_state(path: Path, cfg: TrainConfig) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    saved, now = state["config"], cfg.to_dict()
    changed = [k for k in RESUME_KEYS if saved.get(k) != now.get(k)]
    if changed or saved["schedule"].get("seed") != now["schedule"]["seed"]:
        raise ResumeError(f"{path} was written by a run with different {changed or ['schedule.seed']}; "
                          f"use a new work_dir or pass --fresh")
    return state


@dataclass
class _Run:
    """What one training run carries from stage to stage."""

    cfg: TrainConfig
    dist: Distributed
    say: Callable[[str], None]
    started: float  # monotonic time this process started
    train_records: list[dict]
    tok: Tokenizer
    objective: Objective
    model: TransformerModel
    net: nn.Module  # the model, DDP-wrapped when distributed
    optimizer: torch.optim.AdamW
    history: dict[str, Any]
    start: int  # first step this process runs (> 0 when resumed)
    earlier_s: float  # wall time of earlier, resumed-from runs
    valid_batches: list[dict]

    @property
    def state_path(self) -> Path:
        return Path(self.cfg.work_dir) / STATE_FILE

    def wall_time(self) -> float:
        return self.earlier_s + time.monotonic() - self.started


class _LossWindow:
    """Training loss and token rate averaged over the steps since the last log line."""

    def __init__(self) -> None:
        self.loss, self.steps, self.tokens, self.t0 = 0.0, 0, 0, time.perf_counter()

    def add(self, loss: float, tokens: int) -> None:
        self.loss, self.steps, self.tokens = self.loss + loss, self.steps + 1, self.tokens + tokens

    def flush(self, run: _Run, done: int, lr: float, bar: tqdm) -> None:
        rate = self.tokens * run.dist.world / max(1e-9, time.perf_counter() - self.t0)
        run.history["train"].append([done, self.loss / self.steps])
        run.history["tokens_per_s"].append([done, rate])
        bar.set_postfix(loss=f"{self.loss / self.steps:.3f}", tok_s=f"{rate:.0f}", lr=f"{lr:.2e}", refresh=False)
        self.__init__()


def _setup(cfg: TrainConfig, resume: bool, device: str | None, log: Callable[[str], None] | None) -> _Run:
    """Data, tokenizer, objective, model and optimizer; the saved state when resuming."""
    dist = Distributed.from_env(device)
    say = log or (lambda msg: print(msg, file=sys.stderr, flush=True) if dist.is_main else None)
    s = cfg.schedule
    if s.threads:
        torch.set_num_threads(s.threads)
    Path(cfg.work_dir).mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    train_records, valid_records = load_records(cfg, "train"), load_records(cfg, "valid")
    objective_cls = OBJECTIVES[cfg.task]
    init_tok = Path(cfg.init_from) / TOKENIZER_FILE if cfg.init_from else None
    if init_tok is not None and dist.is_main and not (Path(cfg.work_dir) / TOKENIZER_FILE).is_file():
        if not init_tok.is_file():
            raise FileNotFoundError(f"init_from {cfg.init_from}: no {TOKENIZER_FILE} there")
        shutil.copyfile(init_tok, Path(cfg.work_dir) / TOKENIZER_FILE)  # the same tokenizer as the start
    tok = prepare_tokenizer(cfg, objective_cls, train_records, dist)
    objective = objective_cls(cfg, tok, train_records, valid_records)
    model = build_model(cfg.model_config(tok.vocab_size, objective.special)).init_weights(s.seed).to(dist.device)
    optimizer = make_optimizer(model, s)
    history: dict[str, Any] = {"train": [], "valid": [], "tokens_per_s": []}
    start = 0
    state = load_state(Path(cfg.work_dir) / STATE_FILE, cfg) if resume else None
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start, history = state["step"], state["history"]
        say(f"[{cfg.name}] resuming at step {start} after {history.get('train_seconds', 0) / 60:.1f} min")
    elif cfg.init_from:
        model.load_state_dict(init_weights(cfg.init_from, model))
        say(f"[{cfg.name}] initialised from {cfg.init_from}")
    if dist.is_main:  # snapshots past the start belong to a run not being continued (or are re-made)
        for path in snapshot_paths(cfg):
            if int(path.stem.split("-")[1]) > start:
                path.unlink()
    say(f"[{cfg.name}] {model.num_parameters() / 1e6:.2f}M parameters, vocab {tok.vocab_size}, "
        f"{len(train_records)} training records, world size {dist.world}")
    net: nn.Module = DistributedDataParallel(model) if dist.enabled else model
    return _Run(cfg, dist, say, started, train_records, tok, objective, model, net, optimizer, history, start,
                history.get("train_seconds", 0.0), objective.valid_batches() if dist.is_main else [])


def _optimizer_step(run: _Run, step: int) -> tuple[float, int]:
    """One optimisation step; the batch and the dropout noise depend only on (seed, step, rank)."""
    s, dist = run.cfg.schedule, run.dist
    for group in run.optimizer.param_groups:
        group["lr"] = lr_at(step, s)
    torch.manual_seed((s.seed * 7_919 + step * 31 + dist.rank) % (2**63))  # dropout noise of this step
    batch = batch_to(run.objective.batch(step * dist.world + dist.rank, step_generator(s.seed, step, dist.rank)),
                     dist.device)
    with _autocast(dist.device):
        loss, n_tokens = run.objective.loss(run.net, batch)
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(run.model.parameters(), s.grad_clip)
    run.optimizer.step()
    return loss.detach().item(), n_tokens


def _validate(run: _Run, done: int) -> None:
    if run.dist.is_main:
        val = validation_loss(run.model, run.objective, run.valid_batches, run.dist.device)
        run.history["valid"].append([done, val])
        last_train = run.history["train"][-1][1] if run.history["train"] else 0
        run.say(f"[{run.cfg.name}] step {done}: train {last_train:.3f} valid {val:.3f}")
    run.dist.barrier()


def _save(run: _Run, done: int) -> None:
    run.history["train_seconds"] = run.wall_time()
    if run.dist.is_main:
        save_state(run.state_path, run.model, run.optimizer, done, run.history, run.cfg)
    run.dist.barrier()


def _steps(run: _Run, stop_after: int | None, time_limit_s: float | None, stop_at_step: int | None,
           progress: bool) -> tuple[int, bool | None]:
    """Run the optimisation steps; returns (steps done, stopped early), with None for
    "stopped early" when ``stop_after`` ended the run before export."""
    s, dist = run.cfg.schedule, run.dist
    if stop_at_step is not None and run.start >= stop_at_step:  # resumed at the stop: export only
        return run.start, True
    bar = tqdm(total=s.max_steps, initial=run.start, disable=not (progress and dist.is_main), dynamic_ncols=True,
               mininterval=2.0 if sys.stderr.isatty() else 60.0, file=sys.stderr)
    window, done = _LossWindow(), run.start
    run.model.train()
    try:
        for step in range(run.start, s.max_steps):
            window.add(*_optimizer_step(run, step))
            done = step + 1
            if done % s.log_every == 0 or done == s.max_steps:
                window.flush(run, done, lr_at(step, s), bar)
            bar.update(1)
            if done % s.eval_every == 0 or done == s.max_steps:
                _validate(run, done)
            over_time = time_limit_s is not None and time.monotonic() - run.started > time_limit_s
            stop_now = dist.any_true(over_time) if time_limit_s is not None else False
            stop_now = stop_now or (stop_at_step is not None and done >= stop_at_step)
            if done % s.checkpoint_every == 0 or done == stop_after or stop_now:
                _save(run, done)
            if s.average_last > 1 and done % s.snapshot_every == 0 and dist.is_main:
                save_snapshot(run.cfg, run.model, done)
            if done == stop_after:
                return done, None
            if stop_now:
                run.say(f"[{run.cfg.name}] stopping early after step {done} (time limit or --stop-at-step); exporting")
                return done, True
        return done, False
    finally:
        bar.close()


def _average_if_better(run: _Run, done: int) -> list[int]:
    """Checkpoint averaging, kept only if it helps: the final weights join the snapshots, and
    the mean of the last ``average_last`` is exported when its validation loss is lower than
    the final weights' (an undertrained model, still improving fast, is better left alone).
    Both losses go into the history. Returns the averaged steps ([] when not averaged)."""
    cfg = run.cfg
    if cfg.schedule.average_last < 2:
        return []
    if not (Path(cfg.work_dir) / f"snapshot-{done}.pt").is_file():
        save_snapshot(cfg, run.model, done)
    final = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    final_loss = validation_loss(run.model, run.objective, run.valid_batches, run.dist.device)
    steps = average_snapshots(cfg, run.model, run.say)
    if not steps:
        return []
    averaged_loss = validation_loss(run.model, run.objective, run.valid_batches, run.dist.device)
    run.history["averaging"] = {"steps": steps, "valid_loss_averaged": round(averaged_loss, 4),
                                "valid_loss_final": round(final_loss, 4), "kept": averaged_loss < final_loss}
    if averaged_loss < final_loss:
        return steps
    run.model.load_state_dict(final)
    run.say(f"[{cfg.name}] averaging not kept: validation loss {averaged_loss:.4f} vs {final_loss:.4f} "
            f"for the final weights (step {done})")
    return []


def train(cfg: TrainConfig, resume: bool = True, stop_after: int | None = None,
          time_limit_s: float | None = None, progress: bool = True, device: str | None = None,
          command: str = "", log: Callable[[str], None] | None = None, stop_at_step: int | None = None
          ) -> TrainResult:
    """Train ``cfg`` to ``schedule.max_steps`` and export to ``out_dir`` (with metrics).

    ``stop_after`` saves the state after that many steps and returns without exporting
    (as if killed there);
    ``time_limit_s`` stops early at a wall-clock limit and exports what it has;
    ``stop_at_step`` stops and exports after that many steps, the learning-rate schedule
    still planned for ``max_steps`` (so a time-limited run can be replayed exactly).
    """
    run = _setup(cfg, resume, device, log)
    done, stopped_early = _steps(run, stop_after, time_limit_s, stop_at_step, progress)
    if stopped_early is None:  # stop_after: as if killed after saving
        run.dist.close()
        return TrainResult(run.model, run.tok, done, None)
    metrics = None
    if run.dist.is_main:
        from model.train.export import export  # evaluation + model card: rank 0 only

        run.history["averaged_snapshots"] = _average_if_better(run, done)

        metrics = export(cfg, run.model, run.tok, run.objective, run.history, run.train_records, command=command,
                         train_seconds=run.wall_time(), stopped_early=stopped_early, log=run.say, steps_done=done)
    run.dist.barrier()
    run.dist.close()
    return TrainResult(run.model, run.tok, done, metrics)
