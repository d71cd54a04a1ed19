"""``python -m model.train --config model/train/configs/<name>.json [options]``

One entry point for the three families; the config file says which. Multi-process:
``torchrun --nproc_per_node 2 -m model.train --config ...`` (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from pathlib import Path

from model.train.config import TrainConfig, TrainConfigError
from model.train.loop import ResumeError, train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, type=Path, help="training config (JSON)")
    parser.add_argument("--out", help="override out_dir (where the servable checkpoint goes)")
    parser.add_argument("--work-dir", help="override work_dir (resumable state, tokenizer)")
    parser.add_argument("--max-steps", type=int, help="override schedule.max_steps (e.g. a short trial)")
    parser.add_argument("--fresh", action="store_true", help="ignore and delete any saved training state")
    parser.add_argument("--time-limit-min", type=float, help="stop at this wall-clock limit and export")
    parser.add_argument("--stop-at-step", type=int,
                        help="stop and export after this many steps, keeping the schedule planned for max_steps "
                             "(replays a time-limited run exactly)")
    parser.add_argument("--init-from", help="start from this servable checkpoint (weights and tokenizer); "
                                            "overrides the config's init_from")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        cfg = TrainConfig.load(args.config)
        if args.out:
            cfg.out_dir = args.out
        if args.work_dir:
            cfg.work_dir = args.work_dir
        if args.init_from:
            cfg.init_from = args.init_from
        if args.max_steps:
            cfg.schedule.max_steps = args.max_steps
        if args.fresh and Path(cfg.work_dir).exists():
            shutil.rmtree(cfg.work_dir)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        launcher = f"torchrun --nproc_per_node {world} -m model.train" if world > 1 else "python -m model.train"
        command = launcher + " " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
        train(cfg, resume=True, time_limit_s=args.time_limit_min * 60 if args.time_limit_min else None,
              progress=not args.no_progress, device=args.device, command=command, stop_at_step=args.stop_at_step)
    except (TrainConfigError, ResumeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
