"""The native decode step alone, in-process: milliseconds per step of a GGUF model at a few batch
sizes, to compare kernel changes between revisions without a server in the way.

    python -m benchmarks.studies.native_step FILE.gguf [--batches 1 8 32] [--steps 40] [--threads 2]
    PYTHONPATH=OTHER_TREE python -m benchmarks.studies.native_step ...   # the same for another checkout

The file is loaded as the service loads it (``load_gguf``, stored blocks by default), the step is
the one ``model.decode.prepare`` picks with default options, and each batch runs ``--steps``
decode steps from position 0 over a fresh float32 cache of that many positions (the context stays
short: this measures the projections, not attention over a long context). Printed: the median over
the steps after the first two. Run the revisions alternately, more than once each: a shared or
virtual host moves by tens of percent between minutes, so only ratios of alternated runs mean
anything. With 2 threads under a passive OpenMP wait policy (``OMP_WAIT_POLICY=PASSIVE``, what the
service sets, and what this study sets unless the environment says otherwise) a step of a few rows
runs on one intra-op thread and its partner thread; without it the step has no partner (one row
took ~1.8x the time on a 2-core Xeon).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as service/__main__.py: before OpenMP starts

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402


def step_times(path: str, batches: list[int], steps: int, threads: int) -> dict[int, float]:
    from model.decode import DecodeOptions, prepare
    from model.formats.gguf_import import load_gguf

    torch.set_num_threads(threads)
    loaded = load_gguf(path)
    model = loaded.model.eval()
    step = prepare(model, DecodeOptions(), loaded.tokenizer)
    print(f"step: {type(step).__name__}", flush=True)
    out = {}
    with torch.inference_mode():
        for batch in batches:
            cache = model.new_cache(batch, steps + 2, dtype=torch.float32)
            ids = torch.arange(batch) % 1000 + 100  # ordinary tokens; the weights read do not depend on them
            times = []
            for position in range(steps):
                start = time.perf_counter()
                step(cache, ids, list(range(batch)), [position] * batch)
                times.append(time.perf_counter() - start)
            out[batch] = statistics.median(times[2:]) * 1e3
            print(f"batch {batch}: {out[batch]:.1f} ms per step, {batch / out[batch] * 1e3:.1f} tokens/s", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the first two are not counted)")
    step_times(args.gguf, args.batches, args.steps, args.threads)


if __name__ == "__main__":
    main()
