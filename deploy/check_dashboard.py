"""Checks the provisioned Grafana dashboard against Prometheus and against the service.

    python3 deploy/check_dashboard.py                          # queries parse (promtool), panels complete
    python3 deploy/check_dashboard.py --metrics metrics.txt    # + every queried metric is exported

- every panel uses the provisioned datasource (its uid);
- every query is valid PromQL: Grafana's variables are replaced by values and the queries go
  through `promtool check rules` as recording rules;
- the dashboard shows what operators need (REQUIRED below);
- with --metrics (a /metrics scrape of a running service), every tserve_* metric that the
  dashboard or deploy/prometheus-rules.yml queries is one the service exports.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

DEPLOY = Path(__file__).resolve().parent
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "transformer-serve.json"
DATASOURCE = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
RULES = DEPLOY / "prometheus-rules.yml"
# Grafana's variables, replaced by what they expand to at query time.
VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$model": ".*"}
# What the dashboard must show (issue 6): a metric, and for histograms the quantiles.
REQUIRED = {
    "requests/s by endpoint and status": r"rate\(tserve_requests_total\{[^}]*\}\[[^\]]+\]\)",
    "TTFT quantiles": r"histogram_quantile\(0\.99, .*tserve_time_to_first_token_seconds_bucket",
    "inter-token latency quantiles": r"histogram_quantile\(0\.99, .*tserve_inter_token_latency_seconds_bucket",
    "generated tokens/s": r"rate\(tserve_generated_tokens_total",
    "queue depth": r"tserve_waiting_requests",
    "running requests": r"tserve_running_requests",
    "batch size (gauge)": r"tserve_batch_size\{",
    "batch size (per-step histogram)": r"histogram_quantile\(0\.99, .*tserve_step_batch_size_bucket",
    "KV-cache usage": r"tserve_kv_cache_usage_ratio",
    "rejected requests": r"tserve_rejected_requests_total",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) for every query of every panel, rows included."""
    found = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                found.append((inner["title"], target["expr"]))
    return found


def expand(expr: str) -> str:
    for var, value in VARIABLES.items():
        expr = expr.replace(var, value)
    leftover = re.findall(r"\$\w+", expr)
    if leftover:
        raise ValueError(f"unknown Grafana variable(s) {leftover} in {expr!r}")
    return expr


def check_datasources(dashboard: dict) -> list[str]:
    uid = re.search(r"^\s*uid:\s*(\S+)", DATASOURCE.read_text(), re.MULTILINE).group(1)
    problems = []
    for panel in dashboard["panels"]:
        if panel["type"] != "row" and panel.get("datasource", {}).get("uid") != uid:
            problems.append(f"panel {panel['title']!r} does not use the provisioned datasource uid {uid!r}")
    return problems


def check_promql(exprs: list[tuple[str, str]], promtool: str) -> list[str]:
    """Valid PromQL: promtool parses every query as the expression of a recording rule."""
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for i, (_, expr) in enumerate(exprs):
        lines += [f"      - record: dashboard:query_{i}", f"        expr: {json.dumps(expand(expr))}"]
    with tempfile.NamedTemporaryFile("w", suffix=".yml", delete=False) as rules:
        rules.write("\n".join(lines) + "\n")
    result = subprocess.run([promtool, "check", "rules", rules.name], capture_output=True, text=True, check=False)
    Path(rules.name).unlink()
    if result.returncode != 0:
        return [f"promtool rejects a dashboard query:\n{result.stdout}{result.stderr}"]
    return []


def check_required(exprs: list[tuple[str, str]]) -> list[str]:
    text = "\n".join(expr for _, expr in exprs)
    return [f"no panel shows {what}" for what, pattern in REQUIRED.items() if not re.search(pattern, text)]


def exported_families(metrics_text: str) -> set[str]:
    return {line.split()[2] for line in metrics_text.splitlines() if line.startswith("# TYPE ")}


def check_against_metrics(exprs: list[tuple[str, str]], metrics_text: str) -> list[str]:
    families = exported_families(metrics_text)
    queried = set(re.findall(r"\btserve_[a-z0-9_]+", "\n".join(e for _, e in exprs) + RULES.read_text()))
    problems = []
    for name in sorted(queried):
        base = next((name[: -len(s)] for s in HISTOGRAM_SUFFIXES if name.endswith(s)), name)
        if name not in families and base not in families:
            problems.append(f"{name} is queried but the service exports no such metric")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics", type=Path, help="a /metrics scrape of a running service")
    parser.add_argument("--promtool", default="promtool")
    args = parser.parse_args()

    dashboard = json.loads(DASHBOARD.read_text())
    exprs = queries(dashboard)
    problems = check_datasources(dashboard) + check_required(exprs) + check_promql(exprs, args.promtool)
    if args.metrics:
        problems += check_against_metrics(exprs, args.metrics.read_text())
    for problem in problems:
        print(f"dashboard: {problem}", file=sys.stderr)
    if not problems:
        what = "; all queried metrics exported" if args.metrics else ""
        print(f"dashboard: {len(exprs)} queries in {len(dashboard['panels'])} panels valid{what}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
