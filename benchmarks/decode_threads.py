"""Decode-step throughput of SmolLM2-135M (int8 decode, as the service runs it) by intra-op
threads, OpenMP wait policy and compiled or eager step: the measurements behind
``model.decode.threads`` and ``CompiledDecoder.max_batch``.

``python -m benchmarks.decode_threads``: one child process per (policy, compiled) pair (the
policy is read once, when libgomp loads); each times 10-step runs of batches 1, 8 and 32 over a
256-position span on 1 and 2 threads and prints the median tok/s. Needs a quiet machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

MANIFEST = Path("weights/smollm2-135m-instruct")


def _child(compiled: bool) -> dict[str, float]:
    import torch

    import model.decode.threads
    from model import load_model
    from model.decode.compiled import CompiledDecoder
    from model.quant.int8 import calibration_ids, quantize_int8_

    model.decode.threads.SMALL_DECODE = 0  # measure the raw thread counts, not the policy
    loaded = load_model(MANIFEST)
    m = loaded.model.eval()
    quantize_int8_(m, calibration_ids(loaded.tokenizer), decode_only=True)
    m.optimize_for_inference()
    if compiled:
        CompiledDecoder.max_batch = 32
        m.compile_decode()
    cache = m.new_cache(32, 512)
    out = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for b in (1, 8, 32):
            tokens, slots = torch.full((b,), 100), list(range(b))
            runs = []
            with torch.inference_mode():
                for i in range(3):
                    m.decode_step(cache, tokens, slots, [200 + i] * b)
                for _ in range(5):
                    start = time.perf_counter()
                    for i in range(10):
                        m.decode_step(cache, tokens, slots, [210 + i] * b)
                    runs.append(b * 10 / (time.perf_counter() - start))
            out[f"{threads} threads, batch {b}"] = sorted(runs)[2]
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2] == "1")))
        return
    for policy in ("PASSIVE", ""):
        for compiled in ("0", "1"):
            env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
            if policy:
                env["OMP_WAIT_POLICY"] = policy
            out = subprocess.run([sys.executable, "-m", "benchmarks.decode_threads", "--child", compiled], env=env,
                                 capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            rates = json.loads(out)
            label = f"OMP_WAIT_POLICY={policy or '(unset)'}, {'compiled' if compiled == '1' else 'eager'}"
            print(label + ": " + ", ".join(f"{k} {v:.0f} tok/s" for k, v in rates.items()))


if __name__ == "__main__":
    main()
