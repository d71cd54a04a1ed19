"""The command line: ``python -m model.train.fill_mask_head SUB-COMMAND`` (the package's docstring)."""

from __future__ import annotations

import argparse
import importlib

import torch

from model.train.fill_mask_head.data import CACHE, OUT, cmd_data
from model.train.fill_mask_head.evaluation import cmd_eval
from model.train.fill_mask_head.finetune import cmd_export, cmd_finetune
from model.train.fill_mask_head.frozen import cmd_features, cmd_train


def _run_options(p: argparse.ArgumentParser) -> None:
    """What ``train`` and ``finetune`` share: logging, validation, seed, resume and destination."""
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--restart", action="store_true", help="ignore a saved training state")
    p.add_argument("--dest", default="weights/fill-mask-en", help="where mlm_head.safetensors goes")


def main(argv: list[str] | None = None) -> None:
    usage = importlib.import_module(__package__).__doc__  # the package's docstring
    parser = argparse.ArgumentParser(prog="python -m model.train.fill_mask_head", description=usage,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(OUT), help="work directory (sentences, cached states, resume state)")
    parser.add_argument("--threads", type=int, default=1)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("data", help="build the training and held-out sentences")
    p.add_argument("--cache", default=str(CACHE), help="where the .deb files are downloaded and unpacked")
    p.set_defaults(fn=cmd_data)
    for name, fn in (("features", cmd_features), ("train", cmd_train)):
        p = sub.add_parser(name)
        p.add_argument("--unfreeze-top", type=int, default=0,
                       help="train the top N encoder layers too (0: frozen); `features` then also caches the states "
                            "entering them, which a frozen `train` ignores")
        p.set_defaults(fn=fn)
    feats, train = sub.choices["features"], sub.choices["train"]
    feats.add_argument("--passes", type=int, default=1,
                       help="times each non-Python-docs sentence is masked (differently)")
    feats.add_argument("--mask-prob", type=float, default=0.15)
    feats.add_argument("--batch", type=int, default=64)
    feats.add_argument("--shard-sentences", type=int, default=4000)
    feats.add_argument("--max-shards", type=int, default=0, help="stop after this many shards (0: all)")
    train.add_argument("--epochs", type=int, default=4)
    train.add_argument("--batch", type=int, default=512)
    train.add_argument("--lr", type=float, default=2e-3)
    train.add_argument("--layer-lr", type=float, default=1e-4)
    train.add_argument("--warmup", type=int, default=100)
    train.add_argument("--valid-pieces", type=int, default=5000)
    _run_options(train)
    p = sub.add_parser("finetune", help="train the whole encoder with the head, masking on the fly (resumes)")
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--steps", type=int, default=0, help="total steps (overrides --epochs)")
    p.add_argument("--extend", action="store_true",
                   help="on resume, use this command's --epochs/--steps total, not the saved run's")
    p.add_argument("--stop-after", type=int, default=0, help="stop (state saved) at this step, before the total")
    p.add_argument("--batch", type=int, default=64, help="sentences per step")
    p.add_argument("--lr", type=float, default=1e-3, help="head and [MASK] embedding")
    p.add_argument("--encoder-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--mask-prob", type=float, default=0.15)
    p.add_argument("--keep", type=float, default=0.1, help="chosen wordpieces left as they are")
    p.add_argument("--swap", type=float, default=0.1, help="chosen wordpieces replaced by a random one")
    p.add_argument("--python-fraction", type=float, default=0.35,
                   help="share of the Python-docs sentences in each epoch (all the others are in every epoch)")
    p.add_argument("--bf16", action="store_true", help="bfloat16 autocast (weights and optimizer stay float32)")
    p.add_argument("--valid-sentences", type=int, default=1000)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--init-from", default="",
                   help="start a new run (with --restart or no saved state) from an exported model's head file "
                        "(a model directory such as weights/fill-mask-en), not from the package's encoder")
    _run_options(p)
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"),
                   help="the head file's tensors")
    p.set_defaults(fn=cmd_finetune)
    p = sub.add_parser("export", help="the head file from the saved finetune state")
    p.add_argument("--dest", default="weights/fill-mask-en")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("eval", help="top-1/top-5 of the masked word on the held-out sentences")
    p.add_argument("--model", action="append", required=True, help="a model directory (repeatable)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--limit", type=int, default=0, help="only the first N held-out sentences (0: all)")
    p.add_argument("--no-rescore", action="store_true",
                   help="only the masked LM, also where the model's manifest names a rescorer")
    p.set_defaults(fn=cmd_eval)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.fn(args)
