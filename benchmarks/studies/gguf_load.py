"""Loading a GGUF file, served: start to /ready, peak RSS while loading, RSS once loaded, decode
speed, for a first start (an empty weights cache) and the starts after it.

    python -m benchmarks.studies.gguf_load /path/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --starts 2
    python -m benchmarks.studies.gguf_load FILE.gguf --revision /work/main --label main   # another checkout

Each start is ``python -m service --models FILE`` in a child process (``--revision``: the
checkout it runs from, so an older revision is measured the same way), its weights cache
(``TSERVE_WEIGHTS_CACHE``) a directory of this run's, empty before the first start. The peak is
the kernel's high-water mark of the server's resident set (``VmHWM`` in /proc/PID/status),
read once /ready answers, with the CPU time it used so far (user + system: on a loaded host
the wall time mostly says how busy the cores were); "RSS after load" is ``VmRSS`` a second later. Then one greedy
completion of ``--tokens`` tokens (streamed off, ``ignore_eos``) gives the decode rate, and
``/v1/models`` the model's context, KV pool and memory as the service counts them.
Prints one markdown row per start and the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.server_process import service_process

MIB = 2**20


def status_kib(pid: int, field: str) -> int:
    """A ``VmRSS`` / ``VmHWM`` line of /proc/PID/status, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat): on a shared host, what a
    start cost apart from waiting for the cores."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_start(file: Path, cache: Path, revision: Path, log: Path, tokens: int, env: dict[str, str]) -> dict:
    server = service_process(log, "--models", str(file), cwd=revision, ready_timeout_s=1800,
                             env={"TSERVE_WEIGHTS_CACHE": str(cache), "TSERVE_LOG_JSON": "false", **env})
    server.start()
    try:
        ready_s = server.wait_ready()
        peak = status_kib(server.pid, "VmHWM") * 1024
        cpu = cpu_seconds(server.pid)
        time.sleep(1.0)
        after = status_kib(server.pid, "VmRSS") * 1024
        card = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
        body = {"model": card["id"], "prompt": "def quicksort(items):\n", "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True}
        started = time.perf_counter()
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=600).json()
        elapsed = time.perf_counter() - started
    finally:
        server.stop()
    kv = card.get("kv_cache") or {}
    done = reply["usage"]["completion_tokens"]
    return {"ready_s": round(ready_s, 1), "cpu_s": round(cpu, 1), "peak_rss_mib": round(peak / MIB),
            "rss_after_mib": round(after / MIB), "tokens": done, "tok_s": round(done / elapsed, 1),
            "context": card.get("max_seq_len") or card.get("context_length"),
            "kv_capacity_tokens": kv.get("capacity_tokens"), "kv_mib": round(kv.get("bytes", 0) / MIB),
            "weights_mib": round(card["memory"]["weights_bytes"] / MIB), "decode_step": card.get("decode_step")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.gguf_load", description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path, help="a .gguf file")
    parser.add_argument("--starts", type=int, default=2, help="starts on one cache: the first converts")
    parser.add_argument("--revision", type=Path, default=REPO_ROOT, help="the checkout to run the service from")
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--tokens", type=int, default=64, help="tokens of the greedy completion timed")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="a setting for the server")
    args = parser.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)
    size = args.file.stat().st_size
    rows = []
    with tempfile.TemporaryDirectory(prefix="gguf-load-") as tmp:
        for i in range(args.starts):
            row = one_start(args.file.resolve(), Path(tmp) / "cache", args.revision.resolve(),
                            Path(tmp) / f"server-{i}.log", args.tokens, env)
            row.update(label=args.label, start=i + 1, file_mib=round(size / MIB),
                       peak_over_file_and_kv=round(row["peak_rss_mib"] * MIB / (size + row["kv_mib"] * MIB), 2),
                       after_over_file_and_kv=round(row["rss_after_mib"] * MIB / (size + row["kv_mib"] * MIB), 2))
            rows.append(row)
            print(f"| {args.file.name} | {args.label} | {i + 1} | {row['ready_s']} s ({row['cpu_s']} s CPU) "
                  f"| {row['peak_rss_mib']:,} MiB ({row['peak_over_file_and_kv']}x) "
                  f"| {row['rss_after_mib']:,} MiB ({row['after_over_file_and_kv']}x) "
                  f"| {row['tok_s']} | {row['context']:,} | {row['kv_mib']:,} MiB |", flush=True)
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
