"""Two CPU ranks under torchrun (gloo): DDP keeps their parameters identical step by step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from model.formats.checkpoint import load
from tests.model.train.tiny_configs import tiny_config

ROOT = Path(__file__).resolve().parents[3]

# Each rank trains, then writes its own parameters; rank 0 also exports the checkpoint.
RANK_SCRIPT = """
import os, sys
from pathlib import Path
from safetensors.torch import save_file
from model.train.loop import train
from tests.model.train.tiny_configs import tiny_config

tmp = Path(sys.argv[1])
result = train(tiny_config("causal-lm", tmp, steps=int(sys.argv[2])), progress=False, log=lambda m: None)
state = {k: v.detach().clone().contiguous() for k, v in result.model.state_dict().items()}
save_file(state, str(tmp / f"rank{os.environ['RANK']}.safetensors"))
"""


def test_two_gloo_ranks_stay_in_sync(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), str(tmp_path), "8"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]

    rank0, rank1 = load_file(str(tmp_path / "rank0.safetensors")), load_file(str(tmp_path / "rank1.safetensors"))
    assert rank0.keys() == rank1.keys()
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), f"ranks diverged at {key}"

    # The exported checkpoint (rank 0) holds these weights, and they moved away from the init.
    ckpt = load(tmp_path / "out")
    assert ckpt.metrics["world_size"] == 2
    for key, value in ckpt.model.state_dict().items():
        assert torch.equal(value, rank0[key]), key
    init = ckpt.model.__class__(ckpt.config).init_weights(tiny_config("causal-lm", tmp_path).schedule.seed)
    assert not torch.equal(init.state_dict()["embed.tokens.weight"], rank0["embed.tokens.weight"])
