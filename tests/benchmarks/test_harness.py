"""The benchmark harness runs end to end and reports what it measured (no timing is asserted)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.generation import compare_tokens
from benchmarks.harness.load_generator import LoadResult, RequestRecord
from benchmarks.harness.report import Row, Target, markdown_table
from benchmarks.harness.timing import Stat

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[dict, str]:
    """``python -m benchmarks --quick`` on the two cheapest sections (+ the GPU section where
    it only reports the missing device), shrunk further with --set."""
    out = tmp_path_factory.mktemp("bench")
    only = ["kv-cache", "attention"] + ([] if torch.cuda.is_available() else ["gpu"])
    cmd = [sys.executable, "-m", "benchmarks", "--quick", "--only", *only, "--out", str(out), "--threads", "1",
           "--set", "kv_lengths=48,96", "--set", "attention_lengths=256"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "latest.json").read_text()), done.stdout


def test_quick_run_writes_machine_info_and_settings(quick_run):
    report, _ = quick_run
    machine = report["machine"]
    for key in ("cpu_model", "cpu_cores", "torch", "torch_threads", "date", "load_average_at_start"):
        assert machine[key] not in (None, ""), key
    assert machine["torch_threads"] == 1  # --threads reached torch
    assert report["config"]["quick"] is True and report["config"]["repetitions"] == 1


def test_quick_run_rows_have_positive_ratios_and_stats(quick_run):
    report, _ = quick_run
    rows = report["rows"]
    by_section = {r["section"] for r in rows}
    assert by_section == {"3. KV cache", "4. attention"}
    # one row per requested length, plus the slot-layout row
    assert len([r for r in rows if r["section"] == "3. KV cache"]) == 3
    assert len([r for r in rows if r["section"] == "4. attention"]) == 2  # time and memory at T=256
    for r in rows:
        assert r["peer"] and r["workload"] and r["metric"]
        for side in ("ours", "peer_value"):
            s = r[side]
            assert s["n"] >= 1 and s["min"] <= s["median"] <= s["max"]
            assert math.isfinite(s["median"]) and s["median"] > 0, (r["metric"], side, s)
        assert r["ratio"] > 0 and math.isclose(r["ratio"], r["ours"]["median"] / r["peer_value"]["median"])
    kv_check = [r["check"] for r in rows if r["section"] == "3. KV cache"]
    assert kv_check == ["tokens identical"] * 2 + ["next tokens identical"]  # the layouts compute the same


def test_quick_run_reports_sections_and_prints_the_table(quick_run):
    report, stdout = quick_run
    sections = report["sections"]
    assert sections["3. KV cache"]["status"] == "ok" and sections["4. attention"]["status"] == "ok"
    if not torch.cuda.is_available():
        assert sections["6. GPU"]["status"].startswith("skipped: no CUDA device")
    assert all("seconds" in s and "load_average_before" in s for s in sections.values())
    table_rows = [line for line in stdout.splitlines() if line.startswith("| 3. KV cache")]
    assert len(table_rows) == 3


def test_overrides_parse_types_and_reject_unknown_names():
    cfg = BenchConfig().with_overrides(["kv_lengths=128,512", "gpt2_layers=12", "quick=true"])
    assert cfg.kv_lengths == (128, 512) and cfg.gpt2_layers == 12 and cfg.quick is True
    with pytest.raises(ValueError, match="gpt2_layerz"):
        BenchConfig().with_overrides(["gpt2_layerz=3"])
    with pytest.raises(ValueError, match="gpt2_layers needs a int"):
        BenchConfig().with_overrides(["gpt2_layers=many"])


def test_stat_map_keeps_min_below_max_for_decreasing_functions():
    seconds = Stat.of([2.0, 4.0, 1.0])
    rate = seconds.map(lambda t: 8 / t)  # tokens/s from seconds: min and max swap
    assert (rate.median, rate.min, rate.max, rate.n) == (4.0, 2.0, 8.0, 3)


def test_targets_and_table_show_whether_a_goal_is_met():
    speed = Row("1. decode", "batch 1", "tokens/s", Stat.of([30.0]), peer="transformers",
                peer_value=Stat.of([10.0]), target=Target(">=", 1.5, text="≥ 1.5×"))
    latency = Row("5. service", "32 clients", "TTFT p99 ms", Stat.of([1200.0]), higher_is_better=False,
                  target=Target("<", 1000.0, on="value", text="< 1 s"))
    assert speed.ratio == 3.0 and speed.target_met is True
    assert latency.ratio is None and latency.target_met is False
    table = markdown_table([speed, latency]).splitlines()
    assert "3.00×" in table[2] and "✅" in table[2]
    assert "❌" in table[3] and "↓" in table[3]


def test_compare_tokens_names_the_first_difference():
    assert compare_tokens([[1, 2, 3]], [[1, 2, 3]], None, "same") == "tokens identical"
    assert compare_tokens([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]], None, "x") == "MISMATCH row 1 token 1"
    assert compare_tokens([[1, 2], [3, 4]], [[1, 2], [3, 5]], None, "x", exact=False).startswith("75% tokens agree")


def test_load_statistics_count_tokens_inside_the_window_and_spread_chunk_gaps():
    a = RequestRecord(start=0.0, chunks=[(0.5, 1), (1.0, 1), (2.0, 2)], finished=True)
    b = RequestRecord(start=1.0, chunks=[(3.5, 1), (4.5, 3)], finished=True)  # last chunk after the window
    c = RequestRecord(start=2.0, error="HTTP 429")
    result = LoadResult(concurrency=2, window_s=4.0, window_start=0.0, records=[a, b, c])
    assert result.tokens_per_s() == [(1 + 1 + 2 + 1) / 4.0]
    assert result.tokens_per_s(slices=2) == [2 / 2.0, 3 / 2.0]  # [0, 2): 0.5 and 1.0; [2, 4): 2.0 and 3.5
    assert a.inter_token_gaps() == [0.5, 0.5, 0.5]  # the 2-token chunk's 1 s gap counts as 0.5 s per token
    assert result.ttfts == [0.5, 2.5]
    assert result.errors == 1


def test_the_embeddings_load_client_keeps_its_connection_and_reads_whole_answers():
    """The lean keep-alive client of the embeddings load (benchmarks.sections.embeddings._KeepAlive), against
    a real socket server: two requests on one connection, each answer's status and whole body read
    (the second answer is split across writes), the JSON body sent as declared; an answer without
    Content-Length is refused by name."""
    import asyncio

    from benchmarks.sections.embeddings import _KeepAlive

    seen: list[bytes] = []
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        for status, body in ((200, b'{"ok": 1}'), (429, b'{"error": "busy, come back later"}'), (200, None)):
            head = await reader.readuntil(b"\r\n\r\n")
            field = next(x for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:"))
            length = int(field.split(b":")[1])
            seen.append(await reader.readexactly(length))
            if body is None:
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
            else:
                writer.write(f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:5])
                await writer.drain()
                writer.write(body[5:])
            await writer.drain()
        writer.close()

    async def main() -> list[int]:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = _KeepAlive("127.0.0.1", port)
        statuses = [await conn.post("/v1/embeddings", {"input": "a"}),
                    await conn.post("/v1/embeddings", {"input": "bé"})]
        with pytest.raises(RuntimeError, match="no Content-Length"):
            await conn.post("/v1/embeddings", {"input": "c"})
        await conn.close()
        server.close()
        await server.wait_closed()
        return statuses

    assert asyncio.run(main()) == [200, 429]
    assert connections == 1
    assert [json.loads(b) for b in seen] == [{"input": "a"}, {"input": "bé"}, {"input": "c"}]
