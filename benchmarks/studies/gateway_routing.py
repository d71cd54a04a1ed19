"""Cache-aware routing against round robin, through the same gateway, on real replicas.

``python -m benchmarks.studies.gateway_routing`` starts ``python -m deploy.fleet``'s fleet (3
replicas of SmolLM2-135M on 127.0.0.1, one native build, the SMG gateway in front) and sends
the multi-tenant workload of ``benchmarks.harness.shared_prefix`` (8 system prompts of over
1,000 tokens, each shared by 3 short user turns, all queued at once, sent 50 ms apart) through the gateway once per
policy, each policy with a fresh gateway and a new seed (so no prompt is cached from the run
before). It prints one row per run and each policy's ratios to round robin measured in the
same invocation: prompt tokens computed across the replicas, TTFT p50 and p99.
The CI test (tests/deploy/test_gateway.py) runs the same workload once per policy and asserts
the token ratio; the timing ratios are printed there, never asserted.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.harness.shared_prefix import RunResult, Workload, count_tokens, run_workload
from deploy.fleet import DEFAULT_MODEL, Fleet

COLUMNS = ("policy", "requests", "failed", "prompt_tokens", "computed_tokens", "hit_rate", "ttft_p50_s",
           "ttft_p99_s", "per_replica_requests", "wall_s")


def table(results: list[RunResult]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r.row()[c]) for c in COLUMNS) + " |" for r in results]
    return "\n".join(lines)


def ratios(result: RunResult, peer: RunResult) -> dict[str, float]:
    return {"computed_tokens": result.computed_tokens / peer.computed_tokens,
            "ttft_p50": result.ttft(50) / peer.ttft(50), "ttft_p99": result.ttft(99) / peer.ttft(99)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.gateway_routing", description=__doc__)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    parser.add_argument("--repeats", type=int, default=1, help="runs per policy, alternating policies")
    default = Workload()
    parser.add_argument("--tenants", type=int, default=default.tenants)
    parser.add_argument("--turns", type=int, default=default.turns, help="user turns per tenant")
    parser.add_argument("--concurrency", type=int, default=default.concurrency)
    parser.add_argument("--max-tokens", type=int, default=default.max_tokens)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)

    results: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="gateway-routing-") as logs, \
            Fleet(Path(logs), args.replicas, args.policies[0], args.model, kv_cache_bytes=str(768 * 2**20),
                  max_batch="8", request_timeout_s="1800") as fleet:
        seed = 0
        for _ in range(args.repeats):
            for policy in args.policies:
                seed += 1
                work = Workload(args.tenants, turns=args.turns, max_tokens=args.max_tokens,
                                concurrency=args.concurrency, seed=seed)
                if seed == 1:
                    shortest = min(count_tokens(fleet.replicas[0].url, args.model, work.system_prompts()))
                    print(f"system prompts: {args.tenants}, the shortest {shortest} tokens; "
                          f"{args.turns} turns each; {args.replicas} replicas; gateway: SMG {fleet.smg}")
                fleet.use_policy(policy)
                results.append(run_workload(fleet.url, fleet.worker_urls, args.model, work, policy))
                results[-1].extra["smg_branches"] = fleet.gateway.policy_branches()
                print(json.dumps(results[-1].row()), results[-1].extra, flush=True)
    print()
    print(table(results))
    peers = [r for r in results if r.policy == "round_robin"]
    if peers:
        print()
        for result in results:
            if result.policy != "round_robin":
                peer = peers[min(len(peers) - 1, [r for r in results if r.policy == result.policy].index(result))]
                print(f"{result.policy} / round_robin: " + ", ".join(
                    f"{k} {v:.2f}x" for k, v in ratios(result, peer).items()))
    if args.json:
        args.json.write_text(json.dumps([r.row() for r in results], indent=1))


if __name__ == "__main__":
    main()
