"""Tool use through HTTP: ``python -m service`` against ``llama-server --jinja`` on the same GGUF
file, the set in ``benchmarks/data/tool_use.json`` sent through the ``openai`` client (issue 42).

    python -m benchmarks.studies.tool_use --gguf FILE [--llama-server PATH] [--json OUT]
        [--sides ours llama-server] [--peer-from EARLIER.json] [--max-tokens 256] [--items ID ...]

Each server is started alone (never both at once: they would share the cores), with the same
thread count, and every item goes to it as one chat completion at ``temperature 0`` with
``max_tokens`` (the item's tools, ``tool_choice`` and ``parallel_tool_calls``). Scored per item:

- **right**: the answer's ``tool_calls`` are the expected calls (name, and arguments JSON-equal,
  in any order); an item expecting none is right when the answer has no ``tool_calls``;
- **non-2xx**: an answer that is not 2xx (every request in the set is valid);
- **undeclared**: a ``tool_calls`` entry naming a tool the request did not offer (must be 0);
- **text names the right call**: whether the model's own output names exactly the expected calls
  (as a set), found leniently in its raw text: any JSON object with ``name`` and
  ``arguments``/``parameters`` (or wrapped in ``function``), so ``<tool_call>`` tags, fences and
  lists need no special case, and ``name(key="value", ...)`` in Python syntax. The raw text is
  the answer's tokens as its ``logprobs`` list them (every request asks for ``logprobs``; both
  servers give the generated tokens, special ones included); an answer without them falls back
  to its ``tool_calls`` together with what is call-shaped in ``content`` (a server that fails to
  read a call leaves it there). For an item expecting no call, the text is right when it names
  no call. "Right where the text names the right call" is right / those items: how often the
  server turns what the model wrote into the answer the client should get. Under ``required``
  and named the text is what the grammar let the model write.

``--peer-from`` reuses llama-server's answers from an earlier run's JSON (the peer does not
change while our code does). Prints one markdown table per file; writes JSON (default
``benchmarks/data/tool_use-<file stem>.json``).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import time
from collections import Counter
from pathlib import Path

from benchmarks.harness import REPO_ROOT
from benchmarks.harness.server_process import ServerProcess, free_port, service_process

SET = REPO_ROOT / "benchmarks" / "data" / "tool_use.json"
LLAMA_SERVER = Path("/work/tools/llama.cpp/build/bin/llama-server")
_JSON = json.JSONDecoder()
_PY_CALL = re.compile(r"\b([A-Za-z_]\w*)\(([^()]*)\)")


def load_set(path: Path = SET) -> list[dict]:
    data = json.loads(path.read_text())
    items = data["items"]
    for item in items:
        item["tools"] = [data["tools"][name] for name in item["tools"]]
    return items


def canonical(name: str, arguments) -> tuple[str, str]:
    return name, json.dumps(arguments, sort_keys=True)


def _as_call(obj) -> tuple[str, str] | None:
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):
        obj = obj["function"]
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return canonical(obj["name"], args) if isinstance(args, dict) else None


def calls_in_text(text: str | None) -> list[tuple[str, str]]:
    """Every call-shaped thing in ``text``: JSON objects (at any depth of a list) and Python calls."""
    found, i, text = [], 0, text or ""
    while i < len(text):
        if text[i] not in "{[":
            i += 1
            continue
        try:
            obj, end = _JSON.raw_decode(text, i)
        except json.JSONDecodeError:
            i += 1
            continue
        for item in obj if isinstance(obj, list) else [obj]:
            call = _as_call(item)
            if call:
                found.append(call)
        i = end
    for m in _PY_CALL.finditer(text):
        try:
            node = ast.parse(f"f({m.group(2)})", mode="eval").body
            args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        except (SyntaxError, ValueError):
            continue
        if args and not node.args:
            found.append(canonical(m.group(1), args))
    return found


def answer_calls(answer: dict) -> list[tuple[str, str]] | None:
    """The answer's ``tool_calls`` as (name, canonical arguments); None where arguments are not JSON."""
    out = []
    for call in answer.get("tool_calls") or []:
        try:
            out.append(canonical(call["name"], json.loads(call["arguments"])))
        except json.JSONDecodeError:
            return None
    return out


def score(item: dict, answer: dict) -> dict:
    expected = Counter(canonical(c["name"], c["arguments"]) for c in item["expected"])
    offered = {t["function"]["name"] for t in item["tools"]}
    if answer["status"] != 200:
        return {"right": False, "non_2xx": True, "undeclared": 0, "text_names_right": False}
    calls = answer_calls(answer)
    if answer.get("raw") is not None:  # the tokens the model wrote, as the server's logprobs list them
        named = set(calls_in_text(answer["raw"]))
    else:
        named = set(calls or []) | set(calls_in_text(answer.get("content")))
    return {"right": calls is not None and Counter(calls) == expected, "non_2xx": False,
            "undeclared": sum(c["name"] not in offered for c in answer.get("tool_calls") or []),
            "text_names_right": named == set(expected)}


def ask(client, model: str, item: dict, max_tokens: int) -> dict:
    import openai

    extra = {"parallel_tool_calls": item["parallel_tool_calls"]} if "parallel_tool_calls" in item else {}
    start = time.perf_counter()
    try:
        r = client.chat.completions.create(model=model, messages=item["messages"], tools=item["tools"],
                                           tool_choice=item["tool_choice"], temperature=0, max_tokens=max_tokens,
                                           logprobs=True, **extra)
    except openai.APIStatusError as e:
        return {"status": e.status_code, "error": str(e)[:500], "seconds": time.perf_counter() - start}
    except openai.APIConnectionError as e:
        return {"status": 0, "error": f"connection: {e}", "seconds": time.perf_counter() - start}
    choice = r.choices[0]
    raw = "".join(e.token for e in choice.logprobs.content) if choice.logprobs and choice.logprobs.content else None
    return {"status": 200, "finish_reason": choice.finish_reason, "content": choice.message.content, "raw": raw,
            "tool_calls": [{"name": c.function.name, "arguments": c.function.arguments}
                           for c in choice.message.tool_calls or []],
            "completion_tokens": r.usage.completion_tokens if r.usage else None,
            "seconds": round(time.perf_counter() - start, 2)}


def server_for(side: str, gguf: Path, binary: Path, threads: int, log: Path, peer_threads: int | None = None
               ) -> ServerProcess:
    if side == "ours":
        env = {"TSERVE_TORCH_THREADS": str(threads), "TSERVE_LOG_LEVEL": "warning"}
        return service_process(log, "--models", str(gguf), env=env, ready_timeout_s=1800)
    port, threads = free_port(), peer_threads or threads
    argv = [str(binary), "--jinja", "-m", str(gguf), "--port", str(port), "-t", str(threads), "-tb", str(threads),
            "--parallel", "1", "-c", "8192", "--no-webui"]
    return ServerProcess(argv, log, port=port, ready_path="/health", ready_timeout_s=600)


def run_side(side: str, items: list[dict], gguf: Path, binary: Path, threads: int, max_tokens: int,
             peer_threads: int | None = None) -> dict:
    import openai

    logs = REPO_ROOT / "build" / "tool_use"
    logs.mkdir(parents=True, exist_ok=True)
    answers = {}
    with server_for(side, gguf, binary, threads, logs / f"{gguf.stem}-{side}.log", peer_threads) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=900)
        model = client.models.list().data[0].id
        for item in items:
            answers[item["id"]] = answer = ask(client, model, item, max_tokens)
            print(f"{side} {item['id']}: {answer['status']} {answer.get('finish_reason')} "
                  f"{answer.get('tool_calls') or repr((answer.get('content') or answer.get('error') or '')[:120])} "
                  f"({answer['seconds']} s)", flush=True)
    return answers


def summary(items: list[dict], answers: dict) -> dict:
    scores = {i["id"]: score(i, answers[i["id"]]) for i in items if i["id"] in answers}
    kinds = list(dict.fromkeys(i["kind"] for i in items))
    by_kind = {k: [sum(scores[i["id"]]["right"] for i in items if i["kind"] == k and i["id"] in scores),
                   sum(i["kind"] == k and i["id"] in scores for i in items)] for k in kinds}
    named = [s for s in scores.values() if s["text_names_right"]]
    return {"scores": scores, "by_kind": by_kind, "right": sum(s["right"] for s in scores.values()), "n": len(scores),
            "text_names_right": len(named), "right_where_text_names_right": sum(s["right"] for s in named),
            "non_2xx": sum(s["non_2xx"] for s in scores.values()),
            "undeclared": sum(s["undeclared"] for s in scores.values())}


def table(name: str, sides: dict[str, dict]) -> str:
    heads = list(sides)
    rows = [f"**{name}**", "", "| | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    first = next(iter(sides.values()))
    for kind in first["by_kind"]:
        rows.append(f"| {kind} | " + " | ".join(f"{s['by_kind'][kind][0]} / {s['by_kind'][kind][1]}"
                                               for s in sides.values()) + " |")
    pct = lambda a, b: f"{a} / {b} ({100 * a / b:.0f} %)" if b else "0 / 0"  # noqa: E731
    rows.append("| **right tool + arguments** | " + " | ".join(f"**{pct(s['right'], s['n'])}**"
                                                            for s in sides.values()) + " |")
    rows.append("| right, where the model's text names the right call | " + " | ".join(
        pct(s["right_where_text_names_right"], s["text_names_right"]) for s in sides.values()) + " |")
    rows.append("| non-2xx answers | " + " | ".join(str(s["non_2xx"]) for s in sides.values()) + " |")
    rows.append("| undeclared tool in `tool_calls` | " + " | ".join(str(s["undeclared"]) for s in sides.values())
                + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.tool_use", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--sides", nargs="+", default=["ours", "llama-server"], choices=["ours", "llama-server"])
    parser.add_argument("--peer-from", type=Path, help="llama-server's answers from an earlier run's JSON")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--peer-threads", type=int, help="llama-server's threads (default --threads): its spinning "
                        "threads slow to a crawl on cores other jobs share, where 1 thread does not")
    parser.add_argument("--items", nargs="*", help="only these item ids")
    args = parser.parse_args(argv)
    items = [i for i in load_set() if not args.items or i["id"] in args.items]
    report = {"gguf": str(args.gguf), "llama_server": str(args.llama_server), "max_tokens": args.max_tokens,
              "threads": args.threads, "peer_threads": args.peer_threads or args.threads,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "answers": {}}
    if args.peer_from:
        earlier = json.loads(args.peer_from.read_text())
        report["answers"]["llama-server"] = earlier["answers"]["llama-server"]
        report["peer_from"] = str(args.peer_from)
    out = args.json or REPO_ROOT / "benchmarks" / "data" / f"tool_use-{args.gguf.stem}.json"
    for side in args.sides:
        if side not in report["answers"]:
            report["answers"][side] = run_side(side, items, args.gguf, args.llama_server, args.threads, args.max_tokens,
                                               args.peer_threads)
            out.write_text(json.dumps(report, indent=1) + "\n")  # each side kept as soon as it is done
    sides = {side: summary(items, report["answers"][side]) for side in ("ours", "llama-server")
             if side in report["answers"]}
    report["summary"] = sides
    for side, s in sides.items():
        misses = [k for k, v in s["scores"].items() if not v["right"]]
        print(f"{side} missed: {', '.join(misses) or 'none'}")
    print(table(args.gguf.name, sides))
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
